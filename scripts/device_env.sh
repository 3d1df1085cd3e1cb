# Source on the GPU machine at the start of a device call: `source scripts/device_env.sh <commit>`.
# Installs the wheels carried in .whl/ (build them here first: ../shared/device/wheels.sh serve, then job, then
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform any -d .whl trl==1.16.0 accelerate==1.15.0
# about 31 MiB in all; carry [".whl"]) into /tmp/site once per machine, and exports what the benchmarks and
# scripts/gpu_check.sh read: PYTHONPATH, COMMIT (the machine has no .git: pass the commit you run at).
if [ ! -d /tmp/site/fastapi ] && ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
# Ray (~44 MiB: ../shared/device/wheels.sh ray, moved to .wray/) travels in its own call (carry [".wray"]); it
# stays in /tmp/site while the machine is warm, so the next call can carry .whl and run the pool's GPU tests.
if [ ! -d /tmp/site/ray ] && ls .wray/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .wray/*.whl 2>&1 | tail -2
fi
export PYTHONPATH=$PWD:/tmp/site PYTEST_ADDOPTS=-rs PYTHONUNBUFFERED=1
export COMMIT=${1:-${COMMIT:-unknown}}

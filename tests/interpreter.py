"""Run Triton kernel checks in a child process under the interpreter (CPU CI).

Triton decides between compiling and interpreting when a kernel is *defined*, so the checks run in a
child started with TRITON_INTERPRET=1 (the test file executed as a script) and report one verdict per
check as a JSON line; the pytest process itself never imports the kernel modules.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_checks(checks: dict[str, Callable[[], None]]) -> dict[str, str]:
    """In the child: "ok" or the traceback of each check."""
    verdicts = {}
    for name, check in checks.items():
        try:
            check()
            verdicts[name] = "ok"
        except Exception:  # noqa: BLE001 - reported back to the pytest process
            verdicts[name] = traceback.format_exc()
    return verdicts


def child_main(checks: dict[str, Callable[[], None]]) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest, or with TRITON_INTERPRET=1"
    import torch

    torch.manual_seed(0)
    print(json.dumps(run_checks(checks)))


def child_verdicts(test_file: str) -> dict[str, str]:
    """In the pytest process: run ``test_file`` as a script under the interpreter, return its verdicts."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, test_file], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, f"interpreter child failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])

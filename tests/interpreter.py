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


def patch_helpers_once_per_launch() -> None:
    """Triton 3.9's interpreter patches ``triton.language`` again (``_patch_lang``: an ``inspect.getmembers`` walk
    over its modules) at every call of a ``@triton.jit`` helper inside a kernel, though nothing undoes a helper's
    patch before the launch ends: that walk was ~40% of the checks' time. Here a helper is patched at its first call
    in each launch and its later calls in that launch skip the walk; kernel outputs are bit for bit the same (decode,
    prefill, fp8 and sampling launches compared). A Triton without these internals is left as it is."""
    from triton.runtime import interpreter

    patch_lang, executor = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or executor is None:
        return
    launch = executor.__call__
    patched: set = set()  # the functions patched since the current launch began

    class Unchanged:
        def restore(self) -> None:  # a repeat is a helper's call, which drops its scope unrestored anyway
            pass

    def patch_once(fn):
        if fn in patched:
            return Unchanged()
        scope = patch_lang(fn)
        patched.add(fn)
        return scope

    def fresh_launch(self, *args, **kwargs):
        patched.clear()
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()

    interpreter._patch_lang, executor.__call__ = patch_once, fresh_launch


def child_main(checks: dict[str, Callable[[], None]]) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest, or with TRITON_INTERPRET=1"
    import torch

    patch_helpers_once_per_launch()
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

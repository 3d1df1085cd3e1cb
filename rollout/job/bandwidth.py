"""The device's copy bandwidth, measured once at job start: the denominator of the round's floor ratio.

The engine counts the bytes its steps had to read (weights + live KV, ``EngineStats.bytes_read``); over
this bandwidth that is the time the steps could at best have taken, and over the compute-stream time they
did take it is the floor ratio (1.0 = every step ran at the copy bandwidth). Measured as ``scripts/bench.py``
does, with a smaller buffer, before the engine takes its memory.
"""

from __future__ import annotations

import torch


def copy_bandwidth(device: str | torch.device | None = None, nbytes: int = 1 << 30, iters: int = 20) -> float | None:
    """Bytes per second (read + written) of a device-to-device copy; None off CUDA (no floor on the CPU)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            y.copy_(x)
        end.record()
        torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    del x, y
    torch.cuda.empty_cache()
    return 2 * nbytes / seconds if seconds > 0 else None

"""Read back what an offline W&B run recorded (its ``run-*.wandb`` file), for tests.

The file is wandb's record log: a 7-byte header, then LevelDB-style 32 KiB blocks of chunks (CRC32, length,
type: full / first / middle / last), each record a ``wandb_internal_pb2.Record``. Only history keys and
config keys are read.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

_BLOCK, _HEADER = 32768, 7


def _records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    pos, pending = _HEADER, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # zero padding up to the block's end
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
            pending = b""


def read_run(root: str | Path) -> tuple[set[str], set[str]]:
    """(history keys, top-level config keys) of the single offline run under ``root`` (searched recursively)."""
    import wandb
    from wandb.proto import wandb_internal_pb2 as pb

    wandb.teardown()  # the wandb-core service writes the file asynchronously; this waits for it to finish
    files = sorted(Path(root).rglob("run-*.wandb"))
    assert len(files) == 1, f"expected one offline W&B run under {root}, found {files}"
    history, config = set(), set()
    for raw in _records(files[0]):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.update(i.key or "/".join(i.nested_key) for i in record.history.item)
        elif kind in ("config", "run"):  # wandb.init(config=...) rides on the run record
            updates = record.config.update if kind == "config" else record.run.config.update
            config.update(u.key or u.nested_key[0] for u in updates)
    return history, config

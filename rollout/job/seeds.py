"""Per-request seeds derived from the job's seed, so a resumed run repeats an uninterrupted one exactly.

The engine draws a seed for an unseeded request from a generator that starts afresh with every
process; a resume would then sample differently from the run it continues. Instead every request's
seed is a hash of (job seed, round, group) and the engine derives each sample's seed from it and the
sample index. With ``sampling.seed=null`` the job seed is drawn once at the first start and kept in
config.json, so the run is still random but repeatable across its own resumes.
"""

from __future__ import annotations

import hashlib
import secrets

SEED_BITS = 63


def new_job_seed() -> int:
    return secrets.randbits(SEED_BITS)


def request_seed(job_seed: int, round_: int, group: int) -> int:
    """A 63-bit hash of the three (never a job seed reduced to fewer bits: two seeds never share their requests')."""
    if isinstance(job_seed, bool) or not isinstance(job_seed, int) or not 0 <= job_seed < 2**64:
        raise ValueError(f"job seed {job_seed!r} is invalid: must be an int in [0, 2**64) (sampling.seed)")
    digest = hashlib.blake2b(f"{job_seed}:{round_}:{group}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << SEED_BITS) - 1)

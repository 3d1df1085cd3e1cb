"""``RolloutPool.sleep`` / ``wake_up`` over the replicas: ``Engine``'s semantics, kept across replica deaths.

Each pool member keeps the level it was asked to sleep at (``_Member.sleep_level``, 0 = awake); that is
the pool's truth, and what a replacement is brought to. Three rules follow ``Engine``:

- sleeping needs no request in flight: the pool refuses ``sleep`` while a round runs (an engine refuses
  it with requests running), and sleeping twice keeps the first level (as ``Engine.sleep`` does);
- no work goes to a sleeping replica: ``generate`` on a pool with any replica asleep raises, as
  ``Engine.generate`` does when asleep (a round on the others alone would quietly run at a fraction of
  the pool's speed), and the dispatcher counts a sleeping replica as unable to take work;
- weights pushed while asleep land (``Engine.update_weights`` writes into the KV-less engine, at level 2
  into its weights on the CPU) and are served after ``wake_up``; every replica, asleep or not, reaches the
  pushed ``policy_version``.

A replica found dead by a sleep / wake call is replaced at once; a replacement catches up to the pool's
weights and then sleeps at its slot's level before it counts as active (``RolloutPool._catch_up``), so a
replica that died while the pool slept comes back asleep with the current weights. Both calls return
only once every replica is active again, so the memory ``sleep`` frees is free when it returns.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

RolloutPool = Any  # rollout.pool.pool.RolloutPool, which imports this module (not imported back: no circle)


def check_indices(replicas: Any, n: int, what: str = "replicas") -> list[int]:
    """Sorted unique replica indices; ValueError/TypeError naming the bad value and the allowed range."""
    if isinstance(replicas, (str, bytes)) or not isinstance(replicas, Iterable):
        raise TypeError(f"{what} must be a list of replica indices in 0..{n - 1} or None (all), got {replicas!r}")
    out = list(replicas)
    bad = [i for i in out if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n]
    if bad or not out:
        raise ValueError(f"{what} must be a non-empty list of replica indices in 0..{n - 1} or None (all), "
                         f"got {replicas!r}")
    return sorted(set(out))


def put_to_sleep(pool: RolloutPool, level: int, indices: list[int]) -> int:
    """Sleep ``indices`` at ``level``; the bytes the replicas released on their devices."""
    if isinstance(level, bool) or level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
    with pool._lock:
        if pool._rounds_open:
            raise RuntimeError("sleep() while a round is running; finish it (or close its generate_iter) first")
        pool.wait_ready()
        todo = [i for i in indices if not pool.members[i].sleep_level]  # asleep already: keeps its level
        released = _call_each(pool, todo, level, "sleep", level)
        pool.wait_ready()  # a replacement falls asleep before this returns
        return sum(r or 0 for r in released)


def wake(pool: RolloutPool, indices: list[int]) -> None:
    """Wake ``indices`` (those asleep); returns once every replica is active."""
    with pool._lock:
        pool.wait_ready()
        todo = [i for i in indices if pool.members[i].sleep_level]
        _call_each(pool, todo, 0, "wake_up")
        pool.wait_ready()


def _call_each(pool: RolloutPool, indices: list[int], level: int, method: str, *args: Any) -> list[Any]:
    """``method`` on each replica at once; its slot's level becomes ``level`` when it answered or died (the
    replacement is then started and brought to ``level``). A replica's own refusal is raised after all
    answered, its slot's level unchanged."""
    ray = pool.ray
    refs = [(i, getattr(pool.members[i].actor, method).remote(*args)) for i in indices]
    answers: list[Any] = []
    errors: list[BaseException] = []
    for i, ref in refs:
        try:
            answers.append(ray.get(ref, timeout=pool.start_timeout_s))
        except ray.exceptions.RayActorError:
            pool.members[i].sleep_level = level
            pool._replace(i, f"actor died (found at {method})", [])
            continue
        except ray.exceptions.RayTaskError as e:
            errors.append(e.as_instanceof_cause())
            continue
        pool.members[i].sleep_level = level
    if errors:
        raise errors[0]
    return answers

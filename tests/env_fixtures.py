"""Environments for the environment-loop tests: deterministic turn counts and every fault the loop must survive."""

from __future__ import annotations

import asyncio
import threading
import time


class ThreeTurns:
    """A ``step`` environment that always answers twice, so every conversation has three model turns."""

    def reset(self, **row) -> str | None:
        self.seen: list[str] = []
        return " Reply three times."

    def step(self, completion_text: str) -> str | None:
        self.seen.append(completion_text)
        return None if len(self.seen) >= 3 else f"Turn {len(self.seen)} done. Again."

    def get_reward(self) -> float:
        return float(len(self.seen))


ENDED: dict[str, float] = {}  # row id -> when its conversation ended (get_reward's call)


class ScriptedTools:
    """A tool environment for a scripted policy (the tiny model cannot call tools: the test's loop injects the
    first turn's calls from the row); its tools cover each fault case."""

    def reset(self, **row) -> str | None:
        self.kind, self.id = row.get("kind", "ok"), row.get("id", "")
        if self.kind == "reset_raises":
            raise RuntimeError("reset failed on purpose")
        return None

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first.
            b: The second.
        """
        return a + b

    def boom(self) -> str:
        """Always raises."""
        raise ValueError("boom on purpose")

    def hang(self) -> str:
        """Never returns within the test's timeout."""
        HANG.wait(30)
        return "late"

    def huge(self) -> str:
        """Returns one megabyte."""
        return "x" * (1 << 20)

    async def slow(self, seconds: float) -> str:
        """Sleeps, asynchronously.

        Args:
            seconds: How long.
        """
        await asyncio.sleep(seconds)
        return "slept"

    def get_reward(self) -> float:
        ENDED[self.id] = time.monotonic()
        return 1.0


HANG = threading.Event()  # set by tests to release hung tool threads at the end


class SlowStep(ThreeTurns):
    """A step environment whose replies take a while (a sync sleep), to show others keep decoding."""

    def step(self, completion_text: str) -> str | None:
        time.sleep(0.3)
        return super().step(completion_text)


class BadReward(ThreeTurns):
    def get_reward(self):
        return "not a number"


class StepRaises(ThreeTurns):
    def step(self, completion_text: str) -> str | None:
        raise KeyError("no such state")

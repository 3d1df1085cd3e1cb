"""A ``step``-style environment: guess a number in up to three tries, told "higher" or "lower" after each.

    rollout.env=rollout.envs.guess:GuessNumberEnv

The secret derives from the row (its ``answer`` if it is an integer, else a hash of its prompt), so a run
is repeatable. Reward: 1.0 for a right guess on the first try, 0.5 on a later one, else 0.0.
"""

from __future__ import annotations

import zlib

from rollout.rl.rewards import last_integer

LOW, HIGH, TRIES = 0, 100, 3


class GuessNumberEnv:
    def reset(self, **row) -> str | None:
        answer = last_integer(str(row.get("answer", "")))
        if answer is None:
            answer = zlib.crc32(str(row.get("prompt", "")).encode())
        self.secret = LOW + answer % (HIGH - LOW)
        self.tries, self.solved_at = 0, None
        return f" Guess my number between {LOW} and {HIGH - 1}; you have {TRIES} tries."

    def step(self, completion_text: str) -> str | None:
        self.tries += 1
        guess = last_integer(completion_text)
        if guess == self.secret:
            self.solved_at = self.tries
            return None
        if self.tries >= TRIES:
            return None
        if guess is None:
            return "That is not a number. Guess again."
        return "Higher." if guess < self.secret else "Lower."

    def get_reward(self) -> float:
        if self.solved_at is None:
            return 0.0
        return 1.0 if self.solved_at == 1 else 0.5

"""Environments for tests/test_environments.py: good ones, and the ways a user's environment goes wrong."""
import random


class Dice:
    """Draws a target in reset (with Python's random) and shows it."""

    def reset(self, **row) -> str:
        self.target = random.randint(1, 10**6)
        self.row = row
        self.rolls = 0
        return f" (target {self.target})"

    def roll(self, times: int) -> str:
        """Roll the dice.

        Args:
            times: how many times
        """
        self.rolls += times
        return str(self.rolls)

    def get_reward(self) -> float:
        return float(self.rolls)


class Quiet:
    """Shows nothing, scores nothing."""

    def reset(self, **row) -> None:
        pass

    def ping(self) -> str:
        """Answers pong."""
        return "pong"


class NoReset:
    def ping(self) -> str:
        """Answers pong."""
        return "pong"


class Undocumented:
    def reset(self, **row) -> None:
        pass

    def act(self, x):
        return x


class Broken:
    def __init__(self):
        raise RuntimeError("cannot open the board")


class BadReset:
    def reset(self, **row) -> None:
        raise KeyError("level")

    def ping(self) -> str:
        """Answers pong."""
        return "pong"

"""Tools for tests/test_tools.py: good ones, and the ways a user's tool goes wrong."""
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def fails(x: int) -> int:
    """Always raises.

    Args:
        x: anything
    """
    raise ValueError(f"no luck with {x}")


def hangs(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke"


class _NoStr:
    def __str__(self):
        raise RuntimeError("cannot print me")


def unprintable() -> str:
    """Returns what str() cannot print."""
    return _NoStr()


def untyped(a, b):
    """No type hints.

    Args:
        a: x
        b: y
    """
    return a


def no_docstring(a: int) -> int:
    return a

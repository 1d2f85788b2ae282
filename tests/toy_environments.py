"""Environments and tools written as a user would, importable by path in tests (``toy_environments:...``)."""

from __future__ import annotations


class GuessTheNumber:
    """Guess a number from 0 to 9 in a few tries: the plain form of the environment protocol, in ten lines."""

    def __init__(self, row: dict):
        self.target = int(row["target"])

    def reset(self) -> str:
        return "Guess my number (0-9)."

    def step(self, completion: str) -> tuple[str | None, float | None, bool]:
        digits = [c for c in completion if c.isdigit()]
        if digits and int(digits[0]) == self.target:
            return None, 1.0, True
        return "Higher." if digits and int(digits[0]) < self.target else "Lower.", 0.0, False


class Broken:
    """An environment whose step raises."""

    def __init__(self, row: dict):
        pass

    def reset(self) -> str:
        return "hello"

    def step(self, completion: str):
        raise RuntimeError("the environment broke")


class WrongShape(Broken):
    def step(self, completion: str):
        return "just a string"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b

"""A reward with spread for a random tiny model (GSM8K correctness is ~always 0 for it), loaded by import path."""


def digit_fraction(completion: str, answer: str, **kwargs) -> float:
    """Fraction of characters that are digits: varies between completions, so groups have variance."""
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)


def flaky(completion: str, answer: str, **kwargs) -> float:
    """Raises on completions that start with a vowel-free character, otherwise scores like digit_fraction."""
    if completion and completion[0] in "aeiouAEIOU0123456789 ":
        raise RuntimeError("reward function failed on this completion")
    return digit_fraction(completion, answer)


def has_digit(completion: str, answer: str, **kwargs) -> float:
    """1 when the completion contains a digit: about half of a random tiny model's short samples do."""
    return float(any(ch.isdigit() for ch in completion))


def always_one(completion: str, answer: str, **kwargs) -> float:
    """1 whatever the completion: a judge under which every sample passes."""
    return 1.0

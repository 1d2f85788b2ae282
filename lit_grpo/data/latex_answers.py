"""LaTeX final answers judged by math-verify: the ``math_verify`` reward of competition math (MATH, AIME,
DeepScaleR), where golds are LaTeX (``\\frac{\\sqrt{3}}{2}``, ``3\\sqrt{13}``, ``\\text{(C)}``, ``[2, 5)``) rather
than GSM8K's numbers.

What a completion's answer *is* is decided here, by rules math-verify does not know about: a reasoning model's
thought is not its answer, so only the text after the last ``</think>`` counts, and a completion still inside a
``<think>`` has none; the answer is the last ``\\boxed{...}`` of that text, its braces balanced, and a last box cut
off by the token budget is no answer (an earlier, complete box is a draft, not the final answer). Whether that
answer *equals* the gold is math-verify's judgement (fractions, roots, pi, intervals, sets and tuples, percent,
text choices, thousands separators).

math-verify bounds its parsing with ``signal.alarm``, which raises outside the main thread; rewards run on a
reward thread (:class:`lit_grpo.data.rewards.RewardRunner`, which bounds every call in time), so its own timeouts
are off here and its warning that says so is silenced.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

from math_verify import parse, verify

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_BOXED = re.compile(r"\\boxed\s*\{")
# a gold math-verify surely parses, so the check before training skips its (10 to 100 ms) parse
_PLAIN_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


class _DropDisabledTimeoutWarning(logging.Filter):
    """Silences math-verify's "timeout is disabled" warning.

    Its own timeout uses ``signal.alarm``, which raises in any thread but the main one, so this project turns it
    off on purpose and relies on :class:`lit_grpo.data.rewards.RewardRunner`'s per-call timeout instead.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropDisabledTimeoutWarning())


# ----------------------------------------------------------------------------------------------------------
# Where the answer is
# ----------------------------------------------------------------------------------------------------------


def closing_braces(text: str) -> dict[int, int]:
    """Index of each ``{`` that is closed -> index of its ``}``, in one pass (linear even on junk input)."""
    closing, open_positions = {}, []
    for i, ch in enumerate(text):
        if ch == "{":
            open_positions.append(i)
        elif ch == "}" and open_positions:
            closing[open_positions.pop()] = i
    return closing


def last_closed_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` whose braces balance, skipping a truncated last one (the correctness
    reward's rule: GSM8K's numeric answer may still sit in an earlier box)."""
    boxes = list(_BOXED.finditer(text))
    if not boxes:
        return None
    closing = closing_braces(text)
    for match in reversed(boxes):
        end = closing.get(match.end() - 1)
        if end is not None:
            return text[match.end() : end]
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, or ``None`` when there is none or its braces never close (the
    completion was cut off inside its final answer)."""
    boxes = list(_BOXED.finditer(text))
    if not boxes:
        return None
    end = closing_braces(text).get(boxes[-1].end() - 1)
    return None if end is None else text[boxes[-1].end() : end]


def answer_section(completion: str) -> str | None:
    """The part of a completion that holds its answer: what follows the last ``</think>`` (the chat template of
    DeepSeek-R1's distilled models opens ``<think>`` in the prompt, so ``</think>`` may come without ``<think>``),
    or the whole text when it has no ``</think>``; ``None`` while a ``<think>`` is still open there."""
    after = completion.rsplit(THINK_CLOSE, 1)[1] if THINK_CLOSE in completion else completion
    return None if THINK_OPEN in after else after


def boxed_answer(completion: str) -> str | None:
    """The final answer of a completion: the last balanced ``\\boxed{}`` after its thinking, ``None`` without one."""
    section = answer_section(completion)
    return None if section is None else last_boxed(section)


# ----------------------------------------------------------------------------------------------------------
# Judging it
# ----------------------------------------------------------------------------------------------------------


def gold_text(answer: str) -> str:
    """The gold of an answer cell: the text after the last ``####`` of a GSM8K-style solution, else all of it."""
    return (answer.rsplit("####", 1)[1] if "####" in answer else answer).strip()


def parse_latex(text: str) -> list[Any]:
    """math-verify's parse of a bare LaTeX answer (``\\frac{1}{2}``), read as a box so that math-verify's LaTeX
    extraction applies (bare, it would read only a leading number: ``3\\sqrt{13}`` as 3); text that is already
    delimited (``$...$``, ``\\boxed{...}``) is parsed as it is."""
    delimited = text.startswith("$") and text.endswith("$") or _BOXED.search(text) is not None
    return parse(text if delimited else f"\\boxed{{{text}}}", parsing_timeout=None)


@functools.lru_cache(maxsize=65_536)
def _parsed_gold(gold: str) -> tuple[Any, ...]:
    """A gold's parse, kept: each is judged against G completions, and parsing costs far more than comparing."""
    return tuple(parse_latex(gold))


def gold_problem(answer: str) -> str | None:
    """Why math-verify cannot judge completions against the gold of ``answer`` (``None``: it can): the check a data
    module runs on every row before training, so that a bad gold is refused then, not scored 0 all run long."""
    gold = gold_text(answer)
    if not gold:
        return "is empty"
    if _PLAIN_NUMBER.fullmatch(gold):
        return None
    if not any(not isinstance(item, str) for item in _parsed_gold(gold)):
        return "is LaTeX math-verify cannot parse"
    return None


def math_verify_reward(completion: str, answer: str, **kwargs: object) -> float:
    """1.0 when the completion's final answer equals the gold by math-verify's judgement, else 0.0.

    The final answer is the last ``\\boxed{...}`` after the last ``</think>`` (:func:`boxed_answer`): none, a box
    cut off, or a ``<think>`` still open score 0. ``answer`` is the gold in LaTeX (``\\frac{\\sqrt{3}}{2}``,
    ``\\text{(C)}``), or a GSM8K-style solution whose gold follows ``####``.
    """
    box = boxed_answer(completion)
    if box is None or not box.strip():
        return 0.0
    gold = _parsed_gold(gold_text(answer))
    pred = parse_latex(box)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(list(gold), pred, timeout_seconds=None) else 0.0


#: the data module checks every row's gold with it before training (:func:`gold_problem`)
math_verify_reward.check_answer = gold_problem  # type: ignore[attr-defined]

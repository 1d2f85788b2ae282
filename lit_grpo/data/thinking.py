"""A reasoning model's thought opened by its prompt: DeepSeek-R1-Distill's chat template ends the generation prompt
with ``<think>\\n``, so a completion holds the rest of the thought, then ``</think>``, then the answer.

Read alone, such a completion that never closes its thought looks like one without thinking, all of it answer: an
answer boxed inside the unfinished thought would be rewarded. So the rewards judge the completion after the
``<think>`` its prompt opened (:func:`judged_text`), where :func:`lit_grpo.data.latex_answers.answer_section` sees the
thought still open, and a completion whose thought never ends counts as truncated (:func:`unfinished_thought`): it
ran out before its answer, like one cut at ``max_new_tokens``.

Pure functions of text; what a thought is (the last ``</think>`` ends it) is the one rule of ``latex_answers``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lit_grpo.data.latex_answers import THINK_CLOSE, THINK_OPEN, answer_section


def prompt_opens_thought(prompt_text: str) -> bool:
    """Whether a prompt leaves a thought open for its completion to go on with: it has a ``<think>`` with no
    ``</think>`` after it (an earlier turn's closed thought does not count)."""
    return THINK_OPEN in prompt_text and THINK_CLOSE not in prompt_text.rsplit(THINK_OPEN, 1)[1]


def prompt_ids_open_thought(tokenizer: Any, prompt_ids: Sequence[int]) -> bool:
    """:func:`prompt_opens_thought` of a tokenized prompt. Decoded as completions are, special tokens skipped: a
    tokenizer whose think tags are special drops them from both, so a completion's ``</think>`` is never looked for
    where decoding would have removed it."""
    return prompt_opens_thought(tokenizer.decode(list(prompt_ids), skip_special_tokens=True))


def judged_text(completion_text: str, opened: bool) -> str:
    """The text the rewards judge of a completion: after the ``<think>`` its prompt opened (``opened``), else as it
    is. A completion that never writes ``</think>`` then holds no answer."""
    return THINK_OPEN + completion_text if opened else completion_text


def unfinished_thought(completion_text: str, opened: bool) -> bool:
    """Whether a completion ends inside a thought: after the last ``</think>`` of its judged text
    (:func:`judged_text`) a ``<think>`` is still open, its prompt's (``opened``) or its own."""
    return answer_section(judged_text(completion_text, opened)) is None


__all__ = ["judged_text", "prompt_ids_open_thought", "prompt_opens_thought", "unfinished_thought"]

"""A conversation as one token sequence: the environment's messages become tokens; the model's are never touched.

A trajectory is the prompt, then the model's tokens exactly as sampled, then the environment's tokens, and so on.
The environment's tokens are the rendered difference between the conversation before and after its messages: the
chat template renders the whole conversation with the new messages and the next assistant opening, and the part
after the text the trajectory already holds is tokenized on its own. The model's tokens are never decoded and
encoded again, so the trainer scores exactly the tokens the sampler produced, whatever the template does with
earlier turns (peers' re-tokenization drift: TRL PR 6250, verl 6854, prime-rl 1334).

When the template renders the earlier turns differently from the trajectory (it strips ``<think>`` blocks, trims
whitespace, or the sampled tokens decode to text the template writes another way), the rendering no longer
continues the trajectory's text. That is detected (``Continuation.template_mismatch``, said once in one line by the
caller) and the environment's tokens are then rendered against a stand-in history: the template's text after an
assistant message (its closing, less what the model already sampled of it) and the new messages as they render
after any assistant turn. The model still trains on exactly what it saw; its context then differs from what the
template would give it at inference time, which is what the warning says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Messages = list[dict[str, Any]]
#: a stand-in history for the fallback rendering (any text the template keeps as written)
PROBE = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "PROBE_ANSWER_TEXT"}]


class RenderingError(ValueError):
    """The template cannot render the environment's messages after the conversation (one line naming why)."""


@dataclass(frozen=True)
class Continuation:
    """The environment's tokens after a model turn, their text, and whether the template disagreed with the
    trajectory's earlier turns."""

    token_ids: list[int]
    text: str
    template_mismatch: bool = False


class ConversationRenderer:
    """Renders prompts and the environment's turns with a tokenizer's chat template (``tools``: their JSON schemas,
    passed to the template, which lists them as it was trained to; ``system_prompt``: put first when the
    conversation has no system message of its own)."""

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None, system_prompt: str | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("multi-turn rollouts need a tokenizer with a chat template (to render the environment's "
                             "messages); this tokenizer has none")
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.system_prompt = system_prompt
        self._closing: str | None = None
        self._special_ids = frozenset(tokenizer.all_special_ids)  # a property transformers rebuilds on every read

    def render(self, messages: Messages, add_generation_prompt: bool) -> str:
        """``messages`` as the chat template writes them. A template that raises on them (the Llama-2, Mistral and
        Gemma templates ``raise_exception`` on a role they do not know, or on roles that do not alternate) raises
        :class:`RenderingError` in one line: the messages came from the environment, so the caller counts it as the
        environment's error."""
        kwargs = {"tools": self.tools} if self.tools else {}
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:  # jinja2's TemplateError, or whatever the template's own code raises on a message
            raise RenderingError(f"the chat template raised {type(e).__name__}: {' '.join(str(e).split())}") from e

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        """The text of sampled tokens as the conversation holds them (special tokens kept: an end-of-turn token the
        model sampled is part of what the template writes)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def turn_content(self, token_ids: list[int]) -> str:
        """A model turn's text as the conversation's assistant message holds it: its tokens decoded with the special
        ones kept, less the special tokens it ends with (its end of turn, which the template writes itself)."""
        end = len(token_ids)
        while end and token_ids[end - 1] in self._special_ids:
            end -= 1
        return self.decode(token_ids[:end])

    def with_system(self, messages: Messages) -> Messages:
        if self.system_prompt and not any(m.get("role") == "system" for m in messages):
            return [{"role": "system", "content": self.system_prompt}, *messages]
        return list(messages)

    def prompt(self, messages: Messages) -> tuple[list[int], str]:
        """The first prompt: the conversation so far and the assistant's opening, as token ids and text."""
        text = self.render(messages, add_generation_prompt=True)
        return self.encode(text), text

    def continuation(self, conversation: Messages, new_messages: Messages, held_text: str,
                     turn_text: str) -> Continuation:
        """The tokens of ``new_messages`` after ``conversation`` (which ends with the model's last turn), given
        ``held_text``, the text of every token the trajectory holds, and ``turn_text``, that of the model's last
        turn."""
        after = self.render([*conversation, *new_messages], add_generation_prompt=True)
        if after.startswith(held_text):
            text = after[len(held_text):]
            return Continuation(self.encode(text), text)
        text = self._closing_remainder(turn_text) + self._after_assistant(new_messages)
        return Continuation(self.encode(text), text, template_mismatch=True)

    def _after_assistant(self, new_messages: Messages) -> str:
        """How ``new_messages`` and the next assistant opening render after an assistant turn's closing."""
        before = self.render(PROBE, add_generation_prompt=False)
        after = self.render([*PROBE, *new_messages], add_generation_prompt=True)
        if not after.startswith(before):
            raise RenderingError("the chat template renders the conversation before the environment's message "
                                 "differently once the message is added; its tokens cannot be rendered on their own")
        return after[len(before):]

    def _closing_remainder(self, turn_text: str) -> str:
        """The template's text after an assistant message's content (``<|im_end|>\\n`` in ChatML), less the part the
        model already sampled (its end-of-turn token)."""
        if self._closing is None:
            rendered = self.render(PROBE, add_generation_prompt=False)
            marker = PROBE[-1]["content"]
            if marker not in rendered:
                raise RenderingError("the chat template does not write an assistant message's content as given")
            self._closing = rendered[rendered.rindex(marker) + len(marker):]
        closing = self._closing
        for overlap in range(min(len(closing), len(turn_text)), 0, -1):
            if turn_text.endswith(closing[:overlap]):
                return closing[overlap:]
        return closing

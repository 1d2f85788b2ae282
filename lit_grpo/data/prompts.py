"""Turning a GSM8K question into prompt token ids with the model's chat template."""

from __future__ import annotations

DEFAULT_SYSTEM_PROMPT = (
    "Solve the math word problem. Reason step by step, then write the final answer as a number "
    "on the last line in the form '#### <answer>'."
)


def prompt_ids(tokenizer, question: str, system_prompt: str | None = DEFAULT_SYSTEM_PROMPT) -> list[int]:  # noqa: ANN001
    """Token ids of the chat-formatted prompt, ending with the assistant turn's opening.

    Tokenizers without a chat template get a plain ``Question: ... Answer:`` layout.
    """
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": question})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = (f"{system_prompt}\n\n" if system_prompt else "") + f"Question: {question}\nAnswer:"
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])

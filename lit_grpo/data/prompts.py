"""Turning a question (a GSM8K question, or a dataset row through its prompt template) into prompt token ids with the
model's chat template."""

from __future__ import annotations

DEFAULT_SYSTEM_PROMPT = (
    "Solve the math word problem. Reason step by step, then write the final answer as a number "
    "on the last line in the form '#### <answer>'."
)


def prompt_ids(tokenizer, question: str, system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,  # noqa: ANN001
               chat_template: bool = True, plain_layout: bool = True) -> list[int]:
    """Token ids of the chat-formatted prompt, ending with the assistant turn's opening.

    Without a chat template (the tokenizer has none, or ``chat_template=False``: a base model) the prompt is plain
    text, the system prompt and a blank line first: the question in a ``Question: ... Answer:`` layout, or with
    ``plain_layout=False`` as it is (a prompt template wrote the whole message, ``data.prompt_template``).
    """
    if chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": question})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        body = f"Question: {question}\nAnswer:" if plain_layout else question
        text = (f"{system_prompt}\n\n" if system_prompt else "") + body
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])

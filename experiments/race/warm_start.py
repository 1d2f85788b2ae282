"""A short supervised warm start on a task's answer format, shared by both sides of the race.

SmolLM2-135M-Instruct rarely writes reasoning-gym's ``<answer>...</answer>`` tags (4-12 % of its completions on
the tasks probed, ``probe_tasks.py``), so on most tasks its held-out accuracy at step 0 is about 0 and GRPO's
groups have no spread. Peers start RL after supervised fine-tuning for the same reason (prime-rl's examples). This
fine-tunes the model on ``--examples`` rows of the task's *train* split (the evaluation's test split shares no
question with it): the prompt exactly as the race renders it, the target ``<answer>{gold}</answer>`` (or, with
``--target reasoning``, letter_counting's worked answer before it: the longer race's) and the end of the turn,
cross-entropy on the target tokens only, AdamW, one pass, a fixed seed and one thread, so the weights
are a function of the arguments. It writes a model directory (``save_pretrained``) that both sides then load with
``--model <dir>``.

    python experiments/race/warm_start.py --task reasoning_gym:spell_backward:... --out runs/race/warm/spell
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from race_config import system_prompt_of, user_message  # noqa: E402

#: letter_counting's question (reasoning-gym 0.1.25), which ``reasoning_target`` reads
LETTER_QUESTION = re.compile(r'How many times does the letter "(.)" appear in the text: "(.*)"\?$')


def reasoning_target(row: dict) -> str:
    """A worked answer to a letter_counting question, reasoning first: each word spelled, the letter's count in it,
    the total, then the tagged answer (the form of the longer race's ``spell`` prompt). The count is the task's
    own rule (case-insensitive), and the total must equal the row's gold answer."""
    match = LETTER_QUESTION.match(row["question"])
    if match is None:
        raise ValueError(f"--target reasoning is written for letter_counting questions, got {row['question']!r}")
    letter, text = match.groups()
    counts = [(word, word.lower().count(letter)) for word in text.split()]
    total = sum(count for _, count in counts)
    if str(total) != str(row["answer"]):
        raise ValueError(f"counted {total} for {row['question']!r}, but its answer is {row['answer']}")
    lines = [f"{word}: {'-'.join(word)}, {count}" for word, count in counts]
    return "\n".join([*lines, f"Total: {' + '.join(str(c) for _, c in counts)} = {total}",
                      f"<answer>{total}</answer>"])


def sft_example(tokenizer, system: str, row: dict, target_kind: str = "answer") -> tuple[list[int], list[int]]:  # noqa: ANN001
    """(input ids, labels): the race's prompt, then the target (``answer``: the tagged gold answer;
    ``reasoning``: :func:`reasoning_target`) and the end of the turn; labels are -100 on the prompt."""
    from lit_grpo.data.prompts import prompt_ids

    prompt = prompt_ids(tokenizer, user_message(row), system)
    text = reasoning_target(row) if target_kind == "reasoning" else f"<answer>{row['answer']}</answer>"
    target = tokenizer(text, add_special_tokens=False)["input_ids"]
    target = [*target, tokenizer.eos_token_id]
    return prompt + target, [-100] * len(prompt) + target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", required=True)
    parser.add_argument("--prompt", default="oneshot")
    parser.add_argument("--target", default="answer", choices=("answer", "reasoning"),
                        help="answer: <answer>gold</answer>; reasoning: letter_counting's worked answer first")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    from lit_grpo.environments.reasoning_gym import load_rows
    from lit_grpo.models.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(args.model, "float32")
    system = system_prompt_of(args.prompt, args.task)
    # the train split's last rows: the race's RL draws its prompts from the whole train split in a seeded order
    rows = load_rows(args.task, "train")[-args.examples:]
    examples = [sft_example(tokenizer, system, row, args.target) for row in rows]
    order = torch.randperm(len(examples)).tolist()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model.train()
    losses = []
    for start in range(0, len(order), args.batch):
        batch = [examples[i] for i in order[start:start + args.batch]]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(i)) + i for i, _ in batch])
        labels = torch.tensor([[-100] * (width - len(lab)) + lab for _, lab in batch])
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i, _ in batch])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        print(f"step {len(losses)}: loss {losses[-1]:.3f}", flush=True)
    model.eval()
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    (args.out / "warm_start.json").write_text(json.dumps({**{k: str(v) for k, v in vars(args).items()},
                                                          "losses": losses}, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""What both sides of the race share: the task's rows in one order, the system prompt, the user message, the reward
and the hyper-parameters (:class:`RaceConfig`). Everything a side trains on comes from here, so the two sides differ
only in the trainer."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from lit_grpo.environments.reasoning_gym import ANSWER_FORMAT, load_rows, score_completion, system_prompt

#: ``rg``: reasoning-gym's own default (think step by step, then <answer> tags); ``direct``: answer at once, which
#: fits a 135M model's short budget (it rarely finishes the step-by-step form in 48 tokens)
PROMPTS: dict[str, str] = {
    "rg": system_prompt(),
    "direct": "Answer the question directly, without explanation. Write only the final answer between <answer> and "
              "</answer> tags.",
    # the longer race's (letter_counting): reasoning before the answer, in the form its warm start teaches
    "spell": "Spell each word of the text letter by letter and count the letter in it, then add the counts. Write "
             "the total between <answer> and </answer> tags.",
}


def system_prompt_of(kind: str, spec: str) -> str:
    """The system prompt ``kind`` (:data:`PROMPTS`, or ``oneshot``: ``direct`` plus one solved question of the
    task's train split, its first row, so the model sees the tags filled in once)."""
    if kind in PROMPTS:
        return PROMPTS[kind]
    if kind != "oneshot":
        raise ValueError(f"unknown prompt {kind!r}; expected one of {', '.join([*PROMPTS, 'oneshot'])}")
    example = load_rows(spec, "train")[0]
    return (f"{PROMPTS['direct']}\n\nExample:\n{example['question']}\n"
            f"<answer>{example['answer']}</answer>")


def user_message(row: dict[str, Any]) -> str:
    """The question as the task's environment states it (``ReasoningGymEnvironment.reset``)."""
    return f"{row['question']}\n\n{ANSWER_FORMAT}"


def reward(completion: str, row: dict[str, Any]) -> float:
    """The task's own ``score_answer`` of the text inside the last <answer> tags (0 without tags)."""
    return score_completion(completion, row)


#: ``RaceConfig.precision`` -> lit_grpo's Lightning precision; TRL's options are in ``side_trl.PRECISION_OPTIONS``
PRECISIONS: dict[str, str] = {"32": "32-true", "bf16": "bf16-mixed"}


@dataclass(frozen=True)
class RaceConfig:
    """One row of the race: the task, the shared hyper-parameters, and what differs between rows (``side``,
    ``sync_every`` = the paper's v, ``max_staleness`` = K with the project's rollout server)."""

    side: str = "ours"                      # ours | trl
    task: str = "reasoning_gym:letter_counting:min_words=3:max_words=5:size=1000:test_size=200"
    prompt: str = "oneshot"
    model: str = "smollm2-135m-instruct"
    seed: int = 0
    steps: int = 30
    eval_every: int = 5
    prompts_per_step: int = 4
    num_generations: int = 8
    max_new_tokens: int = 48
    temperature: float = 0.7
    lr: float = 1e-5
    beta: float = 0.0
    epsilon: float = 0.2
    max_grad_norm: float = 1.0
    micro_batch_size: int = 16
    sync_every: int = 1                     # v
    max_staleness: int = 0                  # K (ours with the project's server only)
    threads: int = 1
    #: the numerics both sides run in: ``32`` (float32: lit_grpo ``32-true``, TRL ``bf16=False, fp16=False``) or
    #: ``bf16`` (lit_grpo ``bf16-mixed``, TRL ``bf16=True``: bf16 autocast over float32 weights on both sides)
    precision: str = "32"
    #: eq. 2's std: ``bessel`` is TRL's (Bessel-corrected, eps outside the root), so both sides whiten alike
    advantage_std: str = "bessel"
    #: lit_grpo's throughput options (ours only; TRL has neither): the log-prob passes packed (the prefix tree
    #: over the group's shared prompt) and micro-batches cut by a token budget (0: by ``micro_batch_size``)
    packing: bool = False
    micro_batch_tokens: int = 0
    #: the race a row belongs to, its results' folder (empty: the task's name); the longer race is its own
    race: str = ""
    eval_questions: int = 64
    eval_samples: int = 4
    eval_seed: int = 1234

    def __post_init__(self) -> None:
        if self.side not in ("ours", "trl"):
            raise ValueError(f"side {self.side!r}; expected ours or trl")
        if self.side == "trl" and (self.sync_every != 1 or self.max_staleness != 0):
            raise ValueError("the TRL row is on-policy: sync_every 1 and max_staleness 0")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r}; expected one of {', '.join(PRECISIONS)}")
        if self.side == "trl" and self.advantage_std != "bessel":
            raise ValueError("the TRL row whitens with the Bessel-corrected std: advantage_std bessel")
        if self.side == "trl" and (self.packing or self.micro_batch_tokens):
            raise ValueError("packing and micro_batch_tokens are lit_grpo's options: the TRL row takes neither")
        if self.steps % self.eval_every:
            raise ValueError(f"steps ({self.steps}) must be a multiple of eval_every ({self.eval_every})")

    @property
    def row(self) -> str:
        """The row's name: ``trl``, ``ours``, ``ours-v4`` (v = 4), ``ours-k1`` (K = 1, server)."""
        suffix = "" if self.precision == "32" else f"-{self.precision}"
        if self.side == "trl":
            return "trl" + suffix
        return "ours" + (f"-v{self.sync_every}" if self.sync_every > 1 else "") + (
            f"-k{self.max_staleness}" if self.max_staleness else "") + suffix

    @property
    def eval_steps(self) -> list[int]:
        return list(range(0, self.steps + 1, self.eval_every))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def train_rows(config: RaceConfig) -> list[dict[str, Any]]:
    """The train rows both sides see, in the order they see them: step s takes rows
    ``[s * prompts_per_step, (s + 1) * prompts_per_step)`` of a seeded shuffle (lit_grpo's own epoch order for the
    task, which TRL then gets unshuffled)."""
    from lit_grpo.data.datamodule import RolloutDataModule

    data = RolloutDataModule(dataset=config.task, prompts_per_step=config.prompts_per_step,
                             num_generations=config.num_generations, seed=config.seed,
                             system_prompt=system_prompt_of(config.prompt, config.task))
    rows = data.rows
    order = data.epoch_order(0)[: config.steps * config.prompts_per_step]
    return [rows[i] for i in order]


def test_rows(config: RaceConfig) -> list[dict[str, Any]]:
    """The held-out questions of the evaluation: the first ``eval_questions`` of the task's test split (no
    question of the train split)."""
    return load_rows(config.task, "test")[: config.eval_questions]


def dumps(value: Any) -> str:
    return json.dumps(value, indent=1, sort_keys=True) + "\n"

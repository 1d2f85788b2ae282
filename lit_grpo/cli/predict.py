"""What the training CLI's ``predict`` runs once LightningCLI has built the model, the data module and the trainer
(:meth:`lit_grpo.cli.lightning_cli.GRPOCLI.predict` calls these; its options are the ``predictions`` section,
:class:`PredictOptions`). It samples ``data.num_generations`` completions per prompt, with the training sampling
settings, and writes them to a JSONL file with their rewards (``data.rewards``) where an answer is known.

It runs in this process on the trainer's device, not through ``Trainer.predict``: sampling needs no loop. The
weights are the model's (``model.model_name``), or the policy of ``--ckpt_path`` (a file or a sharded directory).
``validate`` and ``test`` (Pass@k) are :mod:`lit_grpo.evaluation.pass_at_k`'s.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lit_grpo.data.multi_turn import TrajectoryRunner
from lit_grpo.data.prompts import prompt_ids
from lit_grpo.data.rewards import RewardRunner
from lit_grpo.data.tasks import load_task_rows
from lit_grpo.engines.base import SamplingConfig

#: prompts sampled together by ``predict`` (one generate call; a chunk's seed is derived from its first prompt)
PREDICT_CHUNK = 8


@dataclass(frozen=True)
class PredictOptions:
    """What ``python -m lit_grpo predict`` samples and where it writes (the ``predictions`` section).

    Args:
        output: the JSONL file to write, one line per prompt: ``question``, ``answer`` (when known),
            ``completions`` (``data.num_generations`` texts, sampled with ``data.temperature``, ``data.top_p``,
            ``data.max_new_tokens`` and ``data.system_prompt``) and, when an answer is known, ``rewards``
            (``data.rewards`` weighted by ``data.reward_weights``, one per completion).
        questions: a JSONL file of ``{"question": ...}`` rows (an ``"answer"`` field is optional and is scored);
            None: the ``split`` split of ``data.dataset``.
        split: the split of ``data.dataset`` to read when ``questions`` is None: ``train`` or ``test``.
        num_questions: only the first N prompts (None: all).
    """

    output: str = "predictions.jsonl"
    questions: str | None = None
    split: str = "test"
    num_questions: int | None = None

    def __post_init__(self) -> None:
        if self.num_questions is not None and self.num_questions < 1:
            raise ValueError(f"num_questions must be >= 1 or None, got {self.num_questions}")
        if self.split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {self.split!r}")
        if not str(self.output).strip():
            raise ValueError("output must name a file, got an empty string")


def read_questions(path: str | Path) -> list[dict[str, str]]:
    """The rows of a JSONL file of ``{"question": str, "answer": str (optional)}`` objects, blank lines skipped;
    a ``ValueError`` names the file and line of the first bad one."""
    path = Path(path).expanduser()
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise ValueError(f"cannot read questions file {path}: {err.strerror or err}") from err
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number} is not JSON ({err.msg}); expected one {{\"question\": ...}} object "
                             "per line") from err
        if not isinstance(row, dict) or not isinstance(row.get("question"), str):
            raise ValueError(f"{path}:{number}: expected an object with a string \"question\", got {line[:80]!r}")
        if "answer" in row and not isinstance(row["answer"], str):
            raise ValueError(f"{path}:{number}: \"answer\" must be a string, got {row['answer']!r}")
        rows.append({"question": row["question"], **({"answer": row["answer"]} if "answer" in row else {})})
    if not rows:
        raise ValueError(f"questions file {path} holds no rows")
    return rows


def prediction_rows(options: PredictOptions, dataset: str, environment: bool = False) -> list[dict[str, Any]]:
    """The prompts ``predict`` samples: the questions file, else the split of ``dataset`` (an environment's task rows
    as they are, with ``environment``); the first ``num_questions`` of them."""
    rows = read_questions(options.questions) if options.questions else \
        load_task_rows(dataset, split=options.split, environment=environment)
    return rows if options.num_questions is None else rows[: options.num_questions]


def predictions(policy: nn.Module, tokenizer: Any, rows: Sequence[dict], num_generations: int,
                sampling: SamplingConfig, system_prompt: str | None, rewards: RewardRunner, seed: int,
                device: torch.device, trajectories: TrajectoryRunner | None = None) -> Iterator[dict[str, Any]]:
    """One record per row: its ``num_generations`` completions, and their rewards when the row has an answer.
    Prompts are sampled ``PREDICT_CHUNK`` at a time, each chunk with a seed derived from ``seed`` and its first
    row, so the same rows, weights and seed give the same file. Environment tasks (``trajectories``): one record per
    task with each trajectory's messages, reward (the environment's plus ``rewards``' score of its last turn, as in
    training), turns and how it ended."""
    if trajectories is not None:
        yield from trajectory_predictions(policy, tokenizer, rows, num_generations, sampling, rewards, seed, device,
                                          trajectories)
        return
    from lit_grpo.engines.transformers_engine import TransformersEngine
    from lit_grpo.models.loading import eos_token_ids

    engine = TransformersEngine(policy, eos_token_ids(tokenizer, policy), tokenizer.pad_token_id, copy_weights=False)
    for start in range(0, len(rows), PREDICT_CHUNK):
        chunk = rows[start: start + PREDICT_CHUNK]
        prompts = [prompt_ids(tokenizer, row["question"], system_prompt) for row in chunk]
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            groups = engine.generate(prompts, num_generations, sampling, seed=seed * 1_000_003 + start)
        for row, group in zip(chunk, groups):
            texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in group]
            record: dict[str, Any] = {"question": row["question"]}
            if "answer" in row:
                record["answer"] = row["answer"]
            record["completions"] = texts
            record["truncated"] = [bool(c.truncated) for c in group]
            if "answer" in row:
                record["rewards"] = [float(r) for r in rewards(texts, [row["answer"]] * len(texts)).rewards]
            yield record


def trajectory_predictions(policy: nn.Module, tokenizer: Any, rows: Sequence[dict], num_generations: int,
                           sampling: SamplingConfig, rewards: RewardRunner, seed: int, device: torch.device,
                           trajectories: TrajectoryRunner) -> Iterator[dict[str, Any]]:
    """``predictions`` of environment tasks: each row's ``num_generations`` trajectories, sampled as in training."""
    from lit_grpo.engines.base import Rollouts
    from lit_grpo.engines.transformers_engine import TransformersEngine
    from lit_grpo.models.loading import eos_token_ids

    engine = TransformersEngine(policy, eos_token_ids(tokenizer, policy), tokenizer.pad_token_id, copy_weights=False)

    def sample(prompts: list[list[int]], n: int, turn_sampling: SamplingConfig, turn_seed: int) -> Rollouts:
        return Rollouts(engine.generate(prompts, n, turn_sampling, seed=turn_seed))

    for start in range(0, len(rows), PREDICT_CHUNK):
        chunk = list(rows[start: start + PREDICT_CHUNK])
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            groups = trajectories.run(chunk, num_generations, sample, sampling, seed * 1_000_003 + start).groups
        for row, group in zip(chunk, groups):
            records = [c.trajectory for c in group]
            scored = rewards([r["final_text"] for r in records], [str(row.get("answer", ""))] * len(records))
            yield {"task": row, "trajectories": [
                {"messages": r["messages"], "reward": r["env_reward"] + extra, "env_reward": r["env_reward"],
                 "turns": r["turns"], "stop": r["stop"], "truncated": bool(c.truncated), "env_error": r["env_error"]}
                for c, r, extra in zip(group, records, scored.rewards)]}


def write_jsonl(records: Iterable[dict[str, Any]], path: str | Path) -> int:
    """Write ``records`` one JSON object a line (the parent folder is made); returns how many were written."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with path.open("w") as out:
        for record in records:
            out.write(json.dumps(record) + "\n")
            out.flush()  # a long run leaves what it has written so far
            count += 1
    return count


"""Pass@k of a policy on a split of questions: the one implementation behind the training-time callback, the
``eval`` command and the training CLI's ``validate`` and ``test``, with what they share to choose the questions,
log the values and print them.

Questions are cut into fixed chunks of ``questions_per_chunk`` consecutive questions, each sampled with a seed
derived from its first question, and the chunks are dealt round-robin to the ranks. A chunk's samples therefore
do not depend on how many processes evaluate, and 1 or N ranks report the same numbers.

Under FSDP every forward of the sharded policy is a collective, so ranks generate in lockstep: every rank runs the
same number of chunks (a rank with none left repeats its last one and discards it) and every chunk the same
number of decoding steps (decoding stops when all ranks are done).

Environment tasks (multi-turn: ``data.environment`` / ``data.tools``) are sampled as whole trajectories by the data
module's ``TrajectoryRunner`` (the same environment, tools and chat template as training; ranks take their turns in
lockstep). A trajectory passes when its score exceeds 0.5: with an environment, its environment's reward; with tools
only, the judge's score of its last model turn.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lit_grpo.core.distributed import everyone, is_distributed, rank_and_world
from lit_grpo.data.columns import RowFormat, check_answers, check_row_format, load_rows
from lit_grpo.data.multi_turn import QuestionEnvironment, TrajectoryRunner
from lit_grpo.data.rewards import RewardRunner
from lit_grpo.data.thinking import judged_text, prompt_ids_open_thought
from lit_grpo.engines.base import Completion, Rollouts, SamplingConfig
from lit_grpo.engines.transformers_engine import TransformersEngine
from lit_grpo.evaluation.metric import PassAtK
from lit_grpo.models.loading import eos_token_ids, pad_token_id


@dataclass(frozen=True)
class PassAtKSettings:
    """How a Pass@k evaluation samples: ``num_samples`` answers per question with ``sampling``, each question's
    prompt made by ``row_format`` (its template was applied when the rows were read; here: the chat template on or
    off)."""

    num_samples: int = 50
    ks: tuple[int, ...] = (1,)
    sampling: SamplingConfig = SamplingConfig(max_new_tokens=200, temperature=1.0, top_p=1.0)
    questions_per_chunk: int = 4
    system_prompt: str | None = None
    seed: int = 1234
    row_format: RowFormat = RowFormat()

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        if not self.ks or max(self.ks) > self.num_samples or min(self.ks) < 1:
            raise ValueError(f"every k in ks={list(self.ks)} must lie in [1, num_samples={self.num_samples}]")
        if self.questions_per_chunk < 1:
            raise ValueError(f"questions_per_chunk must be >= 1, got {self.questions_per_chunk}")


def question_chunks(num_questions: int, per_chunk: int) -> list[list[int]]:
    """Consecutive question indices, ``per_chunk`` at a time (the last chunk may be shorter)."""
    return [list(range(s, min(s + per_chunk, num_questions))) for s in range(0, num_questions, per_chunk)]


def chunks_of_rank(chunks: list[list[int]], rank: int, world: int) -> list[list[int]]:
    """Round-robin share of the chunks; every rank gets ``ceil(len(chunks) / world)`` entries, padded with ``[]``
    (a lockstep slot whose results are discarded)."""
    rounds = -(-len(chunks) // world)
    return [chunks[i] if i < len(chunks) else [] for i in range(rank, rounds * world, world)]


@torch.no_grad()
def evaluate_pass_at_k(
    policy: nn.Module,
    tokenizer,  # noqa: ANN001 (a Hugging Face tokenizer)
    rows: Sequence[dict],
    settings: PassAtKSettings,
    judge: RewardRunner | None = None,
    device: torch.device | str | None = None,
    trajectories: TrajectoryRunner | None = None,
) -> dict[int, float]:
    """Pass@k for every k in ``settings.ks`` over ``rows`` (dicts with ``question`` and ``answer``; an environment's
    task rows with ``trajectories``), sampled from ``policy`` itself. With a process group, all ranks must call this
    together; each returns the global value. The policy's train/eval mode is left as it was."""
    judge = judge or RewardRunner([("correctness", 1.0)])
    rank, world = rank_and_world()
    lockstep = everyone if is_distributed() else None
    # a tokenizer without a pad token (GPT-2, Llama 3) pads with its eos token; the tokenizer itself is not changed
    engine = TransformersEngine(policy, eos_token_ids(tokenizer, policy), pad_token_id(tokenizer), copy_weights=False)
    device = device if device is not None else engine.device
    metric = PassAtK(settings.ks).to(device)
    mine = chunks_of_rank(question_chunks(len(rows), settings.questions_per_chunk), rank, world)
    last_real: list[int] = next((c for c in reversed(mine) if c), [0])
    opened = False  # whether the prompts open a thought for the completion (R1-Distill's chat template does)
    for chunk in mine:
        work = chunk or last_real  # an empty slot still runs the same forwards as the other ranks
        seed = settings.seed * 1_000_003 + work[0]
        if trajectories is not None:
            def sample(prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int) -> Rollouts:
                return Rollouts(engine.generate(prompts, n, sampling, seed=seed, all_finished=lockstep))

            groups = trajectories.run([rows[i] for i in work], settings.num_samples, sample, settings.sampling, seed,
                                      keep_going=lockstep).groups
        else:
            prompts = [settings.row_format.prompt_ids(tokenizer, rows[i]["question"], settings.system_prompt)
                       for i in work]
            opened = prompt_ids_open_thought(tokenizer, prompts[0])
            groups = engine.generate(prompts, settings.num_samples, settings.sampling, seed=seed,
                                     all_finished=lockstep)
        if not chunk:
            continue
        answers = [str(rows[i].get("answer", "")) for i in chunk for _ in range(settings.num_samples)]
        scores = sample_scores(groups, answers, judge, tokenizer, trajectories, opened_thought=opened)
        correct = torch.tensor(scores).view(len(chunk), settings.num_samples) > 0.5
        metric.update(correct.sum(dim=1), settings.num_samples)
    return {k: float(v) for k, v in metric.compute().items()}


def sample_scores(groups: list[list[Completion]], answers: list[str], judge: RewardRunner, tokenizer: Any,
                  trajectories: TrajectoryRunner | None = None, opened_thought: bool = False) -> list[float]:
    """Each sample's score (flat, prompt-major): the judge's score of a completion (after the ``<think>`` its prompt
    opened, ``opened_thought``: ``lit_grpo.data.thinking``), or of a trajectory's last model turn when it has tools
    only; an environment's reward when the task has an environment."""
    flat = [c for g in groups for c in g]
    if trajectories is not None and trajectories.make_environment is not QuestionEnvironment:
        return [float(c.trajectory["env_reward"]) for c in flat]
    texts = [c.trajectory["final_text"] if c.trajectory is not None
             else judged_text(tokenizer.decode(c.token_ids, skip_special_tokens=True), opened_thought) for c in flat]
    return list(judge(texts, answers).rewards)


def evaluation_rows(dataset: str, split: str, num_questions: int | None, environment: bool = False,
                    fmt: RowFormat | None = None, judge: RewardRunner | None = None,
                    section: str = "eval.") -> list[dict[str, Any]]:
    """The questions of ``split`` of ``dataset`` that an evaluation reads: the first ``num_questions`` (all when
    None), read as the data module reads its own (:func:`lit_grpo.data.columns.load_rows`: by ``fmt``'s columns and
    template, else GSM8K's format); an environment's task rows as they are (``lit_grpo.data.tasks``). A judge that
    checks golds (``math_verify``) reads each question's gold first: one it cannot judge is one line, before any
    sampling. ``section``: how those lines name the options (``eval.``, ``--``)."""
    fmt = fmt or RowFormat()
    check_row_format(fmt, dataset, environment, tools=False, section=section)
    rows = load_rows(dataset, split, fmt, judge.functions if judge is not None else [], environment, section)
    rows = rows if num_questions is None else rows[:num_questions]
    if judge is not None and not environment:
        check_answers(rows, {id(row): i for i, row in enumerate(rows)}, f"{dataset} {split}", judge)
    return rows


def evaluate_pass_at_k_float32(policy: nn.Module, tokenizer: Any, rows: Sequence[dict], settings: PassAtKSettings,
                               judge: RewardRunner, device: torch.device,
                               trajectories: TrajectoryRunner | None = None) -> dict[int, float]:
    """:func:`evaluate_pass_at_k` in float32 outside any autocast, as the ``eval`` command and the callback compute
    it (neither runs inside one)."""
    with torch.autocast(torch.device(device).type, enabled=False):
        return evaluate_pass_at_k(policy, tokenizer, rows, settings, judge=judge, device=device,
                                  trajectories=trajectories)


def log_pass_at_k(loggers: Iterable[Any], results: dict[int, float], step: int) -> dict[str, float]:
    """Log ``eval/pass@k`` for each k to every Lightning logger at ``step`` (the checkpoint's optimizer step, the
    axis a training run logs its own Pass@k on), and flush them."""
    metrics = {f"eval/pass@{k}": float(v) for k, v in results.items()}
    for logger in loggers:
        logger.log_metrics(metrics, step=step)
        logger.save()
        logger.finalize("success")
    return metrics


def pass_at_k_table(results: dict[int, float], questions: int, samples: int, seconds: float,
                    title: str | None = None) -> str:
    """The table the ``eval`` command, ``validate`` and ``test`` print, under a title line naming what was evaluated
    where there is one."""
    lines = [title] if title else []
    lines += [f"{'k':>4}  pass@k   ({questions} questions x {samples} samples, {seconds:.1f} s)"]
    lines += [f"{k:>4}  {value:.4f}" for k, value in results.items()]
    return "\n".join(lines)

"""Periodic Pass@k of the current policy during training: :class:`PassAtKEvaluation` on any dataset (read by its
columns and template as the data module reads its own, judged by any reward: MATH-500 and AIME24 with
``math_verify``), and :class:`GSM8KPassAtK`, its GSM8K case (the paper's Pass@1 from 50 samples)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lit_grpo.callbacks.interval import Interval
from lit_grpo.callbacks.protocol import check_pass_at_k, policy_of
from tqdm import tqdm

from lit_grpo.data.columns import RowFormat, numeric_gold
from lit_grpo.data.gsm8k import validate_rows
from lit_grpo.data.multi_turn import EnvironmentStartError
from lit_grpo.data.prompts import DEFAULT_SYSTEM_PROMPT
from lit_grpo.data.rewards import RewardRunner
from lit_grpo.data.tasks import load_task_rows
from lit_grpo.engines.base import SamplingConfig
from lit_grpo.evaluation.pass_at_k import PassAtKSettings, evaluate_pass_at_k, evaluation_rows

#: the sampling of an evaluation that names none and runs beside no data module that samples (a module of the
#: user's own with a data module of theirs): the callback's defaults before they followed the training's
UNLINKED_SAMPLING = SamplingConfig(max_new_tokens=200, temperature=1.0, top_p=1.0)


class PassAtKEvaluation(Callback):
    """Sample ``num_samples`` answers per question of ``dataset`` from the *current policy* (not the lagging rollout
    engine) and log ``eval/<name>/pass@k`` for each k: every ``every_n_optimizer_steps`` optimizer steps (or
    ``every_n_batches`` rollout batches, which then replaces the optimizer-step default; see
    ``lit_grpo.callbacks.interval``), at the start if ``at_start``, and at the end of training if ``at_end``. Each
    evaluation prints one line per run of it, and keeps its own state in checkpoints; several run side by side, one
    per ``name`` (the paper's section 5.2: AIME24, Pass@1 from 32 samples, and MATH-500).

    Questions are the first ``num_questions`` of the split (all when None), dealt to the ranks in chunks of
    ``questions_per_chunk``; the metric is a torchmetrics ``PassAtK`` so the mean reduces across processes.
    Sampling is seeded per chunk, so the same weights give the same score on any number of ranks. Under FSDP
    the ranks generate in lockstep (see ``lit_grpo.evaluation.pass_at_k``).

    The sampling (``max_new_tokens``, ``temperature``, ``top_p``) left at ``None`` is the training's, read from the
    data module when the fit starts (``data.max_new_tokens`` and the like); set, it is the evaluation's own: a
    reasoning model is evaluated at a budget longer than its training context.

    The module must expose ``policy`` (a Hugging Face causal LM) and ``tokenizer`` (a Hugging Face tokenizer; one
    without a pad token pads with its eos token, and is not changed), checked when the fit starts.

    With a multi-turn data module (``data.environment`` / ``data.tools``), each sample is a whole trajectory with the
    data module's environment, tools and chat template (its ``system_prompt`` then, not this one's), and ``dataset``'s
    rows are that environment's tasks (``lit_grpo.evaluation.pass_at_k``).

    Args:
        name: the evaluation's name: it logs ``eval/<name>/pass@k`` and prints its lines with it.
        dataset: a local file (JSONL, JSON, parquet), a ``datasets.save_to_disk`` folder, a Hub dataset id,
            ``bundled`` (GSM8K), ``synthetic:<task>`` or ``reasoning_gym:<task>``.
        split: the dataset's split (a Hub dataset's or a folder's; a single file holds one).
        every_n_optimizer_steps: evaluate every this many optimizer steps (``None``: not periodically).
        every_n_batches: evaluate every this many rollout batches instead (replaces ``every_n_optimizer_steps``).
        num_samples: answers sampled per question.
        ks: the k of each Pass@k logged (each at most ``num_samples``).
        num_questions: the first this many questions of the split (``None``: all of them).
        max_new_tokens: the evaluation's token budget per answer (``None``: the training's, ``data.max_new_tokens``).
        temperature: the evaluation's sampling temperature (``None``: the training's, ``data.temperature``).
        top_p: the evaluation's nucleus sampling (``None``: the training's, ``data.top_p``).
        problem_column: the column holding the problem (``None``: GSM8K's ``question``).
        answer_column: the column holding the gold answer (``None``: GSM8K's ``answer``, after its ``####``).
        prompt_template: the user message, the row's columns in braces (``"{problem} Put the answer in
            \\boxed{}."``); ``None``: the problem as it is.
        chat_template: format prompts with the tokenizer's chat template (``False``: plain text, a base model).
        dataset_config: a Hub dataset's config (``None``: its default).
        questions_per_chunk: consecutive questions sampled together (and seeded together).
        system_prompt: the system message (``None``: none); multi-turn tasks take the data module's.
        at_start: evaluate once before the first step.
        at_end: evaluate once at the end of training.
        seed: the evaluation's sampling seed (each chunk's seed is derived from it and its first question).
        judge: the reward that decides a sample is correct (a score above 0.5): a name (``correctness``,
            ``math_verify``) or ``module:function``.
    """

    def __init__(
        self,
        name: str | None,
        dataset: str,
        split: str = "test",
        every_n_optimizer_steps: int | None = 50,
        every_n_batches: int | None = None,
        num_samples: int = 50,
        ks: Sequence[int] = (1,),
        num_questions: int | None = None,
        max_new_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
        problem_column: str | None = None, answer_column: str | None = None, prompt_template: str | None = None,
        chat_template: bool = True, dataset_config: str | None = None,
        questions_per_chunk: int = 4,
        system_prompt: str | None = None,
        at_start: bool = False,
        at_end: bool = True,
        seed: int = 1234,
        judge: str = "math_verify",
    ) -> None:
        owner = type(self).__name__
        if name is not None and (not isinstance(name, str) or not name or "/" in name or name != name.strip()):
            raise ValueError(f"{owner} name must be a non-empty word without '/' or spaces at its ends, got {name!r}")
        #: where the metrics go: ``eval/pass@k``, or ``eval/<name>/pass@k`` for one of several evaluations
        self.name = name
        self.prefix = "eval" if name is None else f"eval/{name}"
        if num_questions is not None and num_questions < 1:
            raise ValueError(f"num_questions must be >= 1 or None, got {num_questions}")
        if every_n_batches is not None:
            every_n_optimizer_steps = None  # the batch count was asked for explicitly
        self.interval = Interval(owner, every_n_batches, every_n_optimizer_steps)
        self.batches_seen = 0
        #: the sampling asked for; a ``None`` is the training's, filled in by :meth:`follow_training`
        self.asked = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p}
        # validates num_samples, ks, questions_per_chunk and the sampling before the dataset is read
        self.settings = PassAtKSettings(
            num_samples=num_samples, ks=tuple(int(k) for k in ks), sampling=self._sampling(UNLINKED_SAMPLING),
            questions_per_chunk=questions_per_chunk, system_prompt=system_prompt, seed=seed,
            row_format=RowFormat(problem_column, answer_column, prompt_template, chat_template, dataset_config),
        )
        # a sample counts as correct when the judge scores it above 0.5 (a reward name or `module:function`)
        self.judge = RewardRunner([(judge, 1.0)])
        fmt = self.settings.row_format
        if fmt.by_columns or fmt.prompt_template is not None:  # read, templated and golds checked now, in one line
            # the lines name the options as the config holds them: the `eval` section's, or this callback's own
            section = "eval." if type(self) is GSM8KPassAtK else f"{owner}(name={name!r})."
            rows = evaluation_rows(dataset, split, num_questions, fmt=fmt, judge=self.judge, section=section)
        else:  # an environment's task rows may hold any fields; GSM8K's are checked when the fit starts single-turn
            rows = load_task_rows(dataset, split=split, environment=True, config=dataset_config)
            rows = rows if num_questions is None else rows[:num_questions]
        self.rows = rows
        self.source = f"{dataset} {split}"
        self.trajectories = None  # the data module's TrajectoryRunner, for environment tasks (set on fit start)
        self.at_start = at_start
        self.at_end = at_end
        self.history: list[dict[str, float]] = []
        self.boundaries_done = 0

    def _sampling(self, training: SamplingConfig) -> SamplingConfig:
        return SamplingConfig(**{key: getattr(training, key) if value is None else value
                                 for key, value in self.asked.items()})

    def follow_training(self, training: SamplingConfig | None) -> None:
        """Fill the sampling left at ``None`` with the training's (``training``: the data module's ``sampling``;
        ``None``: no data module that samples, the defaults of :data:`UNLINKED_SAMPLING` stay)."""
        if training is not None:
            self.settings = replace(self.settings, sampling=self._sampling(training))

    @torch.no_grad()
    def evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[int, float]:
        results = evaluate_pass_at_k(policy_of(pl_module, type(self).__name__), pl_module.tokenizer, self.rows,
                                     self.settings, judge=self.judge, device=pl_module.device,
                                     trajectories=self.trajectories)
        record = {"step": float(trainer.global_step), **{f"pass@{k}": v for k, v in results.items()}}
        self.history.append(record)
        metrics = {f"{self.prefix}/pass@{k}": v for k, v in results.items()}
        # x = rollout batches done (0 before training): the axis of the training metrics, one point per batch;
        # Lightning's own counter lags by one inside on_train_batch_end, which would put it before its batch
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=self.batches_seen)
        trainer.callback_metrics.update({key: torch.tensor(value) for key, value in metrics.items()})
        if trainer.is_global_zero:
            # in the terminal too (the bar shows the training reward only); tqdm.write puts the line above the bar
            line = pass_at_k_line(trainer.global_step, results, len(self.rows), self.settings.num_samples,
                                  self.source)
            tqdm.write(line if self.name is None else f"{self.name}: {line}")
        return results

    def _evaluated_at(self, step: int) -> bool:
        return bool(self.history) and int(self.history[-1]["step"]) == step

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Hold the module to the protocol before the first batch: a causal-LM ``policy`` and a ``tokenizer``
        (``lit_grpo.callbacks.protocol.check_pass_at_k``)."""
        check_pass_at_k(pl_module, type(self).__name__)
        same = [c for c in trainer.callbacks
                if isinstance(c, PassAtKEvaluation) and c is not self and c.prefix == self.prefix]
        if same:  # two series in one would put two values at one step
            raise ValueError(f"{len(same) + 1} Pass@k evaluations would log under {self.prefix}/pass@k: give "
                             "each its own name (e.g. name: gsm8k, name: math500)")
        datamodule = getattr(trainer, "datamodule", None)
        sampling = getattr(datamodule, "sampling", None)
        self.follow_training(sampling if isinstance(sampling, SamplingConfig) else None)
        runner = getattr(datamodule, "trajectory_runner", None)
        self.trajectories = runner(pl_module.tokenizer) if callable(runner) else None
        fmt = self.settings.row_format
        if self.trajectories is None:
            if not (fmt.by_columns or fmt.prompt_template is not None):  # else read and checked when made
                # single-turn: GSM8K's format, in one line if not (a gold of the judge's own form if it checks golds)
                self.rows = validate_rows(self.rows, self.source, numeric_gold(self.judge.functions))
        elif self.rows and (self.interval.active or self.at_start or self.at_end):
            self._check_tasks_start(getattr(datamodule, "rows", None))

    def _check_tasks_start(self, training_rows: Sequence[dict] | None) -> None:
        """An environment that cannot start ``dataset``'s first task fails now, not after training. It is blamed on
        ``dataset`` only when the environment starts the training data's first task (``training_rows``): one that
        starts no task at all (a ``reset()`` that always raises) is the environment's fault, said in its own line."""
        try:
            self.trajectories.prompt(self.rows[0])
        except EnvironmentStartError as e:
            if training_rows:
                self.trajectories.prompt(training_rows[0])  # raises the environment's own line when it fails too
            raise EnvironmentStartError(f"{type(self).__name__}: dataset {self.source!r} holds no task the environment "
                                        f"{self.trajectories.environment_name} can start ({e}); point it at the "
                                        f"environment's task rows", key="eval.dataset") from e

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.at_start and not self._evaluated_at(trainer.global_step):
            self.evaluate(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.batches_seen += 1
        boundary = self.interval.boundaries(trainer, self.batches_seen)
        if boundary > self.boundaries_done:
            self.boundaries_done = boundary
            self.evaluate(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.at_end and not self._evaluated_at(trainer.global_step):
            self.evaluate(trainer, pl_module)

    @property
    def state_key(self) -> str:
        # unique per period, and per name when named, so several instances can be checkpointed side by side; an
        # unnamed one keeps the key of the checkpoints written before names existed
        named = {} if self.name is None else {"name": self.name}
        return self._generate_state_key(every_n_batches=self.interval.every_n_batches,
                                        every_n_optimizer_steps=self.interval.every_n_optimizer_steps, **named)

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "boundaries_done": self.boundaries_done,
                "batches_seen": self.batches_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict["history"])
        self.boundaries_done = int(state_dict["boundaries_done"])
        self.batches_seen = int(state_dict.get("batches_seen", 0))


class GSM8KPassAtK(PassAtKEvaluation):
    """:class:`PassAtKEvaluation` on GSM8K: the paper's test Pass@1 from 50 samples, judged by ``correctness`` (the
    last number against the gold after ``####``), logged as ``eval/pass@k``, or ``eval/<name>/pass@k`` when named.
    The same arguments, defaulting to the bundled GSM8K test split, the project's system prompt and no name.

    Args:
        every_n_optimizer_steps: evaluate every this many optimizer steps (``None``: not periodically).
        every_n_batches: evaluate every this many rollout batches instead (replaces ``every_n_optimizer_steps``).
        num_samples: answers sampled per question (the paper: 50).
        ks: the k of each Pass@k logged (each at most ``num_samples``).
        num_questions: the first this many questions of the split (``None``: all of them).
        dataset: ``bundled`` (GSM8K), a local file, a ``datasets`` folder, a Hub id, ``synthetic:<task>`` or
            ``reasoning_gym:<task>``.
        split: the dataset's split.
        max_new_tokens: the evaluation's token budget per answer (``None``: the training's, ``data.max_new_tokens``).
        temperature: the evaluation's sampling temperature (``None``: the training's, ``data.temperature``).
        top_p: the evaluation's nucleus sampling (``None``: the training's, ``data.top_p``).
        questions_per_chunk: consecutive questions sampled together (and seeded together).
        system_prompt: the system message (``None``: none); multi-turn tasks take the data module's.
        at_start: evaluate once before the first step.
        at_end: evaluate once at the end of training.
        seed: the evaluation's sampling seed (each chunk's seed is derived from it and its first question).
        judge: the reward that decides a sample is correct (a score above 0.5): a name or ``module:function``.
        name: the evaluation's name when several run in one fit: it logs ``eval/<name>/pass@k``.
        problem_column: the column holding the problem (``None``: GSM8K's ``question``).
        answer_column: the column holding the gold answer (``None``: GSM8K's ``answer``, after its ``####``).
        prompt_template: the user message, the row's columns in braces; ``None``: the question as it is.
        chat_template: format prompts with the tokenizer's chat template (``False``: plain text, a base model).
        dataset_config: a Hub dataset's config (``None``: its default; GSM8K's ``main`` for its own ids).
    """

    def __init__(
        self,
        every_n_optimizer_steps: int | None = 50,
        every_n_batches: int | None = None,
        num_samples: int = 50,
        ks: Sequence[int] = (1,),
        num_questions: int | None = None,
        dataset: str = "bundled", split: str = "test",
        max_new_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
        questions_per_chunk: int = 4,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        at_start: bool = False,
        at_end: bool = True,
        seed: int = 1234,
        judge: str = "correctness",
        name: str | None = None,
        problem_column: str | None = None, answer_column: str | None = None, prompt_template: str | None = None,
        chat_template: bool = True, dataset_config: str | None = None,
    ) -> None:
        super().__init__(
            name, dataset, split, every_n_optimizer_steps, every_n_batches, num_samples, ks, num_questions,
            max_new_tokens, temperature, top_p, problem_column, answer_column, prompt_template, chat_template,
            dataset_config, questions_per_chunk, system_prompt, at_start, at_end, seed, judge)


def pass_at_k_line(step: int, results: dict[int, float], num_questions: int, num_samples: int, source: str) -> str:
    """One evaluation in one line: ``step 50: pass@1 0.750, pass@8 0.990 on 100 synthetic:add_2digit test questions
    (x8 samples)`` (``source``: the dataset and split)."""
    scores = ", ".join(f"pass@{k} {value:.3f}" for k, value in sorted(results.items()))
    return f"step {step}: {scores} on {num_questions} {source} questions (x{num_samples} samples)"

"""`GSM8KPassAtK`: periodic GSM8K test Pass@1 / pass@k of the current policy during training."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lit_grpo.callbacks.interval import Interval
from lit_grpo.callbacks.protocol import check_pass_at_k, policy_of
from tqdm import tqdm

from lit_grpo.data.gsm8k import validate_rows
from lit_grpo.data.multi_turn import EnvironmentStartError
from lit_grpo.data.prompts import DEFAULT_SYSTEM_PROMPT
from lit_grpo.data.rewards import RewardRunner
from lit_grpo.data.tasks import load_task_rows
from lit_grpo.engines.base import SamplingConfig
from lit_grpo.evaluation.pass_at_k import PassAtKSettings, evaluate_pass_at_k


class GSM8KPassAtK(Callback):
    """Sample ``num_samples`` answers per test question from the *current policy* (not the lagging rollout
    engine) and log ``eval/pass@k`` for each k: every ``every_n_optimizer_steps`` optimizer steps (or
    ``every_n_batches`` rollout batches, which then replaces the optimizer-step default; see
    ``lit_grpo.callbacks.interval``), at the start if ``at_start``, and at the end of training if ``at_end``.
    The paper's evaluation is Pass@1 from 50 samples
    with the training sampling settings.

    Questions are the first ``num_questions`` of the split (all when None), dealt to the ranks in chunks of
    ``questions_per_chunk``; the metric is a torchmetrics ``PassAtK`` so the mean reduces across processes.
    Sampling is seeded per chunk, so the same weights give the same score on any number of ranks. Under FSDP
    the ranks generate in lockstep (see ``lit_grpo.evaluation.pass_at_k``).

    The module must expose ``policy`` (a Hugging Face causal LM) and ``tokenizer`` (a Hugging Face tokenizer; one
    without a pad token pads with its eos token, and is not changed), checked when the fit starts.

    With a multi-turn data module (``data.environment`` / ``data.tools``), each sample is a whole trajectory with the
    data module's environment, tools and chat template (its ``system_prompt`` then, not this one's), and ``dataset``'s
    rows are that environment's tasks (``lit_grpo.evaluation.pass_at_k``).

    Several evaluations in one fit (other datasets, periods or budgets): give each a ``name``; each then logs
    ``eval/<name>/pass@k``, prints its lines with its name and keeps its own state in checkpoints.
    """

    def __init__(
        self,
        every_n_optimizer_steps: int | None = 50,
        every_n_batches: int | None = None,
        num_samples: int = 50,
        ks: Sequence[int] = (1,),
        num_questions: int | None = None,
        dataset: str = "bundled", split: str = "test",
        max_new_tokens: int = 200, temperature: float = 1.0, top_p: float = 1.0,  # the sampling of each question
        questions_per_chunk: int = 4,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        at_start: bool = False,
        at_end: bool = True,
        seed: int = 1234,
        judge: str = "correctness",
        name: str | None = None,
    ) -> None:
        if name is not None and (not isinstance(name, str) or not name or "/" in name or name != name.strip()):
            raise ValueError(f"GSM8KPassAtK name must be a non-empty word without '/' or spaces at its ends, "
                             f"got {name!r}")
        #: where the metrics go: ``eval/pass@k``, or ``eval/<name>/pass@k`` for one of several evaluations
        self.name = name
        self.prefix = "eval" if name is None else f"eval/{name}"
        if num_questions is not None and num_questions < 1:
            raise ValueError(f"num_questions must be >= 1 or None, got {num_questions}")
        if every_n_batches is not None:
            every_n_optimizer_steps = None  # the batch count was asked for explicitly
        self.interval = Interval("GSM8KPassAtK", every_n_batches, every_n_optimizer_steps)
        self.batches_seen = 0
        # validates num_samples, ks and questions_per_chunk before the dataset is read
        self.settings = PassAtKSettings(
            num_samples=num_samples, ks=tuple(int(k) for k in ks),
            sampling=SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p),
            questions_per_chunk=questions_per_chunk, system_prompt=system_prompt, seed=seed,
        )
        # an environment's task rows may hold any fields; GSM8K's are checked when the fit starts single-turn
        rows = load_task_rows(dataset, split=split, environment=True)
        self.rows = rows if num_questions is None else rows[:num_questions]
        self.source = f"{dataset} {split}"
        self.trajectories = None  # the data module's TrajectoryRunner, for environment tasks (set on fit start)
        self.at_start = at_start
        self.at_end = at_end
        # a sample counts as correct when the judge scores it above 0.5 (a reward name or `module:function`)
        self.judge = RewardRunner([(judge, 1.0)])
        self.history: list[dict[str, float]] = []
        self.boundaries_done = 0

    @torch.no_grad()
    def evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[int, float]:
        results = evaluate_pass_at_k(policy_of(pl_module, "GSM8KPassAtK"), pl_module.tokenizer, self.rows,
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
        check_pass_at_k(pl_module)
        same = [c for c in trainer.callbacks
                if isinstance(c, GSM8KPassAtK) and c is not self and c.prefix == self.prefix]
        if same:  # two series in one would put two values at one step
            raise ValueError(f"{len(same) + 1} GSM8KPassAtK callbacks would log under {self.prefix}/pass@k: give "
                             "each its own name (e.g. name: gsm8k, name: math500)")
        datamodule = getattr(trainer, "datamodule", None)
        runner = getattr(datamodule, "trajectory_runner", None)
        self.trajectories = runner(pl_module.tokenizer) if callable(runner) else None
        if self.trajectories is None:
            self.rows = validate_rows(self.rows, self.source)  # single-turn: GSM8K's format, in one line if not
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
            raise EnvironmentStartError(f"GSM8KPassAtK: dataset {self.source!r} holds no task the environment "
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


def pass_at_k_line(step: int, results: dict[int, float], num_questions: int, num_samples: int, source: str) -> str:
    """One evaluation in one line: ``step 50: pass@1 0.750, pass@8 0.990 on 100 synthetic:add_2digit test questions
    (x8 samples)`` (``source``: the dataset and split)."""
    scores = ", ".join(f"pass@{k} {value:.3f}" for k, value in sorted(results.items()))
    return f"step {step}: {scores} on {num_questions} {source} questions (x{num_samples} samples)"

"""The lit_grpo side of the race: ``GRPOModule`` + ``RolloutDataModule`` in a Lightning ``Trainer.fit``, with
``WeightSync(every_n_batches=v)``, on the task's rows in the order :func:`race_config.train_rows` gives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from race_config import PRECISIONS, RaceConfig, system_prompt_of
from race_weights import TrainingClock


def train(config: RaceConfig, weights_dir: Path, server: tuple[str, str] | None = None) -> dict[str, Any]:
    """Train ``config.steps`` optimizer steps; save the policy at every evaluation step after 0. Returns the
    training seconds at each saved step and the logged per-step rollout numbers. ``server``: ``(url, token
    file)`` of the project's rollout server, for K >= 1."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from lit_grpo.callbacks import WeightSync

    from lit_grpo.data.datamodule import RolloutDataModule
    from lit_grpo.training.module import GRPOModule
    from lit_grpo.training.optim import OptimizerArgs

    clock = TrainingClock()
    record: dict[str, Any] = {"train_seconds": {}, "steps": []}

    class Saver(Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            clock.start()

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            step = trainer.global_step
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
            record["steps"].append({"step": step, "seconds": clock.seconds(),
                                    "reward_mean": metrics.get("rollout/reward_mean"),
                                    "completion_length": metrics.get("rollout/completion_length"),
                                    "staleness": metrics.get("train/staleness")})
            if step in config.eval_steps:
                record["train_seconds"][step] = clock.seconds()
                clock.save(pl_module.policy, weights_dir / f"step_{step}.safetensors")

    L.seed_everything(config.seed, verbose=False)
    module = GRPOModule(
        model_name=config.model, dtype="float32", beta=config.beta, temperature=config.temperature,
        max_completion_length=config.max_new_tokens, optimizer=OptimizerArgs(lr=config.lr, fused=True),
        gradient_clip_val=config.max_grad_norm, loss_aggregation="token_mean", iterations_per_batch=1,
        # fused AdamW: TRL's default optim (adamw_torch_fused); TRL has no Theorem-1 monitor (one more no-grad
        # forward per batch): off for equal work
        monitor_tv_after_update=False, log_completions_every_n_steps=None, packing=config.packing,
    )
    engine_options: dict[str, Any] | None = None
    engine = "transformers"
    if server is not None:
        url, token_file = server
        engine, engine_options = "server", {"url": url, "token_file": token_file, "generate_timeout_s": 1800}
    data = RolloutDataModule(
        dataset=config.task, split="train", prompts_per_step=config.prompts_per_step,
        num_generations=config.num_generations, micro_batch_size=config.micro_batch_size,
        max_new_tokens=config.max_new_tokens, temperature=config.temperature,
        system_prompt=system_prompt_of(config.prompt, config.task), engine=engine, engine_options=engine_options,
        max_staleness=config.max_staleness, seed=config.seed, advantage_std=config.advantage_std,
        micro_batch_tokens=config.micro_batch_tokens or None,
    )
    trainer = L.Trainer(
        max_steps=config.steps, accelerator="cpu", devices=1, precision=PRECISIONS[config.precision], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(weights_dir), callbacks=[WeightSync(every_n_batches=config.sync_every), Saver()],
    )
    trainer.fit(module, datamodule=data)
    return record

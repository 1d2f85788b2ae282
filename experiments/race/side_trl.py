"""The TRL side of the race: ``trl.GRPOTrainer.train()`` (1.16, no vLLM) on the same model, rows in the same order,
system prompt, reward and hyper-parameters as the lit_grpo side.

The options that make the two objectives equal (each checked against TRL's own loss code by
``tests/test_trl_loss_parity.py``): ``loss_type="dapo"`` = ``model.loss_aggregation: token_mean``;
``scale_rewards="group"`` = ``data.scale_rewards: true``; ``epsilon`` = ``eps_low`` (``epsilon_high`` unset: the
same on both sides); ``beta`` = ``model.beta``; ``num_iterations=1`` = ``iterations_per_batch: 1``; one generation
batch of ``prompts_per_step * num_generations`` completions per optimizer step (``steps_per_generation=1``,
``gradient_accumulation_steps=1``); ``top_k=0``, ``top_p=1``; AdamW with a constant learning rate, no warm-up, no
weight decay, gradients clipped at ``max_grad_norm``; dropout off on both sides.

Precision is set, never left to TRL: ``GRPOConfig`` turns ``bf16`` on whenever it is unset (``bf16 = not fp16``), and
with ``use_cpu=True`` accelerate then runs every forward, generation included, under CPU autocast in bfloat16. The
race sets ``bf16`` and ``fp16`` itself (:data:`PRECISION_OPTIONS`; ``tf32`` applies to CUDA matmuls only and is left
unset on a CPU) and records what accelerate actually ran (``accelerator.mixed_precision``) in every run's JSON."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from race_config import RaceConfig, reward, system_prompt_of, train_rows, user_message
from race_weights import TrainingClock

ROW_KEYS = ("task", "config", "entry", "answer")

#: ``RaceConfig.precision`` -> the GRPOConfig options that set TRL's numerics, and the mixed precision accelerate must
#: then report
PRECISION_OPTIONS: dict[str, dict[str, bool]] = {"32": {"bf16": False, "fp16": False},
                                                 "bf16": {"bf16": True, "fp16": False}}
EFFECTIVE_PRECISION: dict[str, str] = {"32": "no", "bf16": "bf16"}


def messages(config: RaceConfig, row: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": "system", "content": system_prompt_of(config.prompt, config.task)},
            {"role": "user", "content": user_message(row)}]


def task_reward(prompts: list, completions: list, **columns: list) -> list[float]:
    """TRL's batched reward: the task's scorer on each completion, with its row's columns."""
    rows = [{key: columns[key][i] for key in ROW_KEYS} for i in range(len(completions))]
    return [reward(c[0]["content"] if isinstance(c, list) else c, row) for c, row in zip(completions, rows)]


def train(config: RaceConfig, weights_dir: Path) -> dict[str, Any]:
    """As ``side_ours.train``: ``config.steps`` optimizer steps, the policy saved at every evaluation step after 0."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from lit_grpo.models.loading import load_model_and_tokenizer

    rows = train_rows(config)
    model, tokenizer = load_model_and_tokenizer(config.model, "float32")
    dataset = Dataset.from_list([{"prompt": messages(config, r), **{k: str(r.get(k, "")) for k in ROW_KEYS}}
                                 for r in rows])
    clock = TrainingClock()
    record: dict[str, Any] = {"train_seconds": {}, "steps": []}

    class Saver(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.start()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step = state.global_step
            record["steps"].append({"step": step, "seconds": clock.seconds()})
            if step in config.eval_steps:
                record["train_seconds"][step] = clock.seconds()
                clock.save(kwargs["model"], weights_dir / f"step_{step}.safetensors")

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
            logs = logs or {}
            for entry in record["steps"]:
                if entry["step"] == state.global_step and "reward" in logs:
                    entry["reward_mean"] = logs["reward"]
                    entry["completion_length"] = logs.get("completions/mean_length")

    with tempfile.TemporaryDirectory() as workdir:
        trl_config = grpo_config(config, workdir)
        # TRL builds a reference model (beta > 0) from model.config._name_or_path: make that path hold this model
        if not (Path(str(model.config._name_or_path)) / "config.json").is_file():
            model.save_pretrained(Path(workdir) / "policy")
            tokenizer.save_pretrained(Path(workdir) / "policy")
            model.config._name_or_path = str(Path(workdir) / "policy")
        trainer = GRPOTrainer(model=model, reward_funcs=task_reward, args=trl_config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[Saver()])
        record["trl_effective_precision"] = checked_precision(trainer, config)
        trainer.train()
    record["trl_options"] = {k: v for k, v in trl_config.to_dict().items()
                             if k in TRL_OPTIONS_SHOWN}
    return record


def checked_precision(trainer: Any, config: RaceConfig) -> str:
    """accelerate's mixed precision for this trainer, refused unless it is the one ``config.precision`` names."""
    effective = str(trainer.accelerator.mixed_precision)
    if effective != EFFECTIVE_PRECISION[config.precision]:
        raise RuntimeError(f"TRL runs with mixed precision {effective!r}; the race asked for "
                           f"{EFFECTIVE_PRECISION[config.precision]!r} (precision {config.precision})")
    return effective


def grpo_config(config: RaceConfig, workdir: str) -> Any:
    """TRL's ``GRPOConfig`` for ``config``: every option the race shares with lit_grpo, and the precision."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=workdir, use_cpu=True, use_vllm=False, gradient_checkpointing=False,
        per_device_train_batch_size=config.prompts_per_step * config.num_generations,
        gradient_accumulation_steps=1, steps_per_generation=1, num_generations=config.num_generations,
        num_iterations=1, max_completion_length=config.max_new_tokens, temperature=config.temperature,
        top_p=1.0, top_k=0, beta=config.beta, epsilon=config.epsilon, loss_type="dapo", scale_rewards="group",
        disable_dropout=True, learning_rate=config.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=config.max_grad_norm, max_steps=config.steps, shuffle_dataset=False,
        seed=config.seed, logging_steps=1, report_to="none", save_strategy="no", eval_strategy="no",
        log_completions=False, dataloader_num_workers=0, disable_tqdm=True,
        **PRECISION_OPTIONS[config.precision],
    )


#: the GRPOConfig fields the race sets (the document lists them with their values)
TRL_OPTIONS_SHOWN = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
                     "num_generations", "num_iterations", "max_completion_length", "temperature", "top_p", "top_k",
                     "beta", "epsilon", "epsilon_high", "loss_type", "scale_rewards", "disable_dropout",
                     "learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay", "max_grad_norm",
                     "max_steps", "shuffle_dataset", "seed", "use_vllm", "gradient_checkpointing", "optim",
                     "importance_sampling_level", "mask_truncated_completions", "top_entropy_quantile", "bf16", "fp16",
                     "tf32")

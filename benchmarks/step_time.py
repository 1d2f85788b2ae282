r"""Seconds per GRPO training step: lit_grpo (Lightning) against Hugging Face TRL's ``GRPOTrainer``, on CPU or a GPU.

What it measures
----------------
Both sides train the same policy on the same "demo shape" and the same prompts:

* SmolLM2-135M-Instruct in float32 (``--model``), a frozen reference model (KL weight beta = 0.1);
* per step, 2 GSM8K train prompts (``--prompts``) x G = 8 completions (``--generations``), sampled at
  temperature 1.0 with up to 64 new tokens (``--max-new-tokens``), scored by the correctness reward (``--reward``);
* one optimizer step of AdamW (lr 1e-6, constant, gradient clipping at 1.0) per rollout batch (on-policy).

The prompts are the first ``warmup + steps`` batches of the prompt order our ``RolloutDataModule`` uses (seed 0),
chat-formatted with ``DEFAULT_SYSTEM_PROMPT`` as the system message; TRL gets the same rows, unshuffled, as a
conversational dataset, and the script checks that both sides tokenize them to the same ids.

* ``ours``: a real ``lightning.Trainer.fit`` of ``GRPOModule`` + ``RolloutDataModule`` (in-process
  ``transformers`` rollout engine, ``WeightSync(every_n_batches=1)``).
* ``trl``: ``trl.GRPOTrainer.train()`` (no vLLM, no gradient checkpointing), with the model object loaded by
  ``lit_grpo.models.loading.load_model_and_tokenizer`` and a reward function that wraps the same reward function
  (``lit_grpo.data.rewards.correctness_reward`` by default).

Both run on ``--accelerator`` (``cpu`` by default) at ``--precision`` (``32-true`` by default): the Lightning
Trainer gets both; TRL gets ``use_cpu=True`` on the CPU, and ``bf16=True`` for ``bf16-mixed`` or ``fp16=True``
for ``16-mixed``. The weights stay float32 in both cases (mixed precision autocasts the computation).

For every measured step (the first ``--warmup`` steps are dropped) it records:

* ``total``: wall time of the whole training-loop iteration, from the end of the previous step to the end of
  this one (sampling, rewards, reference and policy passes, optimizer step, weight sync, logging);
* ``generate``: sampling the completions only;
* ``rollout``: everything done to produce the scored batch, minus the reference model's pass
  (ours: ``rollout/rollout_seconds``; TRL: ``_generate_and_score_completions`` minus its reference pass);
* ``update``: reference pass + policy forward/backward + clipping + optimizer step
  (ours: ``train/update_seconds``; TRL: the step's time between ``on_step_begin`` and ``on_step_end`` minus
  ``rollout``);
* mean completion length, truncation rate and mean reward, since completions that stop early at EOS are cheaper.

Each side runs in its own subprocess (the script re-invokes itself with ``--side ours|trl --worker``), so the
peak resident memory (``ru_maxrss``) of one does not hide the other's. The table's peak RSS is the high-water mark
at the end of the last training step; ``peak_rss_process_mib`` in the JSON runs to the process's end, and on a GPU
it also holds Lightning's teardown, which moves the module (policy and reference) and the optimizer state back to
the host when ``fit`` returns (TRL leaves them on the device). On a GPU each side also records its peak
GPU memory (``torch.cuda.max_memory_allocated``) and the device name, and every timer synchronizes the device
before it reads the clock.

How to run
----------
    python benchmarks/step_time.py                      # both sides, 1 warm-up + 3 measured steps
    python benchmarks/step_time.py --steps 5 --threads 8
    python benchmarks/step_time.py --side ours          # one side only
    python benchmarks/step_time.py --steps 1 --warmup 0 --max-new-tokens 16   # quick smoke test

On a GPU
--------
    python benchmarks/step_time.py --accelerator gpu --precision bf16-mixed --model /path/to/model \
        --reward benchmarks.coin_reward:coin --prompts 8 --generations 8 --max-new-tokens 200 --micro-batch 64

``--model`` takes a lit_grpo alias or a local model directory (``benchmarks/make_random_model.py`` builds a
random-init model of a real shape), ``--reward`` a ``module:function`` import path of a reward
``f(completion: str, answer: str, **kwargs) -> float``; ``benchmarks/coin_reward.py`` gives every group a spread
whatever the weights, so the update always has non-zero advantages. Add ``--tf32`` to let float32 matmuls use
TF32 (``torch.set_float32_matmul_precision("high")``) on both sides, e.g. with ``--precision 32-true``.

It prints a table of medians and the ratio ours / TRL, and writes everything, per step, to
``benchmarks/results/step_time.json`` on the CPU at ``32-true``, otherwise to
``benchmarks/results/step_time_<accelerator>_<precision>[_tf32].json`` (``--output`` overrides).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
DEFAULT_OUTPUT = RESULTS_DIR / "step_time.json"  # the CPU, 32-true run
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
RESULT_MARKER = "STEP_TIME_RESULT "
TIMING_KEYS = ("total", "generate", "rollout", "update")
SEED = 0


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", choices=("both", "ours", "trl"), default="both", help="which trainer(s) to time")
    parser.add_argument("--steps", type=int, default=3, help="measured training steps")
    parser.add_argument("--warmup", type=int, default=1, help="training steps run first and not measured")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="lit_grpo model alias, directory or Hub id")
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu", help="device both sides train on")
    parser.add_argument("--precision", choices=PRECISIONS, default="32-true",
                        help="Lightning precision; TRL gets bf16=True / fp16=True for the mixed ones")
    parser.add_argument("--tf32", action="store_true",
                        help="torch.set_float32_matmul_precision('high') on both sides (GPU only)")
    parser.add_argument("--reward", default="correctness",
                        help="reward f(completion, answer, **kwargs) -> float: 'module:function' or a lit_grpo "
                             "built-in name")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch.set_num_threads")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="completion length budget")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--micro-batch-size", "--micro-batch", type=int, default=16,
                        help="completions per forward/backward (ours)")
    parser.add_argument("--beta", type=float, default=0.1, help="KL weight")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--tv-monitor", action="store_true",
                        help="ours: also run the Theorem-1 monitor's after-update pass (GRPOModule's default; "
                             "TRL has no such pass, so it is off here for equal work)")
    parser.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate")
    parser.add_argument("--output", type=Path, default=None,
                        help="where to write the JSON results (default: benchmarks/results/step_time.json on the "
                             "CPU at 32-true, else step_time_<accelerator>_<precision>[_tf32].json)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # run one side in this process
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if args.worker and args.side == "both":
        parser.error("--worker runs a single side: pass --side ours or --side trl")
    if args.accelerator == "cpu" and args.precision == "16-mixed":
        parser.error("--precision 16-mixed needs --accelerator gpu (float16 autocast is not supported on the CPU)")
    if args.tf32 and args.accelerator != "gpu":
        parser.error("--tf32 applies to --accelerator gpu only")
    if args.output is None:
        args.output = default_output(args)
    return args


def default_output(args: argparse.Namespace) -> Path:
    """``step_time.json`` for the CPU at 32-true, else a name that holds the accelerator and precision."""
    if args.accelerator == "cpu" and args.precision == "32-true":
        return DEFAULT_OUTPUT
    return RESULTS_DIR / f"step_time_{args.accelerator}_{args.precision}{'_tf32' if args.tf32 else ''}.json"


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": args.model,
        "dtype": "float32",
        "accelerator": args.accelerator,
        "precision": args.precision,
        "tf32": args.tf32,
        "reward": args.reward,
        "prompts_per_step": args.prompts,
        "generations": args.generations,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "beta": args.beta,
        "lr": args.lr,
        "micro_batch_size": args.micro_batch_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": args.threads,
        "tv_monitor": args.tv_monitor,
    }


# ----------------------------------------------------------------------------------------------------------
# Shared helpers (run inside a worker)
# ----------------------------------------------------------------------------------------------------------


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def reset_peak_rss() -> None:
    """Restart the process's peak resident set (``VmHWM``) from its current one (Linux: ``/proc/self/clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")


def peak_rss_since_reset_mib() -> float:
    """``VmHWM`` of ``/proc/self/status`` in MiB: the peak resident set since :func:`reset_peak_rss`."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("/proc/self/status has no VmHWM")


#: the peak resident set of the last step's update alone: from after its rollout (ours: the batch handed to
#: ``training_step``; TRL: ``_generate_and_score_completions`` returned) to the step's end
UPDATE_PEAK = {"rss_mib": 0.0}

#: the high-water mark of the resident set at the end of the last training step, before either trainer tears
#: down (Lightning's teardown moves the module and the optimizer state to the host, which TRL does not do)
TRAINING_PEAK = {"rss_mib": 0.0}


def on_cuda(args: argparse.Namespace) -> bool:
    return args.accelerator == "gpu"


def make_clock(args: argparse.Namespace) -> Callable[[], float]:
    """``time.perf_counter``, after waiting for the GPU's queued work when on a GPU (kernels run asynchronously,
    so without the wait a phase's time would land in whichever later phase first waits for its results)."""
    if not on_cuda(args):
        return time.perf_counter

    import torch

    def clock() -> float:
        torch.cuda.synchronize()
        return time.perf_counter()

    return clock


def prompt_rows(args: argparse.Namespace) -> tuple[list[int], list[dict[str, str]]]:
    """Indices and rows of the GSM8K train prompts our data module trains on first, in order."""
    from lit_grpo.data.datamodule import RolloutDataModule

    data = RolloutDataModule(prompts_per_step=args.prompts, num_generations=args.generations, seed=SEED)
    indices = data.epoch_order(0)[: (args.warmup + args.steps) * args.prompts]
    return indices, [data.rows[i] for i in indices]


def chat_messages(question: str) -> list[dict[str, str]]:
    from lit_grpo.data.prompts import DEFAULT_SYSTEM_PROMPT

    return [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": question}]


def summarize(steps: list[dict[str, float]], warmup: int) -> dict[str, Any]:
    """Medians over the measured steps (the first ``warmup`` are dropped)."""
    measured = steps[warmup:]
    keys = sorted({k for step in measured for k in step})
    return {"median": {k: statistics.median(step[k] for step in measured) for k in keys}, "measured_steps": measured,
            "warmup_steps": steps[:warmup]}


def metric(metrics: dict[str, Any], key: str) -> float:
    """A logged scalar, NaN when it was not logged (written as null in the JSON)."""
    value = metrics.get(key)
    return float("nan") if value is None else float(value)


def json_safe(value: Any) -> Any:
    """NaN and infinities become None, so the output is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


# ----------------------------------------------------------------------------------------------------------
# Ours: Lightning Trainer.fit of GRPOModule + RolloutDataModule
# ----------------------------------------------------------------------------------------------------------


def run_ours(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from lit_grpo.callbacks import WeightSync

    from lit_grpo.data.datamodule import RolloutDataModule
    from lit_grpo.data.prompts import DEFAULT_SYSTEM_PROMPT
    from lit_grpo.training.module import GRPOModule
    from lit_grpo.training.optim import OptimizerArgs

    class StepRecorder(Callback):
        """Per-step logged metrics and loop wall time. The rollout runs in ``on_after_batch_transfer``, before
        ``on_train_batch_start``, so a step's wall time is measured from the previous step's end to its end."""

        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []
            self.last_end = 0.0

        def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.last_end = clock()

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            now = clock()
            TRAINING_PEAK["rss_mib"] = peak_rss_mib()
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
            self.steps.append({
                "total": now - self.last_end,
                "generate": metric(metrics, "rollout/generate_seconds"),
                "rollout": metric(metrics, "rollout/rollout_seconds"),
                "update": metric(metrics, "train/update_seconds"),
                "weight_sync": metric(metrics, "sync/seconds"),
                "completion_length": metric(metrics, "rollout/completion_length"),
                "truncation_rate": metric(metrics, "rollout/truncation_rate"),
                "reward_mean": metric(metrics, "rollout/reward_mean"),
            })
            self.last_end = now

    clock = make_clock(args)
    L.seed_everything(SEED, verbose=False)
    indices, _ = prompt_rows(args)
    module = GRPOModule(
        model_name=args.model, dtype="float32", beta=args.beta, temperature=args.temperature,
        max_completion_length=args.max_new_tokens, optimizer=OptimizerArgs(lr=args.lr),
        # equal work: TRL has no Theorem-1 monitor, whose after-update pass is one more no-grad forward
        monitor_tv_after_update=args.tv_monitor,
    )
    data = RolloutDataModule(
        dataset="bundled", split="train", prompts_per_step=args.prompts, num_generations=args.generations,
        micro_batch_size=args.micro_batch_size, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        rewards=[args.reward], system_prompt=DEFAULT_SYSTEM_PROMPT, engine="transformers", seed=SEED,
    )
    recorder = StepRecorder()  # after WeightSync, so each step's time includes its weight sync
    with tempfile.TemporaryDirectory() as workdir:
        trainer = L.Trainer(
            max_steps=args.warmup + args.steps, accelerator=args.accelerator, devices=1, precision=args.precision,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=workdir, callbacks=[WeightSync(every_n_batches=1), recorder],
        )
        start = clock()
        trainer.fit(module, datamodule=data)
        fit_seconds = clock() - start
    return {"prompt_rows": indices, "fit_seconds": fit_seconds, **summarize(recorder.steps, args.warmup)}


# ----------------------------------------------------------------------------------------------------------
# TRL: GRPOTrainer.train on the same model, prompts and reward
# ----------------------------------------------------------------------------------------------------------


def make_trl_reward(spec: str) -> Callable[..., list[float]]:
    """TRL's batched reward around the function ``spec`` names, resolved exactly as our data module resolves it
    and called the same way, ``fn(completion_text, answer)``."""
    from lit_grpo.data.rewards import resolve_reward

    fn = resolve_reward(spec)

    def reward(prompts: list, completions: list, answer: list[str], **kwargs: Any) -> list[float]:
        """TRL reward signature: conversational completions are ``[{"role": "assistant", "content": ...}]``."""
        return [float(fn(c[0]["content"] if isinstance(c, list) else c, a)) for c, a in zip(completions, answer)]

    reward.__name__ = getattr(fn, "__name__", "reward")  # TRL logs rewards/<name>/mean
    return reward


def run_trl(args: argparse.Namespace) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lit_grpo.data.prompts import DEFAULT_SYSTEM_PROMPT, prompt_ids
    from lit_grpo.models.loading import load_model_and_tokenizer

    clock = make_clock(args)
    indices, rows = prompt_rows(args)
    model, tokenizer = load_model_and_tokenizer(args.model, "float32")
    dataset = Dataset.from_list([{"prompt": chat_messages(r["question"]), "answer": r["answer"]} for r in rows])

    # The prompt text must be token-for-token the one our data module builds.
    trl_ids = [tokenizer.apply_chat_template(conversation=chat_messages(r["question"]), add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for r in rows]
    ours_ids = [prompt_ids(tokenizer, r["question"], DEFAULT_SYSTEM_PROMPT) for r in rows]
    prompts_match = [list(a) for a in trl_ids] == ours_ids

    class StepTimer(TrainerCallback):
        """Wall time per optimizer step, plus what TRL logs (completion length, reward) at each step."""

        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []
            self.logs: dict[int, dict[str, float]] = {}
            self.last_end = 0.0
            self.begin = 0.0
            self.phase = {"generate": 0.0, "generate_and_score": 0.0, "reference": 0.0}

        def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.last_end = clock()

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.begin = clock()
            self.phase = dict.fromkeys(self.phase, 0.0)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            now = clock()
            TRAINING_PEAK["rss_mib"] = peak_rss_mib()
            UPDATE_PEAK["rss_mib"] = peak_rss_since_reset_mib()  # reset when the step's batch was scored
            rollout = self.phase["generate_and_score"] - self.phase["reference"]
            self.steps.append({
                "total": now - self.last_end,
                "generate": self.phase["generate"],
                "rollout": rollout,
                "update": (now - self.begin) - rollout,
                "reference": self.phase["reference"],
            })
            self.last_end = now

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
            # merged: the end-of-training summary is logged at the last step's global_step too
            self.logs.setdefault(state.global_step, {}).update(logs or {})

    timer = StepTimer()

    def timed(trainer: GRPOTrainer, name: str, phase: str, only_model: Any = None) -> None:
        """Wrap ``trainer.<name>`` so its time adds to ``timer.phase[phase]`` (for ``only_model``'s calls only)."""
        original = getattr(trainer, name)

        def wrapper(*a: Any, **kw: Any) -> Any:
            model_arg = a[0] if a else kw.get("model")
            counts = only_model is None or model_arg is only_model()
            start = clock() if counts else 0.0
            out = original(*a, **kw)
            if counts:
                timer.phase[phase] += clock() - start
            return out

        setattr(trainer, name, wrapper)

    rows = args.prompts * args.generations
    per_pass = getattr(args, "trl_micro_batch_size", None) or rows
    if rows % per_pass:
        raise SystemExit(f"TRL's rows per pass must divide the batch's {rows} rows, got {per_pass}")
    passes = rows // per_pass
    with tempfile.TemporaryDirectory() as workdir:
        config = GRPOConfig(
            output_dir=workdir,
            use_cpu=not on_cuda(args), bf16=args.precision == "bf16-mixed", fp16=args.precision == "16-mixed",
            use_vllm=False, gradient_checkpointing=bool(getattr(args, "trl_gradient_checkpointing", False)),
            # one generation batch of prompts x G completions per optimizer step, trained in one pass, or in
            # accumulated passes of `trl_micro_batch_size` rows where a caller sets it (memory)
            per_device_train_batch_size=per_pass, gradient_accumulation_steps=passes,
            steps_per_generation=passes, num_generations=args.generations, num_iterations=1,
            max_completion_length=args.max_new_tokens, temperature=args.temperature, top_p=1.0,
            beta=args.beta, epsilon=0.2, loss_type="dapo", scale_rewards="group", disable_dropout=True,
            learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            max_grad_norm=1.0, max_steps=args.warmup + args.steps, shuffle_dataset=False, seed=SEED,
            logging_steps=1, report_to="none", save_strategy="no", eval_strategy="no", log_completions=False,
            dataloader_num_workers=0, disable_tqdm=True,
        )
        # TRL builds its reference model with from_pretrained(model.config._name_or_path): make that path hold
        # this model (a model converted from GGUF on first use still points at the GGUF folder).
        if not (Path(str(model.config._name_or_path)) / "config.json").is_file():
            model.save_pretrained(Path(workdir) / "policy")
            tokenizer.save_pretrained(Path(workdir) / "policy")
            model.config._name_or_path = str(Path(workdir) / "policy")
        trainer = GRPOTrainer(model=model, reward_funcs=make_trl_reward(args.reward), args=config,
                              train_dataset=dataset, processing_class=tokenizer, callbacks=[timer])
        # what accelerate actually runs, recorded and held to the precision asked for (TRL turns bf16 on by default)
        effective = str(trainer.accelerator.mixed_precision)
        expected = {"bf16-mixed": "bf16", "16-mixed": "fp16"}.get(args.precision, "no")
        if effective != expected:
            raise SystemExit(f"TRL runs with mixed precision {effective!r}, expected {expected!r} "
                             f"(precision {args.precision})")
        timed(trainer, "_generate", "generate")
        timed(trainer, "_generate_and_score_completions", "generate_and_score")
        scored = trainer._generate_and_score_completions

        def scored_then_reset(*a: Any, **kw: Any) -> Any:
            out = scored(*a, **kw)
            reset_peak_rss()  # the update's own peak starts here (UPDATE_PEAK)
            return out

        trainer._generate_and_score_completions = scored_then_reset
        timed(trainer, "_get_per_token_logps_and_entropies", "reference", only_model=lambda: trainer.ref_model)
        start = clock()
        trainer.train()
        fit_seconds = clock() - start

    for i, step in enumerate(timer.steps):
        logs = timer.logs.get(i + 1, {})
        step["completion_length"] = metric(logs, "completions/mean_length")
        step["truncation_rate"] = metric(logs, "completions/clipped_ratio")
        step["reward_mean"] = metric(logs, "reward")
    return {"prompt_rows": indices, "prompt_tokens_match_ours": prompts_match, "fit_seconds": fit_seconds,
            "trl_gradient_checkpointing": config.gradient_checkpointing,
            "trl_precision": {"bf16": config.bf16, "fp16": config.fp16, "mixed_precision": effective},
            "trl_optim": str(getattr(config.optim, "value", config.optim)),  # TRL's default: the fused AdamW kernel
            **summarize(timer.steps, args.warmup)}


# ----------------------------------------------------------------------------------------------------------
# Worker and driver
# ----------------------------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    """Run one side in this process and print its results as one JSON line on stdout."""
    import torch

    torch.set_num_threads(args.threads)
    if args.tf32:
        torch.set_float32_matmul_precision("high")
    result = run_ours(args) if args.side == "ours" else run_trl(args)
    result["peak_rss_mib"] = TRAINING_PEAK["rss_mib"]  # while training: the table's figure
    result["update_peak_rss_mib"] = UPDATE_PEAK["rss_mib"]  # the last step's update alone (TRL's side only here)
    result["peak_rss_process_mib"] = peak_rss_mib()  # to the process's end, teardown included
    result["torch_threads"] = torch.get_num_threads()
    result["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    if on_cuda(args):
        result["device_name"] = torch.cuda.get_device_name()
        result["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
        result["peak_gpu_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
    print(RESULT_MARKER + json.dumps(json_safe(result)), flush=True)


def worker_command(args: argparse.Namespace, side: str) -> list[str]:
    """This script's command line for a worker that runs ``side`` with the same settings."""
    return [
        sys.executable, str(Path(__file__).resolve()), "--side", side, "--worker",
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--model", args.model,
        "--threads", str(args.threads), "--max-new-tokens", str(args.max_new_tokens),
        "--prompts", str(args.prompts), "--generations", str(args.generations),
        "--micro-batch-size", str(args.micro_batch_size), "--beta", repr(args.beta),
        "--temperature", repr(args.temperature), "--lr", repr(args.lr),
        "--accelerator", args.accelerator, "--precision", args.precision, "--reward", args.reward,
        *(["--tf32"] if args.tf32 else []), *(["--tv-monitor"] if args.tv_monitor else []),
    ]


def run_side(args: argparse.Namespace, side: str) -> dict[str, Any]:
    """Re-invoke this script as a worker for one side and collect its JSON line."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    command = worker_command(args, side)
    print(f"[step_time] running {side}: {' '.join(command)}", file=sys.stderr, flush=True)
    proc = subprocess.run(command, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout)
        raise SystemExit(f"[step_time] the {side} worker failed (exit code {proc.returncode})")
    return json.loads(lines[-1][len(RESULT_MARKER):])


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version(), "platform": platform.platform(), "cpus": str(os.cpu_count())}
    for package in ("torch", "lightning", "transformers", "trl", "accelerate"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found


def device_info(args: argparse.Namespace) -> dict[str, Any]:
    """The GPU the run used (None on the CPU); exits early when ``--accelerator gpu`` finds no CUDA device."""
    import torch

    if not on_cuda(args):
        return {"device_name": None, "cuda": None}
    if not torch.cuda.is_available():
        raise SystemExit("[step_time] --accelerator gpu, but torch.cuda.is_available() is False")
    return {"device_name": torch.cuda.get_device_name(), "cuda": torch.version.cuda,
            "device_count": torch.cuda.device_count()}


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """ours / TRL for each median time and the peak RSS (None where a value is missing)."""
    ours = {**results["ours"]["median"], "peak_rss": results["ours"]["peak_rss_mib"],
            "peak_gpu": results["ours"].get("peak_gpu_mib")}
    trl = {**results["trl"]["median"], "peak_rss": results["trl"]["peak_rss_mib"],
           "peak_gpu": results["trl"].get("peak_gpu_mib")}
    return {k: ours[k] / trl[k] if ours.get(k) is not None and trl.get(k) else None
            for k in (*TIMING_KEYS, "peak_rss", "peak_gpu")}


def cell(value: float | None, width: int, decimals: int) -> str:
    return f"{'n/a':>{width}}" if value is None else f"{value:>{width}.{decimals}f}"


def print_table(results: dict[str, dict[str, Any]], config: dict[str, Any], device: dict[str, Any]) -> None:
    where = (f"{device['device_name']}, {config['precision']}{' + tf32' if config['tf32'] else ''}"
             if config["accelerator"] == "gpu" else f"CPU, {config['precision']}, {config['threads']} threads")
    print(f"\nGRPO step time, {config['model']} (float32 weights), {where}, reward {config['reward']}, "
          f"{config['prompts_per_step']} prompts x {config['generations']} completions, "
          f"<= {config['max_new_tokens']} new tokens, micro-batch {config['micro_batch_size']} (ours); "
          f"median of {config['steps']} steps after {config['warmup']} warm-up\n")
    gpu = config["accelerator"] == "gpu"
    columns = [("total s", 10), ("generate s", 12), ("rollout s", 11), ("update s", 10), ("peak RSS MiB", 14),
               *([("peak GPU MiB", 14)] if gpu else []), ("compl. len", 12), ("truncated", 11)]
    header = f"{'side':<9}" + "".join(f"{name:>{width}}" for name, width in columns)
    print(header)
    print("-" * len(header))
    for side, result in results.items():
        m = result["median"]
        print(f"{side:<9}" + cell(m.get("total"), 10, 2) + cell(m.get("generate"), 12, 2)
              + cell(m.get("rollout"), 11, 2) + cell(m.get("update"), 10, 2) + cell(result["peak_rss_mib"], 14, 0)
              + (cell(result.get("peak_gpu_mib"), 14, 0) if gpu else "")
              + cell(m.get("completion_length"), 12, 1) + cell(m.get("truncation_rate"), 11, 2))
    if {"ours", "trl"} <= results.keys():
        r = ratios(results)
        print(f"{'ours/trl':<9}" + cell(r["total"], 10, 2) + cell(r["generate"], 12, 2) + cell(r["rollout"], 11, 2)
              + cell(r["update"], 10, 2) + cell(r["peak_rss"], 14, 2) + (cell(r["peak_gpu"], 14, 2) if gpu else ""))
    if "trl" in results and not results["trl"]["prompt_tokens_match_ours"]:
        print("\nWARNING: TRL's chat-formatted prompt tokens differ from ours")
    print()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    device = device_info(args)
    from lit_grpo.data.rewards import resolve_reward

    try:
        resolve_reward(args.reward)  # a wrong --reward fails here, before any model is loaded
    except ValueError as e:
        raise SystemExit(f"[step_time] --reward: {e}") from e
    sides = ("ours", "trl") if args.side == "both" else (args.side,)
    results = {side: run_side(args, side) for side in sides}
    config = run_config(args)
    print_table(results, config, device)
    report: dict[str, Any] = {"config": config, "versions": versions(), "device": device, "sides": results}
    if len(results) == 2:
        report["ratio_ours_over_trl"] = ratios(results)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(json_safe(report), indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

r"""The tool demo's update: padded, packed as prompt copies, as a prefix tree, and TRL's, side by side in one run.

    OMP_NUM_THREADS=2 python benchmarks/tool_demo_packing.py [--prompts 16] [--steps 3] [--warmup 1] [--budget 8192]

The workload is ``configs/demo_tools_cpu.yaml`` as it trains (``calc-tiny-sft``, ``--prompts`` prompts (16 in the
config) x 8 multi-turn trajectories of a tool call, the calculator's answer and the model's reply, one update per
batch), run with ``python -m lit_grpo fit`` in a subprocess per side, one after the other, for ``--warmup + --steps``
steps, evaluation off:

* ``padded``: the config as it is (one micro-batch of 128 rows, prompts once, completions right-padded);
* ``copies``: ``model.packing`` with ``data.micro_batch_tokens`` = ``--budget``, each trajectory after its own copy
  of its prompt (the layout before the prefix tree; ``benchmarks.packing.force_copies_layout``);
* ``tree``: the same as a prefix tree: each prompt once, and once any turns a group's trajectories share;
* ``trl``: TRL 1.16's ``GRPOTrainer`` training on the ``padded`` side's rollouts, replayed (its
  ``_generate_and_score_completions`` returns them; the environment's tokens as its ``tool_mask`` leaves them,
  context without loss): its own forward of ``[rows, prompt + completion]``, loss (``loss_type="dapo"``, the
  demo's ``token_mean``), backward and optimizer step. TRL's tool loop needs a chat template with a tool-call
  parser, which the demo's character tokenizer has not, so the rollouts come from ours; the update is TRL's own.

Every side starts from the same weights and seed, so step 1's rollouts are the same on every side; later steps'
weights differ by rounding between layouts (within 1e-5), so their samples may part. The table gives, per side,
the median over the measured steps of ``train/update_seconds`` (beta = 0: the policy's forward and backward and
the optimizer step), ``train/update_tokens_per_second`` (the batch's real tokens over it), ``train/padded_fraction``
and the mean completion length (to show the sides trained on the same lengths). Writes
``benchmarks/results/tool_demo_packing.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

REPO_ROOT = Path(__file__).resolve().parents[1]
OUTPUT = REPO_ROOT / "benchmarks" / "results" / "tool_demo_packing.json"
SIDES = ("padded", "copies", "tree", "trl")
#: the metrics read back from each run's TensorBoard events
TAGS = ("train/update_seconds", "rollout/completion_length", "train/padded_fraction", "train/update_tokens_per_second")
#: what the copies side runs in its process before the CLI
COPIES_PREAMBLE = "from benchmarks.packing import force_copies_layout; force_copies_layout(); "
#: the rollouts the padded side trained on, replayed by the TRL side
ROLLOUTS = "rollouts.pt"
#: the demo's group size (``data.num_generations``)
GROUP = 8


class RecordRollouts(Callback):
    """Saves every training batch's token rows, masks and advantages to ``path`` at the end of the fit (the
    ``padded`` side runs with it, for the ``trl`` side to replay)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.batches: list[dict[str, torch.Tensor]] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        rows = batch.group_index
        self.batches.append({
            "prompt_ids": batch.prompt_ids[rows], "prompt_mask": batch.prompt_mask[rows],
            "completion_ids": batch.completion_ids, "completion_mask": batch.completion_mask,
            "tool_mask": batch.token_mask, "advantages": batch.advantages,
        })

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        torch.save(self.batches, self.path)


def side_command(side: str, steps: int, budget: int, prompts: int, out: Path) -> list[str]:
    """The command line of one side: a fit, or for ``trl`` this script's TRL worker."""
    if side == "trl":
        return [sys.executable, str(Path(__file__).resolve()), "--trl-worker", str(out)]
    callbacks = "[]"
    if side == "padded":
        callbacks = json.dumps([{"class_path": "benchmarks.tool_demo_packing.RecordRollouts",
                                 "init_args": {"path": str(out / ROLLOUTS)}}])
    options = [
        "fit", "--config", str(REPO_ROOT / "configs" / "demo_tools_cpu.yaml"), f"--trainer.max_steps={steps}",
        f"--trainer.default_root_dir={out}", f"--trainer.logger.init_args.save_dir={out}",
        "--trainer.enable_checkpointing=false", f"--trainer.callbacks={callbacks}",
        f"--data.prompts_per_step={prompts}",
        "--eval.at_start=false", "--eval.at_end=false", "--eval.every_n_optimizer_steps=100000",
    ]
    if side != "padded":
        options += ["--model.packing=true", f"--data.micro_batch_tokens={budget}"]
    preamble = COPIES_PREAMBLE if side == "copies" else ""
    code = f"import sys; {preamble}from lit_grpo.cli.commands import run; sys.argv = ['lit_grpo', *{options!r}]; run()"
    return [sys.executable, "-c", code]


def read_metrics(run_dir: Path) -> dict[str, Any]:
    if (run_dir / "trl.json").is_file():
        return json.loads((run_dir / "trl.json").read_text())
    from lit_grpo.cli.plots import read_scalars

    scalars = read_scalars(run_dir)
    return {tag: scalars.get(tag, []) for tag in TAGS}


def trl_config(workdir: str, rows: int, steps: int) -> Any:
    """TRL's options for the demo's update, in float32 as the fits run (``32-true``): ``bf16`` and ``fp16`` set
    here, since ``GRPOConfig`` turns bf16 on when it is unset and accelerate then autocasts on a CPU."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=workdir, use_cpu=True, use_vllm=False, gradient_checkpointing=False, bf16=False, fp16=False,
        per_device_train_batch_size=rows, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=GROUP, num_iterations=1, beta=0.0, epsilon=0.2, loss_type="dapo",
        learning_rate=5e-4, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        max_steps=steps, shuffle_dataset=False, seed=0, logging_steps=1, report_to="none",
        save_strategy="no", eval_strategy="no", log_completions=False, dataloader_num_workers=0,
        disable_tqdm=True, disable_dropout=True,
    )


def trl_worker(out: Path) -> None:
    """TRL's ``GRPOTrainer`` on the padded side's recorded rollouts (``out/../padded/rollouts.pt``), one optimizer
    step per batch, options as the demo's config; writes ``out/trl.json`` with the same series as the fits."""
    import time

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from lit_grpo.models.loading import load_model_and_tokenizer

    batches = torch.load(out.parent / "padded" / ROLLOUTS)
    rows = batches[0]["completion_ids"].shape[0]
    model, tokenizer = load_model_and_tokenizer("calc-tiny-sft", "float32")
    replayed = iter(batches)

    def replay(self: Any, inputs: Any) -> dict[str, torch.Tensor]:
        batch = dict(next(replayed))
        batch["num_items_in_batch"] = (batch["completion_mask"] * batch["tool_mask"]).sum()
        return batch

    GRPOTrainer._generate_and_score_completions = replay
    series: dict[str, Any] = {tag: [] for tag in TAGS}

    class UpdateTimer(TrainerCallback):
        """An optimizer step's seconds (the replay inside it takes microseconds) and the batch's counts."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.begin = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            seconds = time.perf_counter() - self.begin
            step = state.global_step - 1
            batch = batches[step]
            trained = float((batch["completion_mask"] * batch["tool_mask"]).sum())
            real = float(batch["prompt_mask"].sum() + batch["completion_mask"].sum())
            computed = batch["prompt_mask"].numel() + batch["completion_mask"].numel()
            series["train/update_seconds"].append((step, seconds))
            series["train/update_tokens_per_second"].append((step, trained / seconds))
            series["train/padded_fraction"].append((step, 1.0 - real / computed))
            # the model's own tokens, as the fits log it (lit_grpo.data.rollout.rollout_stats)
            series["rollout/completion_length"].append((step, float(batch["tool_mask"].sum(1).float().mean())))

    with tempfile.TemporaryDirectory() as workdir:
        config = trl_config(workdir, rows, len(batches))
        prompts = Dataset.from_dict({"prompt": ["?"] * (rows // GROUP) * len(batches)})
        trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                              args=config, train_dataset=prompts, processing_class=tokenizer,
                              callbacks=[UpdateTimer()])
        series["mixed_precision"] = str(trainer.accelerator.mixed_precision)
        if series["mixed_precision"] != "no":
            raise RuntimeError(f"TRL runs with mixed precision {series['mixed_precision']!r}, not float32")
        trainer.train()
    (out / "trl.json").write_text(json.dumps(series) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="measured steps")
    parser.add_argument("--warmup", type=int, default=1, help="steps run first and not measured")
    parser.add_argument("--budget", type=int, default=8192, help="data.micro_batch_tokens of the packed sides")
    parser.add_argument("--prompts", type=int, default=16, help="data.prompts_per_step (x 8 trajectories each)")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--trl-worker", type=Path, help=argparse.SUPPRESS)  # internal: the trl side's process
    args = parser.parse_args(argv)
    if args.trl_worker is not None:
        trl_worker(args.trl_worker)
        return
    if args.steps < 1 or args.warmup < 0 or args.budget < 1 or not 1 <= args.prompts <= 16:
        parser.error(f"expected --steps >= 1, --warmup >= 0, --budget >= 1, 1 <= --prompts <= 16 (the config's "
                     f"micro-batch of 128 rows); got {args.steps}, {args.warmup}, {args.budget}, {args.prompts}")
    if "trl" in args.sides and "padded" not in args.sides:
        parser.error("the trl side replays the padded side's rollouts: --sides needs padded too")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=str(REPO_ROOT))
    report: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="tool-demo-packing-") as tmp:
        for side in sorted(args.sides, key=SIDES.index):  # padded first: the trl side replays its rollouts
            out = Path(tmp) / side
            out.mkdir()
            print(f"[tool_demo_packing] {side}", file=sys.stderr, flush=True)
            command = side_command(side, args.warmup + args.steps, args.budget, args.prompts, out)
            proc = subprocess.run(command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True)
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr[-4000:])
                report[side] = {"error": f"the fit exited with {proc.returncode}"}
                continue
            metrics = read_metrics(out)
            precision = metrics.pop("mixed_precision", "no")  # TRL's, as accelerate ran it; the fits: 32-true
            measured = {tag: [v for step, v in series if step >= args.warmup] for tag, series in metrics.items()}
            report[side] = {"series": metrics, "mixed_precision": precision,
                            "median": {tag: statistics.median(v) if v else None for tag, v in measured.items()}}
    padded = report.get("padded", {}).get("median", {}).get("train/update_seconds")
    print(f"\n{'side':8} {'update s':>9} {'vs padded':>10} {'upd tok/s':>10} {'padded':>7} {'mean length':>12}")
    for side, result in report.items():
        if "error" in result:
            print(f"{side:8} {result['error']}")
            continue
        m = result["median"]
        seconds = m["train/update_seconds"]
        ratio = padded / seconds if padded and seconds else float("nan")
        print(f"{side:8} {seconds:>9.2f} {ratio:>9.2f}x {m['train/update_tokens_per_second']:>10.1f} "
              f"{m['train/padded_fraction']:>7.3f} {m['rollout/completion_length']:>12.1f}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "sides": report},
                                      indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

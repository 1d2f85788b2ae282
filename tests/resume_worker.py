"""Run a tiny GRPO fit for the resume test, possibly from a checkpoint, and print per-step losses as JSON.

Usage: python resume_worker.py MAX_STEPS OUT_JSON [--ckpt-in PATH] [--ckpt-out PATH]
"""

import argparse
import json

import torch
from conftest import MetricsRecorder, tiny_data, tiny_module, tiny_trainer
from lit_grpo.callbacks import RefModelSwap, WeightSync

KEYS = ("train/loss", "train/kl", "rollout/reward_mean", "train/staleness")


def run(max_steps: int, workdir: str, ckpt_in: str | None = None, ckpt_out: str | None = None) -> list[dict]:
    torch.set_num_threads(1)
    recorder = MetricsRecorder()
    callbacks = [WeightSync(every_n_batches=2), RefModelSwap(every_n_optimizer_steps=4), recorder]
    trainer = tiny_trainer(workdir, max_steps=max_steps, callbacks=callbacks)
    trainer.fit(tiny_module(beta=0.1, lr=1e-2), datamodule=tiny_data(), ckpt_path=ckpt_in)
    if ckpt_out:
        trainer.save_checkpoint(ckpt_out)
    return [{k: step[k] for k in KEYS} for step in recorder.steps]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("max_steps", type=int)
    parser.add_argument("out")
    parser.add_argument("--ckpt-in")
    parser.add_argument("--ckpt-out")
    parser.add_argument("--workdir", default=".")
    args = parser.parse_args()
    steps = run(args.max_steps, args.workdir, args.ckpt_in, args.ckpt_out)
    with open(args.out, "w") as f:
        json.dump(steps, f)

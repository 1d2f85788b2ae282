"""One GPU fit in its own process (each strategy sets up its own process group): the GPU tier's precision x
strategy matrix. Usage: python gpu_worker.py JOB_JSON; prints one line ``GPU_RESULT {...}`` with every step's
metrics."""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
from conftest import MetricsRecorder, tiny_data, tiny_module, tiny_trainer
from lit_grpo.callbacks import WeightSync
from scripted_engine import ScriptedDataModule


def make_strategy(kind: str):  # noqa: ANN201
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    timeout = timedelta(seconds=120)
    if kind == "auto":
        return "auto"
    if kind == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1, timeout=timeout)
    if kind == "fsdp":
        return FSDPStrategy(timeout=timeout)
    raise ValueError(f"unknown strategy {kind!r}")


def run(job: dict) -> dict:
    recorder = MetricsRecorder()
    data = tiny_data(cls=ScriptedDataModule) if job.get("scripted") else tiny_data(**job.get("data", {}))
    module = tiny_module(**job.get("module", {}))
    trainer = tiny_trainer(job["workdir"], max_steps=job["steps"], accelerator="gpu", devices=1,
                           precision=job["precision"], strategy=make_strategy(job["strategy"]),
                           callbacks=[WeightSync(every_n_batches=job.get("v", 1)), recorder])
    trainer.fit(module, datamodule=data)
    return {"steps": recorder.steps, "device": torch.cuda.get_device_name()}


if __name__ == "__main__":
    print("GPU_RESULT " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)

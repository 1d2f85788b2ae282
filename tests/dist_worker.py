"""One rank of a multi-process test (or the single process it is compared with).

Usage: python dist_worker.py JOBS_JSON OUT_PREFIX. Each job is a dict (see ``run_job``); rank r writes the list of
job results to ``OUT_PREFIX.r.json``. Launched by ``distributed_launch.launch`` with the environment variables of
an external launcher (LOCAL_RANK, WORLD_SIZE, ...), so Lightning joins the processes instead of spawning them.
"""

from __future__ import annotations

import contextlib
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
from conftest import MetricsRecorder, tiny_data, tiny_module, tiny_trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lit_grpo.callbacks import GSM8KPassAtK, RefModelSwap, WeightSync
from scripted_engine import ScriptedDataModule

from lit_grpo.core.distributed import full_named_parameters
from lit_grpo.data.datamodule import RolloutDataModule
from lit_grpo.data.rewards import RewardRunner
from lit_grpo.training.flops import parameter_count

KEYS = ("train/loss", "train/kl", "rollout/reward_mean", "rollout/reward_std", "rollout/frac_zero_variance",
        "rollout/generated_tokens", "train/staleness", "train/ratio_first_iteration_min",
        "train/ratio_first_iteration_max", "train/ratio_mean", "train/clip_low_fraction", "train/entropy",
        "train/grad_norm", "train/update_flops", "rollout/staleness_mean", "rollout/staleness_max",
        "rollout/mixed_versions", "rollout/producer_waits", "train/reference_served", "train/padded_fraction",
        "rollout/token_staleness_mean", "rollout/token_staleness_max", "rollout/servers_up")
#: gradient reductions this process made in the current job (DDP comm-hook calls, FSDP2 reduce-scatters)
REDUCTIONS = {"count": 0}


def counting_allreduce_hook(state, bucket):  # noqa: ANN001, ANN201
    """DDP's default all-reduce, counted: one call per gradient bucket per synced backward."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    REDUCTIONS["count"] += 1
    return allreduce_hook(state, bucket)


class CountDDPReductions(Callback):
    """Put the counting hook on the DDP model before the first backward (Lightning registers its own
    ``ddp_comm_hook`` on CUDA only)."""

    def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        if isinstance(trainer.strategy.model, torch.nn.parallel.DistributedDataParallel):
            trainer.strategy.model.register_comm_hook(None, counting_allreduce_hook)


@contextlib.contextmanager
def counting_reduce_scatters():  # noqa: ANN201
    """Count FSDP2's gradient reduce-scatters (it calls ``torch.distributed.reduce_scatter_single``)."""
    original = torch.distributed.reduce_scatter_single

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        REDUCTIONS["count"] += 1
        return original(*args, **kwargs)

    torch.distributed.reduce_scatter_single = counted
    try:
        yield
    finally:
        torch.distributed.reduce_scatter_single = original


def make_strategy(kind: str, world: int):  # noqa: ANN201
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    timeout = timedelta(seconds=90)  # a deadlock fails the test in seconds, not Lightning's 30 minutes
    if kind == "single":
        return "auto"
    if kind == "ddp":
        return DDPStrategy(process_group_backend="gloo", timeout=timeout)
    if kind == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1, timeout=timeout)
    raise ValueError(kind)


class RecordRows:
    """Mixin for a data module: remember the dataset rows of every rollout batch this rank drew."""

    def rollout_batch(self, prompt_batch):  # noqa: ANN001, ANN201
        self.drawn = getattr(self, "drawn", []) + [list(prompt_batch.rows)]
        return super().rollout_batch(prompt_batch)

    def assemble(self, prompt_batch, groups, *args):  # noqa: ANN001, ANN002, ANN201
        """Also remember the weight versions a rollout server reported for the batch's completions."""
        versions = sorted({int(v) for g in groups for c in g for v in c.versions})
        self.versions = getattr(self, "versions", []) + [versions]
        # per completion: its versions and span lengths (partial rollouts), and where the batch's alpha came from
        spans = [[list(c.versions), list(c.span_lengths), len(c.token_ids)] for g in groups for c in g]
        self.spans = getattr(self, "spans", []) + [spans]
        batch = super().assemble(prompt_batch, groups, *args)
        self.alpha_sources = getattr(self, "alpha_sources", []) + [batch.alpha_source]
        return batch


class PushedVersions(Callback):
    """The weight version the rollout engine reports after WeightSync's push at the start and after each batch
    (WeightSync comes first in the list): the versions the server really held."""

    def __init__(self) -> None:
        self.versions: list[int] = []

    def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        self.versions.append(int(trainer.datamodule.rollout_engine.synced_step))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.versions.append(int(trainer.datamodule.rollout_engine.synced_step))


class SaveAt(Callback):
    """Save a checkpoint at the end of the batch after which ``global_step`` is ``step`` (after WeightSync's push,
    which comes first in the list): mid-run, with the batches generated ahead pending."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


class RealData(RecordRows, RolloutDataModule):
    pass


class ScriptedData(RecordRows, ScriptedDataModule):
    pass


class EngineVsPolicy(MetricsRecorder):
    """After each step (and after WeightSync, which comes first in the list): does the engine hold exactly the
    full policy? Gathering is a collective, so every rank runs it."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        engine = trainer.datamodule.rollout_engine
        if hasattr(engine, "weight_checksums"):  # a rollout server: compare its SHA-256 of every parameter
            from lit_grpo.wire.weight_transfer import checksum

            full = {name: checksum(t) for name, t in full_named_parameters(pl_module.policy)}
            same = all(served == full for served in engine.weight_checksums().values())
            self.steps.append({"global_step": trainer.global_step, "synced_step": engine.synced_step, "same": same})
            return
        mine = dict(engine.model.named_parameters())
        same = all(torch.equal(mine[name], full) for name, full in full_named_parameters(pl_module.policy))
        self.steps.append({"global_step": trainer.global_step, "synced_step": engine.synced_step, "same": same,
                           "shares_policy": bool(getattr(engine, "shares_policy", False))})


class CheckCounter(MetricsRecorder):
    """Every step's logged metrics and how many sampler checks (``lit_grpo.data.sampler_check``) ran so far: a
    logged gap stays in ``callback_metrics`` after its step, so the count says when a check ran."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        check = getattr(trainer.datamodule, "sampler_check", None)
        self.steps[-1]["sampler_checks"] = float(check.checks) if check is not None else 0.0


class KillServer(MetricsRecorder):
    """Rank 0 kills the rollout server (SIGKILL, process id ``pid``) at the end of batch ``after_batch``: the
    server dies mid-run, between two rollout batches."""

    def __init__(self, pid: int, after_batch: int) -> None:
        super().__init__()
        self.pid, self.after_batch = pid, after_batch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        import os
        import signal

        # once: batch_idx counts from 0 again in every epoch
        if trainer.global_rank == 0 and trainer.global_step == self.after_batch and self.pid is not None:
            os.kill(self.pid, signal.SIGKILL)
            self.pid = None


class WaitForServers(MetricsRecorder):
    """Every rank waits, at the end of the batch after which ``global_step`` is ``at_step``, until each of ``urls``
    answers ``/health``: a server restarted mid-run is back before the next push, whatever the machine's speed."""

    def __init__(self, urls: list[str], at_step: int) -> None:
        super().__init__()
        self.urls, self.at_step = list(urls), at_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_step == self.at_step:
            for url in self.urls:
                wait_until_serving(url)


def wait_until_serving(url: str, timeout_s: float = 240.0) -> None:
    """The server may still be loading its model when the ranks start: poll its /health."""
    import time
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with opener.open(url + "/health", timeout=5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def run_job(job: dict, workdir: str) -> dict:
    torch.set_num_threads(1)
    world = int(job.get("world", 1))
    recorder = CheckCounter()
    pushed = PushedVersions()
    callbacks = [WeightSync(every_n_batches=job.get("v", 1), max_tv=job.get("max_tv")), pushed]
    if job.get("swap_every"):  # after WeightSync, or before it with swap_first (the new pi_ref is pushed at once)
        swap = RefModelSwap(every_n_optimizer_steps=job["swap_every"])
        callbacks.insert(0, swap) if job.get("swap_first") else callbacks.append(swap)
    compare = EngineVsPolicy() if job.get("compare_engine") else None
    callbacks += [c for c in (compare,) if c is not None]
    for kill in ([job["kill_server"]] if job.get("kill_server") else []) + list(job.get("kill_servers", [])):
        callbacks.append(KillServer(**kill))
    if job.get("wait_for_servers"):
        callbacks.append(WaitForServers(**job["wait_for_servers"]))
    if job.get("ckpt_at"):
        callbacks.append(SaveAt(**job["ckpt_at"]))
    evaluator = None
    if job.get("eval"):
        e = job["eval"]
        evaluator = GSM8KPassAtK(every_n_optimizer_steps=None, at_start=True, at_end=False,
                                 num_samples=e["num_samples"],
                                 ks=e["ks"], num_questions=e["num_questions"], questions_per_chunk=e["per_chunk"],
                                 max_new_tokens=e["max_new_tokens"], system_prompt=None)
        evaluator.judge = RewardRunner([("toy_rewards:has_digit", 1.0)])
        callbacks.append(evaluator)
    callbacks.append(recorder)
    data_cls = ScriptedData if job.get("scripted") else RealData
    data_kwargs = dict(job.get("data", {}))
    if job.get("server"):  # rollouts from a rollout server (tests/test_server_multiprocess.py)
        for url in job["server"].get("urls") or [job["server"]["url"]]:
            wait_until_serving(url)
        data_kwargs.update(engine="server", engine_options=dict(job["server"]))
    data = tiny_data(cls=data_cls, **data_kwargs)
    if "seed" in job:  # what the module draws at its start (a LoRA adapter's A) is then the same in every job
        torch.manual_seed(job["seed"])
    module = tiny_module(**job.get("module", {}))
    count = job.get("count_reductions", False)
    callbacks += [CountDDPReductions()] if count else []
    # "tensorboard": the fit writes TensorBoard events under WORKDIR/tb (every step), read back by the test
    logger = dict(logger=TensorBoardLogger(workdir, name="tb"), log_every_n_steps=1) if job.get("tensorboard") else {}
    trainer = tiny_trainer(workdir, max_steps=job["max_steps"], callbacks=callbacks, devices=world,
                           strategy=make_strategy(job.get("strategy", "single"), world),
                           precision=job.get("precision", "32-true"), **logger)
    REDUCTIONS["count"] = 0
    with counting_reduce_scatters() if count else contextlib.nullcontext():
        trainer.fit(module, datamodule=data, ckpt_path=job.get("ckpt_in"))
    if job.get("ckpt_out"):
        trainer.save_checkpoint(job["ckpt_out"])
    full = {name: t.detach().clone() for name, t in full_named_parameters(module.policy)}  # every rank gathers
    if job.get("weights_out") and trainer.global_rank == 0:
        torch.save(full, job["weights_out"])
    return {
        "steps": [{k: s[k] for k in KEYS if k in s} for s in recorder.steps],
        "sampler_checks": [s["sampler_checks"] for s in recorder.steps],
        "drawn": getattr(data, "drawn", []),
        "versions": getattr(data, "versions", []),
        "spans": getattr(data, "spans", []),
        "alpha_sources": getattr(data, "alpha_sources", []),
        "pushed": pushed.versions,
        "engine_vs_policy": compare.steps if compare else None,
        "tensorboard": str(Path(workdir) / "tb") if job.get("tensorboard") else None,
        "eval": evaluator.history if evaluator else None,
        "rank": trainer.global_rank,
        "world": trainer.world_size,
        "reductions": REDUCTIONS["count"],
        # counted on the policy as trained: sharded (DTensor) parameters under FSDP2
        "parameters": parameter_count(module.policy),
        "sharded": any(hasattr(p, "full_tensor") for p in module.policy.parameters()),
    }


if __name__ == "__main__":
    jobs = json.loads(Path(sys.argv[1]).read_text())
    prefix = sys.argv[2]
    results = []
    for i, job in enumerate(jobs):
        results.append(run_job(job, str(Path(prefix).parent / f"job{i}")))
    rank = results[0]["rank"] if results else 0
    Path(f"{prefix}.{rank}.json").write_text(json.dumps(results))
    # an ordinary end: lit_grpo.core.distributed releases the process groups at exit, before the interpreter finalizes

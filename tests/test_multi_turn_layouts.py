"""Multi-turn rollouts on every CPU layout: the in-process engine, the project's rollout server as a real process
(synchronous, pi_ref scored on the server, asynchronous K = 1 with an exact resume while trajectories are in
flight), LoRA, and two gloo ranks under DDP and FSDP2.

Every trajectory is prompt, model turn, environment reply, model turn (``toy_environments:TwoTurns`` with a tiny
model whose turns end early, ``multi_turn_helpers``), so each batch holds environment tokens (mask 0) between the
model's. Three launches of ``dist_worker`` jobs in all: one process for the single-process fits, one for the
resumed half, two ranks for DDP and FSDP2.
"""

from __future__ import annotations

import pytest
from distributed_launch import free_port
from multi_turn_helpers import launch_multi_turn, multi_turn_data, stopping_tiny_llama, task_file
from server_process import ServerProcess

pytestmark = pytest.mark.slow  # an end-to-end tier of its own: python -m pytest -m slow

#: beta > 0 so that pi_ref (scored over the same sequence as pi, environment tokens included) enters the loss
MODULE = dict(beta=0.1, lr=1e-2)
#: timings and counts of waits differ between runs that compute the same numbers
UNTIMED = {"rollout/producer_waits"}


def job(model: str, task, max_steps: int, server: ServerProcess | None = None, k: int = 0, served: bool = False,
        **extra) -> dict:
    """A single-process fit of ``max_steps`` steps: in process, or against ``server`` with ``data.max_staleness``
    ``k`` (``served``: pi_ref's log-probs from the server)."""
    spec = dict(v=1, max_steps=max_steps, module=dict(MODULE, model_name=model),
                data=multi_turn_data(task, max_staleness=k, reference_on_server=served), **extra)
    if server is not None:
        spec["server"] = dict(url=server.url, token=server.token, timeout_s=60, bucket_mb=0.05)
    return spec


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("multi_turn")
    model, task = str(stopping_tiny_llama(root / "model")), task_file(root / "task.jsonl")
    server = ServerProcess(root / "server", model=model, port=free_port())  # loads while the first jobs run
    ckpt = str(root / "half.ckpt")
    try:
        jobs = {
            "in_process": job(model, task, 3),
            "lora": dict(job(model, task, 2), module=dict(MODULE, model_name=model, lora=dict(r=4)), seed=0),
            "server": job(model, task, 3, server),
            "served": job(model, task, 3, server, served=True),
            "straight": job(model, task, 4, server, k=1),
            "first_half": job(model, task, 2, server, k=1, ckpt_out=ckpt),
        }
        out = dict(zip(jobs, launch_multi_turn(list(jobs.values()), world=1, workdir=root / "one", timeout_s=400)[0],
                       strict=True))
        # a fresh process resumes from the checkpoint, which holds the batch generated ahead (K = 1)
        out["resumed"] = launch_multi_turn([job(model, task, 4, server, k=1, ckpt_in=ckpt)], world=1,
                                           workdir=root / "resumed", timeout_s=200)[0][0]
        two = [dict(strategy=strategy, max_steps=2, module=dict(MODULE, model_name=model),
                    data=multi_turn_data(task, prompts_per_step=1)) for strategy in ("ddp", "fsdp2")]
        out["ddp"], out["fsdp2"] = zip(*launch_multi_turn(two, world=2, workdir=root / "two", timeout_s=300),
                                       strict=True)
        yield out
    finally:
        server.kill()


def assert_multi_turn(steps: list[dict], count: int) -> None:
    """``count`` steps, each a multi-turn batch that trained: two turns per trajectory with the environment's
    tokens between them, nothing failed, a finite loss, and rewards that moved the policy."""
    assert len(steps) == count
    for step in steps:
        assert step["rollout/turns"] > 1.0 and step["rollout/env_tokens"] > 0, step
        assert step["rollout/env_errors"] == 0.0
        assert 0 < step["rollout/model_tokens"] <= 2 * 8  # two turns of max_new_tokens at most
        assert step["train/loss"] == pytest.approx(step["train/loss"])  # not NaN
        assert abs(step["train/loss"]) < 1e3 and step["train/grad_norm"] < 1e3
    assert any(step["train/grad_norm"] > 0 for step in steps)


def assert_same(expected: list[dict], got: list[dict]) -> None:
    for want, have in zip(expected, got, strict=True):
        for key in want.keys() - UNTIMED:
            assert have[key] == pytest.approx(want[key], abs=1e-6), key


@pytest.mark.parametrize("name", ["in_process", "lora", "server", "served", "straight"])
def test_every_single_process_layout_trains_on_multi_turn_trajectories(runs, name):
    steps = runs[name]["steps"]
    assert_multi_turn(steps, len(steps))
    assert len(steps) == {"lora": 2, "straight": 4}.get(name, 3)


def test_the_project_server_samples_the_trajectories_the_in_process_engine_does(runs):
    # one server thread in float32 and the same seeds: every turn's request gives the in-process engine's tokens,
    # so the environments answer alike and every number agrees
    assert_same(runs["in_process"]["steps"], runs["server"]["steps"])
    assert len({round(s["train/loss"], 6) for s in runs["server"]["steps"]}) > 1
    # the weights pushed before every step are the ones that sampled its batch
    assert [s["train/staleness"] for s in runs["server"]["steps"]] == [0.0] * 3


def test_pi_ref_scored_on_the_server_over_the_whole_trajectory(runs):
    local, served = runs["server"]["steps"], runs["served"]["steps"]
    assert [s["train/reference_served"] for s in served] == [1.0] * 3
    assert [s["train/reference_served"] for s in local] == [0.0] * 3
    assert any(s["train/kl"] > 0 for s in local)
    for want, have in zip(local, served, strict=True):
        for key in ("train/loss", "train/kl", "train/grad_norm", "rollout/reward_mean", "rollout/env_tokens"):
            assert have[key] == pytest.approx(want[key], abs=1e-6), key


def test_asynchronous_rollouts_run_whole_trajectories_one_step_ahead(runs):
    steps = runs["straight"]["steps"]
    assert [s["rollout/staleness_max"] for s in steps] == [0.0, 1.0, 1.0, 1.0]
    assert all(s["rollout/mixed_versions"] == 0 for s in steps)  # no trajectory spans two weight versions
    # a lagging batch is off-policy: its ratio moves once the policy has
    assert any(s["train/ratio_first_iteration_min"] < 1.0 for s in steps[1:])


def test_exact_resume_with_trajectories_in_flight(runs):
    straight, first, second = runs["straight"]["steps"], runs["first_half"]["steps"], runs["resumed"]["steps"]
    assert len(first) == 2 and len(second) == 2
    assert_same(straight, first + second)
    # the resumed run trained first on the trajectories the checkpoint carried (sampled before it was written)
    assert runs["resumed"]["versions"][0] == runs["straight"]["versions"][2]
    assert len({round(s["train/loss"], 6) for s in straight}) > 1 and any(s["train/kl"] > 0 for s in straight)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_train_on_multi_turn_trajectories_and_agree(runs, strategy):
    rank0, rank1 = runs[strategy]
    assert_multi_turn(rank0["steps"], 2)
    assert rank0["steps"] == rank1["steps"]  # reduced metrics: the ranks agree on every number
    assert rank0["drawn"] != rank1["drawn"]  # each rank ran the trajectories of its own tasks
    assert rank0["world"] == 2

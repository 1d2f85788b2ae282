"""Asynchronous off-policy GRPO (``data.max_staleness`` = K) against a real rollout server process
(``python -m lit_grpo serve``), the trainers in processes of their own (``dist_worker``): K = 0 unchanged, the
staleness bound, versions the server really held, the first-iteration ratio at lr ~ 0, 2 FSDP2 ranks in lockstep,
an exact resume with a batch generated ahead and a restarted server, a server killed with requests in flight, and a
server down at start."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from distributed_launch import free_port, launch, launch_to_the_end
from server_process import ROOT, ServerProcess

pytestmark = pytest.mark.slow  # an end-to-end tier of its own: python -m pytest -m slow

# beta > 0 so that the KL term counts in the compared numbers; one prompt x 4 completions per rank and step
SETTINGS = dict(module=dict(beta=0.1, lr=1e-2), data=dict(prompts_per_step=1))


def options(server: ServerProcess) -> dict:
    return dict(url=server.url, token=server.token, timeout_s=60, bucket_mb=0.05)


def job(server: ServerProcess | None, k: int, max_steps: int, v: int = 1, served: bool = False, **extra) -> dict:
    """``served``: pi_ref's log-probs come from the server (data.reference_on_server)."""
    spec = dict(v=v, max_steps=max_steps, module=dict(SETTINGS["module"]),
                data=dict(SETTINGS["data"], max_staleness=k, reference_on_server=served), **extra)
    if server is not None:
        spec["server"] = options(server)
    return spec


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    first = ServerProcess(root / "server1", port=free_port())
    second = ServerProcess(root / "server2", port=free_port())  # loads while the first launch runs
    try:
        first.wait_ready()
        ckpt = str(root / "half.ckpt")
        jobs = {
            "in_process": dict(v=1, max_steps=4, **SETTINGS),
            "k0": job(first, 0, 4),
            "straight": job(first, 1, 6),
            "first_half": job(first, 1, 3, ckpt_out=ckpt),
            "k2": job(first, 2, 5),
            "k1_v3": job(first, 1, 7, v=3, tensorboard=True),
            # the Theorem-1 monitor decides the pushes: any drift (TV > 0) syncs after every batch
            "k1_tv": job(first, 1, 5, v=10, max_tv=0.0),
            "frozen": dict(job(first, 1, 4), module=dict(beta=0.1, lr=1e-30)),
            # pi_ref scored by the server, with and without asynchronous rollouts, across a stage swap
            "k0_served": job(first, 0, 4, served=True),
            "swap_local": job(first, 1, 6, swap_every=3),
            "swap_served": job(first, 1, 6, served=True, swap_every=3),
            "served_first_half": job(first, 1, 3, served=True, swap_every=3, ckpt_out=str(root / "served.ckpt")),
            # bf16-mixed: the server scores under the trainer's autocast; pi_ref swapped before WeightSync pushes
            "bf16_local": job(first, 0, 4, swap_every=2, swap_first=True, precision="bf16-mixed"),
            "bf16_served": job(first, 0, 4, served=True, swap_every=2, swap_first=True, precision="bf16-mixed"),
        }
        names = list(jobs)
        results = launch(list(jobs.values()), world=1, workdir=root / "one", timeout_s=600)[0]
        out = dict(zip(names, results, strict=True))
        first.kill()
        second.wait_ready()
        out["resumed"], out["served_resumed"] = launch(
            [job(second, 1, 6, ckpt_in=ckpt),
             job(second, 1, 6, served=True, swap_every=3, ckpt_in=str(root / "served.ckpt"))],
            world=1, workdir=root / "resumed", timeout_s=300)[0]
        # the checkpoint gathers both ranks' batches generated ahead (a collective in the data module's state)
        out["fsdp2"] = launch([job(second, 1, 3, strategy="fsdp2", ckpt_out=str(root / "fsdp2.ckpt"))], world=2,
                              workdir=root / "fsdp2", timeout_s=300)
        out["fsdp2_ckpt"] = root / "fsdp2.ckpt"
        out["fsdp2_served"] = launch([job(second, 1, 3, served=True, strategy="fsdp2")], world=2,
                                     workdir=root / "fsdp2_served", timeout_s=300)
        yield out, second
    finally:
        first.kill()
        second.kill()


def test_k0_generates_on_the_training_thread_and_equals_the_in_process_engine(runs):
    out, _ = runs
    # K = 0 is the synchronous path: with one server in fp32 its rollouts, and so every number, equal the
    # in-process engine's; every batch is sampled with the weights of its own step
    assert [s["train/staleness"] for s in out["k0"]["steps"]] == [0.0] * 4
    assert "rollout/staleness_max" not in out["k0"]["steps"][0]
    for expected, got in zip(out["in_process"]["steps"], out["k0"]["steps"], strict=True):
        for key in ("train/loss", "train/kl", "rollout/reward_mean", "train/ratio_first_iteration_min"):
            assert got[key] == pytest.approx(expected[key], abs=1e-6), key


@pytest.mark.parametrize(("name", "k", "v"), [("straight", 1, 1), ("k2", 2, 1), ("k1_v3", 1, 3)])
def test_staleness_stays_within_its_bound_and_every_version_was_held_by_the_server(runs, name, k, v):
    result = runs[0][name]
    steps = result["steps"]
    bound = k + v - 1  # i = 1: (K + v - 1) optimizer steps; K at v = 1
    stale = [s["rollout/staleness_max"] for s in steps]
    assert max(stale) <= bound and all(s["train/staleness"] == s["rollout/staleness_max"] for s in steps)
    if v == 1:  # the first K batches come from the starting weights; from then on every batch is exactly K old
        assert stale == [float(min(b, k)) for b in range(len(steps))]
    else:
        assert max(stale) == bound
    assert all(s["rollout/mixed_versions"] == 0 for s in steps)  # pushes wait: no completion spans two versions
    pushed = set(result["pushed"])
    assert len(result["versions"]) == len(steps)
    for versions in result["versions"]:
        assert len(versions) == 1 and versions[0] in pushed, (versions, pushed)
    # off-policy batches use the sampler's log-probs as alpha: the ratio moves once the policy has moved
    assert any(s["train/ratio_first_iteration_min"] < 1.0 for s in steps[k:])


def test_at_k1_the_gap_and_the_sync_metrics_are_logged_only_at_the_steps_that_measured_them(runs):
    """K = 1, v = 3: only batch 0 is sampled by the policy's own weights (batch 3 was requested before the push that
    followed batch 2); pushes follow batches 2 and 5. Read from the fit's TensorBoard events: nothing is repeated at
    the steps in between (Lightning would hand step 0's gap to the loggers at every step)."""
    from lit_grpo.cli.plots import read_scalars

    scalars = read_scalars(runs[0]["k1_v3"]["tensorboard"])
    staleness = scalars["train/staleness"]
    assert [step for step, _ in staleness] == list(range(7))
    assert [step for step, _ in scalars["train/logp_gap_synced"]] == [s for s, v in staleness if v == 0] == [0]
    assert [step for step, _ in scalars["sync/seconds"]] == [2, 5]
    assert [step for step, _ in scalars["sync/bytes"]] == [2, 5]
    assert scalars["sync/count"] == [(0, 0.0), (1, 0.0), (2, 1.0), (3, 1.0), (4, 1.0), (5, 2.0), (6, 2.0)]
    # the first-push check (lit_grpo.data.sampler_check) ran on batch 0, the first one the pushed weights sampled:
    # the project's server in float32 at one thread reports the trainer's own log-probs
    gap = scalars["rollout/sampler_check_gap"]
    assert [step for step, _ in gap] == [0] and gap[0][1] < 1e-6
    assert [step for step, _ in scalars["rollout/sampler_check_seconds"]] == [0]


def test_max_tv_still_decides_the_pushes_with_asynchronous_rollouts(runs):
    result = runs[0]["k1_tv"]
    # v = 10 alone would never push in 5 batches; TV > 0 after every update pushes after every batch, so the batches
    # are exactly one version old, as at v = 1
    assert [s["rollout/staleness_max"] for s in result["steps"]] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert result["pushed"] == [0, 1, 2, 3, 4, 5]


def test_with_frozen_weights_the_first_iteration_ratio_is_one_whatever_the_staleness(runs):
    steps = runs[0]["frozen"]["steps"]
    assert [s["rollout/staleness_max"] for s in steps] == [0.0, 1.0, 1.0, 1.0]
    for s in steps:
        assert s["train/ratio_first_iteration_min"] == pytest.approx(1.0, abs=2e-6)
        assert s["train/ratio_first_iteration_max"] == pytest.approx(1.0, abs=2e-6)


def test_exact_resume_with_a_batch_generated_ahead_and_a_restarted_server(runs):
    out, _ = runs
    straight, first, second = out["straight"]["steps"], out["first_half"]["steps"], out["resumed"]["steps"]
    assert len(first) == 3 and len(second) == 3
    for expected, got in zip(straight, first + second, strict=True):
        for key in expected.keys() - {"rollout/producer_waits"}:  # a count of timings, like the seconds
            assert got[key] == pytest.approx(expected[key], abs=1e-6), key
    # the resumed run trained first on the batch the checkpoint carried (sampled before the restart)
    assert out["resumed"]["versions"][0] == out["straight"]["versions"][3]
    assert len({round(s["train/loss"], 6) for s in straight}) > 1 and any(s["train/kl"] > 0 for s in straight)


def test_two_fsdp2_ranks_train_asynchronously_in_lockstep(runs):
    ranks = runs[0]["fsdp2"]
    assert ranks[0][0]["steps"] == ranks[1][0]["steps"]  # reduced metrics: the ranks agree on every number
    assert [s["rollout/staleness_max"] for s in ranks[0][0]["steps"]] == [0.0, 1.0, 1.0]
    assert ranks[0][0]["drawn"] != ranks[1][0]["drawn"]  # each rank generated its own prompts
    assert runs[0]["fsdp2_ckpt"].exists()


def test_pi_ref_scored_by_the_server_gives_the_trainers_numbers(runs):
    out, _ = runs
    # K = 0: the server scores every batch with the pi_ref pushed at the start
    assert [s["train/reference_served"] for s in out["k0_served"]["steps"]] == [1.0] * 4
    assert [s["train/reference_served"] for s in out["k0"]["steps"]] == [0.0] * 4
    for expected, got in zip(out["k0"]["steps"], out["k0_served"]["steps"], strict=True):
        for key in ("train/loss", "train/kl", "train/grad_norm", "rollout/reward_mean"):
            assert got[key] == pytest.approx(expected[key], abs=1e-6), key
    # 2 N FLOPs per token fewer on the trainer: policy 6 N + the Theorem-1 after-update pass 2 N, of that + pi_ref 2 N
    ratio = out["k0_served"]["steps"][0]["train/update_flops"] / out["k0"]["steps"][0]["train/update_flops"]
    assert ratio == pytest.approx(8 / 10)


def test_pi_ref_on_the_server_across_a_stage_swap_with_asynchronous_rollouts(runs):
    out, _ = runs
    local, served = out["swap_local"]["steps"], out["swap_served"]["steps"]
    assert any(s["train/kl"] > 0 for s in served[3:])
    for expected, got in zip(local, served, strict=True):
        for key in ("train/loss", "train/kl", "train/grad_norm", "rollout/reward_mean", "rollout/staleness_max"):
            assert got[key] == pytest.approx(expected[key], abs=1e-6), key
    # pi_ref changes after step 2 (RefModelSwap runs after WeightSync): batches 3 and 4 were scored with the old
    # pi_ref (batch 4 was requested before the push of the new one), so the trainer scored them itself
    assert [s["train/reference_served"] for s in served] == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    # exact resume: the batch carried by the checkpoint (3) is scored by the trainer; the resumed run pushes the
    # current pi_ref to the restarted server when it starts, so batch 4 is scored there with it
    resumed = out["served_first_half"]["steps"] + out["served_resumed"]["steps"]
    for expected, got in zip(served, resumed, strict=True):
        for key in expected.keys() - {"rollout/producer_waits", "train/reference_served", "train/update_flops"}:
            assert got[key] == pytest.approx(expected[key], abs=1e-6), key
    assert [s["train/reference_served"] for s in resumed] == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0]


def test_pi_ref_on_the_server_in_bf16_mixed_precision(runs):
    local, served = runs[0]["bf16_local"]["steps"], runs[0]["bf16_served"]["steps"]
    # the swap after step 1 reaches the server before batch 2 is sampled: every batch is scored there
    assert [s["train/reference_served"] for s in served] == [1.0] * 4
    # pi_ref is the policy itself at step 2 (just swapped, not yet updated): the server's autocast pass equals the
    # trainer's policy pass, so KL(pi || pi_ref) is exactly 0 in bf16-mixed too
    assert served[0]["train/kl"] == 0.0 and served[2]["train/kl"] == 0.0 and served[1]["train/kl"] > 0
    for expected, got in zip(local, served, strict=True):
        for key in ("train/loss", "train/kl", "train/grad_norm", "rollout/reward_mean"):
            assert got[key] == pytest.approx(expected[key], abs=1e-6), key


def test_two_fsdp2_ranks_with_pi_ref_on_the_server(runs):
    local, served = runs[0]["fsdp2"], runs[0]["fsdp2_served"]
    assert served[0][0]["steps"] == served[1][0]["steps"]
    assert [s["train/reference_served"] for s in served[0][0]["steps"]] == [1.0] * 3
    for expected, got in zip(local[0][0]["steps"], served[0][0]["steps"], strict=True):
        for key in ("train/loss", "train/kl", "train/grad_norm"):
            assert got[key] == pytest.approx(expected[key], abs=1e-6), key


def test_server_killed_with_requests_in_flight_stops_both_ranks_with_its_url(runs, tmp_path):
    server = runs[1]
    spec = job(server, 1, 5, strategy="fsdp2", kill_server=dict(pid=server.proc.pid, after_batch=1))
    spec["server"]["timeout_s"] = 10
    spec["server"]["generate_timeout_s"] = 20
    codes, logs, elapsed = launch_to_the_end([spec], world=2, workdir=tmp_path / "run", timeout_s=240)
    assert None not in codes and all(code != 0 for code in codes), codes
    for log in logs:
        assert server.url in log and "ServerError" in log, log[-3000:]
    assert elapsed < 120


def test_a_server_down_at_start_is_one_line_before_any_model_loads():
    url = f"http://127.0.0.1:{free_port()}"
    env = dict(os.environ, LIT_GRPO_SERVER_TOKEN="secret", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "lit_grpo", "fit", "--config", "configs/cpu_server.yaml",
                           "--data.max_staleness", "1", "--data.engine_options.url", url],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and url in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr

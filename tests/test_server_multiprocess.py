"""Two trainer processes (DDP and FSDP2 on gloo, through ``distributed_launch``) with rollouts from a rollout
server started by ``python -m lit_grpo serve``: ratio exactly 1 at v = 1, the staleness cycle at v = 4 from the
versions the server reports, the server's weights equal to the gathered policy after every sync, and an exact
resume across a server restart (checkpoint right after a sync). Two launches in all. A server killed mid-run:
tests/test_fleet.py."""

from __future__ import annotations

import pytest
from distributed_launch import assert_same_steps, free_port, launch
from server_process import ServerProcess

pytestmark = pytest.mark.slow  # an end-to-end tier of its own: python -m pytest -m slow

STRATEGIES = ("ddp", "fsdp2")
V1_STEPS = {"ddp": 2, "fsdp2": 3}
# the FSDP2 v = 1 fit is also the straight run the resumed one is compared with (beta > 0: the KL term counts)
RESUME = dict(module=dict(beta=0.1, lr=1e-2), data=dict(prompts_per_step=1))


def server_options(server: ServerProcess) -> dict:
    return dict(url=server.url, token=server.token, timeout_s=60, bucket_mb=0.05)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    first = ServerProcess(root / "server1", port=free_port())
    # the server the second half talks to: a fresh process that never saw a push, as after a restart (started
    # now so that its model loads while the first launch runs)
    second = ServerProcess(root / "server2", port=free_port())
    try:
        jobs, index = [], {}
        for strategy in STRATEGIES:
            index[(strategy, "v1")] = len(jobs)
            jobs.append(dict(strategy=strategy, v=1, max_steps=V1_STEPS[strategy], compare_engine=True,
                             server=server_options(first), **RESUME))
            index[(strategy, "v4")] = len(jobs)
            jobs.append(dict(strategy=strategy, v=4, max_steps=5, compare_engine=True, server=server_options(first),
                             data=dict(prompts_per_step=1)))
        index["first_half"] = len(jobs)
        ckpt = str(root / "half.ckpt")
        jobs.append(dict(strategy="fsdp2", v=1, max_steps=1, ckpt_out=ckpt, server=server_options(first), **RESUME))
        # the ranks start while the server loads its model; they wait for its /health
        ranks = launch(jobs, world=2, workdir=root / "run", timeout_s=600)
        first_version = first.call("GET", "/weight_info")[1]["weight_version"]
        first.kill()
        second.wait_ready()
        fresh_version = second.call("GET", "/weight_info")[1]["weight_version"]
        resumed = launch([dict(strategy="fsdp2", v=1, max_steps=3, ckpt_in=ckpt, server=server_options(second),
                                **RESUME)], world=2, workdir=root / "resumed", timeout_s=300)
        versions = dict(first=first_version, fresh=fresh_version,
                        resumed=second.call("GET", "/weight_info")[1]["weight_version"])
        yield index, ranks, resumed, versions
    finally:
        first.kill()
        second.kill()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_v1_first_iteration_ratio_is_exactly_one_and_server_holds_the_policy(served, strategy):
    index, ranks, _, _ = served
    for rank in range(2):
        result = ranks[rank][index[(strategy, "v1")]]
        assert len(result["steps"]) == V1_STEPS[strategy]
        for step in result["steps"]:
            # synced at this step (the server's version), so alpha = pi_k: the policy's own first forward
            assert step["train/ratio_first_iteration_min"] == 1.0 == step["train/ratio_first_iteration_max"]
            assert step["train/staleness"] == 0.0
        checks = result["engine_vs_policy"]
        assert [c["synced_step"] for c in checks] == list(range(1, V1_STEPS[strategy] + 1))
        assert all(c["same"] for c in checks)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_v4_staleness_cycles_and_server_equals_gathered_policy_after_each_sync(served, strategy):
    index, ranks, _, _ = served
    for rank in range(2):
        result = ranks[rank][index[(strategy, "v4")]]
        assert [s["train/staleness"] for s in result["steps"]] == [0, 1, 2, 3, 0]
        checks = result["engine_vs_policy"]
        assert [c["synced_step"] for c in checks] == [0, 0, 0, 4, 4]
        for c in checks:
            assert c["same"] == (c["global_step"] == c["synced_step"]), c
        # lagging batches are off-policy: the ratio moves away from 1 once the policy has moved
        assert any(s["train/ratio_first_iteration_min"] < 1.0 for s in result["steps"][1:4])
    assert ranks[0][index[(strategy, "v4")]]["steps"] == ranks[1][index[(strategy, "v4")]]["steps"]


def test_exact_resume_across_a_server_restart(served):
    index, ranks, resumed, versions = served
    straight = ranks[0][index[("fsdp2", "v1")]]["steps"]
    first = ranks[0][index["first_half"]]["steps"]
    second = resumed[0][0]["steps"]
    assert versions["first"] == "1" and versions["fresh"] is None and versions["resumed"] == "3"
    assert len(first) == 1 and len(second) == 2
    assert_same_steps(straight, first + second)

"""LoRA on several processes: 2 CPU ranks on gloo under DDP and under FSDP2 (frozen base weights and trainable
adapters sharded in the same modules), compared with one process, as tests/test_multiprocess.py does for full
fine-tuning. One launch runs every job."""

from __future__ import annotations

import pytest
import torch
from dist_worker import run_job
from distributed_launch import launch

pytestmark = pytest.mark.slow  # an end-to-end tier of its own: python -m pytest -m slow

STRATEGIES = ("ddp", "fsdp2")
LORA = dict(beta=0.1, lr=1e-2, lora=dict(r=4))


def equality_job(per_rank_prompts: int, weights_out: str, strategy: str) -> dict:
    # beta > 0 (pi_ref = adapter off, through the sharded module) and a swap after each step (the merge of sharded
    # bases and the fresh adapter on every rank); the same seed, so every job starts from the same adapter
    return dict(strategy=strategy, scripted=True, max_steps=2, weights_out=weights_out, seed=0, swap_every=1,
                data=dict(prompts_per_step=per_rank_prompts), module=LORA)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_two_ranks")
    jobs, index = [], {}
    for strategy in STRATEGIES:
        index[(strategy, "equal")] = len(jobs)
        jobs.append(equality_job(1, str(root / f"{strategy}.pt"), strategy))
        # the in-process engine takes adapters: after each push it holds the policy's base and adapter exactly
        # (under FSDP2 its copy of the sharded policy gets the full tensors once, at the first push); a copy, since
        # at v = 1 under DDP the engine would sample from the policy itself (data.engine_options.weights: auto)
        index[(strategy, "engine")] = len(jobs)
        jobs.append(dict(strategy=strategy, v=1, max_steps=3, seed=0, swap_every=2, compare_engine=True,
                         data=dict(prompts_per_step=1, engine_options={"weights": "copy"}), module=LORA))
        index[(strategy, "shared")] = len(jobs)  # the default: the policy itself under DDP, a copy under FSDP2
        jobs.append(dict(strategy=strategy, v=1, max_steps=3, seed=0, swap_every=2, compare_engine=True,
                         data=dict(prompts_per_step=1), module=LORA))
    ranks = launch(jobs, world=2, workdir=root / "run", timeout_s=600)
    return root, index, ranks


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_equal_one_rank_for_the_adapter_and_the_merged_base(two_ranks, tmp_path, strategy):
    root, index, ranks = two_ranks
    two = ranks[0][index[(strategy, "equal")]]
    single = tmp_path / "single.pt"
    one = run_job(equality_job(2, str(single), "single"), str(tmp_path))
    expected, got = torch.load(single), torch.load(root / f"{strategy}.pt")
    assert expected.keys() == got.keys() and any(".lora_A." in k for k in expected)
    worst = max((expected[k] - got[k]).abs().max().item() for k in expected)
    assert worst <= 1e-5, f"adapters and merged bases differ by {worst}"
    # the steps did something: the swaps merged a trained adapter into the base
    initial = tmp_path / "init.pt"
    run_job(dict(equality_job(2, str(initial), "single"), max_steps=0), str(tmp_path / "init"))
    start = torch.load(initial)
    moved = max((expected[k] - start[k]).abs().max().item() for k in expected if ".base_layer." in k)
    assert moved > 1e-5, "no merge reached the base, so the comparison proves nothing"
    for a, b in zip(one["steps"], two["steps"], strict=True):
        for key in ("train/loss", "train/kl", "rollout/reward_mean", "train/grad_norm"):
            assert b[key] == pytest.approx(a[key], abs=1e-6), key
    assert two["sharded"] == (strategy == "fsdp2")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_push_the_adapter_and_the_engine_follows_the_merges(two_ranks, strategy):
    _, index, ranks = two_ranks
    for rank in ranks:
        checks = rank[index[(strategy, "engine")]]["engine_vs_policy"]
        assert [c["global_step"] for c in checks] == [1, 2, 3]
        # step 2 swaps after its push: the engine keeps the old adapter on the old base until the push of step 3,
        # which carries the merge; then its base and adapter are the policy's, bitwise
        assert [c["same"] for c in checks] == [True, False, True], checks
        assert not any(c["shares_policy"] for c in checks)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_at_v1_ddp_samples_from_the_policy_itself_and_fsdp2_from_a_copy(two_ranks, strategy):
    _, index, ranks = two_ranks
    for rank in ranks:
        checks = rank[index[(strategy, "shared")]]["engine_vs_policy"]
        assert [c["shares_policy"] for c in checks] == [strategy == "ddp"] * 3, checks
        # the policy itself is always the policy; the copy lags at step 2 (its swap came after the push)
        assert [c["same"] for c in checks] == ([True] * 3 if strategy == "ddp" else [True, False, True]), checks
        shared, copy = rank[index[(strategy, "shared")]]["steps"], rank[index[(strategy, "engine")]]["steps"]
        assert len(shared) == len(copy) == 3
        for mine, theirs in zip(shared, copy):  # the same fit, to float32's last bits
            assert mine == pytest.approx(theirs, rel=1e-5, abs=1e-8)

"""Multi-process training on CPU with real processes: 2 ranks on gloo under DDP and under FSDP2
(``fully_shard`` through Lightning's ``ModelParallelStrategy``), compared with one process.

Each launch starts two real processes that run several fits back to back (one process group, many trainers), so
the whole file costs three launches.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from dist_worker import run_job
from distributed_launch import assert_same_steps, launch

pytestmark = pytest.mark.slow  # an end-to-end tier of its own: python -m pytest -m slow

STRATEGIES = ("ddp", "fsdp2")
EQUALITY_CASES = list(itertools.product((False, True), ("token_mean", "seq_mean_token_mean", "constant")))
# 4 completions a rank in micro-batches of 2 or 1: 2 or 4 micro-batches on each rank (4 or 8 in the one process)
MICRO_BATCH_CASES = [(True, "token_mean", 2), (False, "seq_mean_token_mean", 2), (True, "token_mean", 1)]
EVAL = dict(num_samples=3, ks=[1, 2], num_questions=5, per_chunk=1, max_new_tokens=6)
RESUME = dict(v=2, swap_every=4, module=dict(beta=0.1, lr=1e-2), data=dict(prompts_per_step=1))


def equality_job(mask: bool, aggregation: str, per_rank_prompts: int, weights_out: str, strategy: str,
                 micro_batch_size: int = 4, micro_batch_tokens: int | None = None) -> dict:
    # beta > 0 with a reference swap-free run: the KL term and the reference's (sharded) forward take part
    data = dict(prompts_per_step=per_rank_prompts, micro_batch_size=micro_batch_size)
    if micro_batch_tokens is not None:
        data["micro_batch_tokens"] = micro_batch_tokens
    return dict(strategy=strategy, scripted=True, max_steps=2, weights_out=weights_out, count_reductions=True,
                data=data, module=dict(mask_zero_variance=mask, loss_aggregation=aggregation, beta=0.1, lr=1e-3))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One launch of 2 processes: for each strategy the equality fits, the v = 1 and v = 4 fits, a Pass@k
    evaluation at the start of a fit, and the 6-step run the resume test compares with."""
    root = tmp_path_factory.mktemp("two_ranks")
    jobs, index = [], {}
    for strategy in STRATEGIES:
        for mask, agg in EQUALITY_CASES:
            index[(strategy, "equal", mask, agg)] = len(jobs)
            jobs.append(equality_job(mask, agg, 1, str(root / f"{strategy}-{mask}-{agg}.pt"), strategy))
        for mask, agg, size in MICRO_BATCH_CASES:
            index[(strategy, "micro", mask, agg, size)] = len(jobs)
            jobs.append(equality_job(mask, agg, 1, str(root / f"{strategy}-{mask}-{agg}-mb{size}.pt"), strategy, size))
        # token-budget micro-batches: at 200 tokens the rank with the short prompt (140 tokens) needs 1, the one
        # with the long prompt (331) 4, so under FSDP2 the first cuts its rows into 4 too
        index[(strategy, "tokens")] = len(jobs)
        jobs.append(equality_job(True, "token_mean", 1, str(root / f"{strategy}-tokens.pt"), strategy,
                                 micro_batch_tokens=200))
        # the same budget with packed rows (model.packing): one forward per micro-batch on each rank
        index[(strategy, "packed")] = len(jobs)
        packed = equality_job(True, "token_mean", 1, str(root / f"{strategy}-packed.pt"), strategy,
                              micro_batch_tokens=200)
        packed["module"]["packing"] = True
        jobs.append(packed)
        if strategy == "fsdp2":  # the head sharded in the root's unit, run in chunks of 5 of its 100 tokens
            index[(strategy, "chunked")] = len(jobs)
            chunked = equality_job(True, "token_mean", 1, str(root / f"{strategy}-chunked.pt"), strategy,
                                   micro_batch_size=2)  # the first micro-batch's backward without a reduction
            chunked["module"]["head_chunk_mb"] = 5.5 * 4 * 100 / 2**20
            jobs.append(chunked)
            # selective checkpointing with the layers sharded: the recompute runs inside FSDP2's unsharded layer
            index[(strategy, "selective")] = len(jobs)
            selective = equality_job(True, "token_mean", 1, str(root / f"{strategy}-selective.pt"), strategy)
            selective["module"]["gradient_checkpointing"] = "selective"
            jobs.append(selective)
        index[(strategy, "v1")] = len(jobs)
        jobs.append(dict(strategy=strategy, v=1, max_steps=3, data=dict(prompts_per_step=1,
                                                                        reuse_policy_logprobs=False)))
        index[(strategy, "v4")] = len(jobs)
        jobs.append(dict(strategy=strategy, v=4, max_steps=9, compare_engine=True, eval=EVAL,
                         data=dict(prompts_per_step=1)))
        index[(strategy, "straight")] = len(jobs)
        jobs.append(dict(strategy=strategy, max_steps=6, **RESUME))
    # a lagging engine that cannot export its weights, checkpointed: WeightSync warns (once, from rank 0)
    index["warn"] = len(jobs)
    jobs.append(dict(strategy="ddp", scripted=True, v=2, max_steps=1, ckpt_out=str(root / "warn.ckpt"),
                     data=dict(prompts_per_step=1)))
    ranks = launch(jobs, world=2, workdir=root / "run", timeout_s=600)
    return root, index, ranks


def assert_two_ranks_equal_one_rank(two: dict, weights_file, mask: bool, aggregation: str, tmp_path,
                                    micro_batch_size: int, same_cut: bool = True) -> None:
    """The 2-rank fit (one prompt a rank) against one process with both prompts, same micro-batch size: the same
    updated weights (1e-5) and the same logged metrics (and the same FLOPs where the micro-batches are cut alike:
    a prompt shared by two micro-batches is computed twice)."""
    single = tmp_path / "single.pt"
    one = run_job(equality_job(mask, aggregation, 2, str(single), "single", micro_batch_size), str(tmp_path))
    expected, got = torch.load(single), torch.load(weights_file)
    assert expected.keys() == got.keys()
    worst = max((expected[k] - got[k]).abs().max().item() for k in expected)
    assert worst <= 1e-5, f"updated weights differ by {worst}"
    initial = run_job(dict(equality_job(mask, aggregation, 2, str(tmp_path / "init.pt"), "single"), max_steps=0),
                      str(tmp_path / "init"))
    moved = max((expected[k] - torch.load(tmp_path / "init.pt")[k]).abs().max().item() for k in expected)
    assert moved > 1e-4, "the step changed nothing, so the comparison proves nothing"
    assert initial["steps"] == []
    for a, b in zip(one["steps"], two["steps"], strict=True):
        for key in ("train/loss", "train/kl", "rollout/reward_mean", "rollout/frac_zero_variance",
                    "rollout/generated_tokens", "train/ratio_mean", "train/entropy", "train/grad_norm"):
            assert b[key] == pytest.approx(a[key], abs=1e-6), key
        # the model FLOPs count the whole model on every rank (N of the unsharded policy, also under FSDP2)
        if same_cut:
            assert b["train/update_flops"] == pytest.approx(a["train/update_flops"], rel=1e-12)
    assert two["parameters"] == one["parameters"]
    # the batches mixed groups with and without spread, so the eq. 8 mask had something to do
    assert any(0 < s["rollout/frac_zero_variance"] < 1 for s in one["steps"])


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mask,aggregation", EQUALITY_CASES)
def test_two_ranks_one_prompt_each_equal_one_rank_with_both(two_ranks, tmp_path, strategy, mask, aggregation):
    root, index, ranks = two_ranks
    two = ranks[0][index[(strategy, "equal", mask, aggregation)]]
    assert_two_ranks_equal_one_rank(two, root / f"{strategy}-{mask}-{aggregation}.pt", mask, aggregation, tmp_path, 4)
    assert two["sharded"] == (strategy == "fsdp2")


def test_fsdp2_with_the_head_in_chunks_equals_one_rank_with_the_full_logits(two_ranks, tmp_path):
    """FSDP2 with the head's weights sharded (the root's unit, resharded after each forward): the policy's and
    pi_ref's passes in 5-token chunks (``model.head_chunk_mb``) keep the root gathered until the chunks and their
    backward are done, and the update equals one process's with the full logits (its default at this vocabulary),
    2 micro-batches a rank: the first one's gradients kept unreduced."""
    root, index, ranks = two_ranks
    two = ranks[0][index[("fsdp2", "chunked")]]
    assert two["sharded"]
    assert_two_ranks_equal_one_rank(two, root / "fsdp2-chunked.pt", True, "token_mean", tmp_path, 2)


def test_fsdp2_with_selective_checkpointing_equals_one_rank_without(two_ranks, tmp_path):
    """``model.gradient_checkpointing: selective`` under FSDP2 (each decoder layer its own unit, gathered for the
    backward's recompute): the same update as one process that keeps every activation."""
    root, index, ranks = two_ranks
    two = ranks[0][index[("fsdp2", "selective")]]
    assert two["sharded"]
    assert_two_ranks_equal_one_rank(two, root / "fsdp2-selective.pt", True, "token_mean", tmp_path, 4)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mask,aggregation,micro_batch_size", MICRO_BATCH_CASES)
def test_several_micro_batches_per_rank_equal_one_rank(two_ranks, tmp_path, strategy, mask, aggregation,
                                                       micro_batch_size):
    root, index, ranks = two_ranks
    two = ranks[0][index[(strategy, "micro", mask, aggregation, micro_batch_size)]]
    weights = root / f"{strategy}-{mask}-{aggregation}-mb{micro_batch_size}.pt"
    assert_two_ranks_equal_one_rank(two, weights, mask, aggregation, tmp_path, micro_batch_size)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("variant", ["tokens", "packed"])
def test_token_budget_micro_batches_on_two_ranks_equal_row_slicing_in_one(two_ranks, tmp_path, strategy, variant):
    """Token-budget micro-batches on 2 ranks (under FSDP2 the ranks agree on how many), padded or packed, against
    today's row slicing (padded micro-batches of 4) in one process: the same update and metrics."""
    root, index, ranks = two_ranks
    two = ranks[0][index[(strategy, variant)]]
    assert_two_ranks_equal_one_rank(two, root / f"{strategy}-{variant}.pt", True, "token_mean", tmp_path, 4,
                                    same_cut=False)
    single = run_job(equality_job(True, "token_mean", 2, str(tmp_path / "rows.pt"), "single"), str(tmp_path / "r"))
    assert all(t["train/padded_fraction"] <= s["train/padded_fraction"]
               for t, s in zip(two["steps"], single["steps"], strict=True))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradient_reductions_do_not_grow_with_micro_batches(two_ranks, strategy):
    """Gradients are reduced over ranks in the last micro-batch's backward only: 2 or 4 micro-batches a rank make
    as many reductions (DDP buckets, FSDP2 reduce-scatters) per step. Reducing in every backward would make 2 and 4
    times those of 1 micro-batch."""
    _, index, ranks = two_ranks
    for rank in range(2):
        results = {size: ranks[rank][index[(strategy, "micro", True, "token_mean", size)]] for size in (2, 1)}
        made = {size: result["reductions"] for size, result in results.items()}
        one_micro_batch = ranks[rank][index[(strategy, "equal", True, "token_mean")]]["reductions"]
        assert 0 < one_micro_batch and made[1] == made[2], (one_micro_batch, made)
        if strategy == "ddp":  # one all-reduce per bucket per optimizer step, whatever the micro-batches
            assert made[2] == one_micro_batch
        else:
            # FSDP2 reduce-scatters a decoder layer once per use in the synced backward: the prompt pass and the
            # completion pass each use it, and with gradients accumulated from earlier micro-batches both
            # reduce (2 layers: 5 a step instead of 3); still a constant, not one set per micro-batch
            assert made[2] < 2 * one_micro_batch


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ranks_draw_disjoint_prompts_and_sample_differently(two_ranks, strategy):
    _, index, ranks = two_ranks
    drawn = [ranks[r][index[(strategy, "v4")]]["drawn"] for r in range(2)]
    for rows0, rows1 in zip(*drawn, strict=True):
        assert len(rows0) == len(rows1) == 1 and not set(rows0) & set(rows1)
    # one global stream: rank 0 and rank 1 together never see a prompt twice within the epoch
    seen = [r for step in zip(*drawn) for rows in step for r in rows]
    assert len(seen) == len(set(seen)) == 18


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_v1_i1_first_iteration_ratio_is_exactly_one(two_ranks, strategy):
    _, index, ranks = two_ranks
    steps = ranks[0][index[(strategy, "v1")]]["steps"]
    assert len(steps) == 3
    for step in steps:
        # the engine (a full copy on each rank) scored the completions; the sharded policy reproduces it exactly
        assert step["train/ratio_first_iteration_min"] == 1.0 == step["train/ratio_first_iteration_max"]
        assert step["train/staleness"] == 0.0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_v4_staleness_cycles_and_engine_equals_full_policy_after_sync(two_ranks, strategy):
    _, index, ranks = two_ranks
    for rank in range(2):
        result = ranks[rank][index[(strategy, "v4")]]
        assert [s["train/staleness"] for s in result["steps"]] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
        checks = result["engine_vs_policy"]
        assert [c["synced_step"] for c in checks] == [0, 0, 0, 4, 4, 4, 4, 8, 8]
        for c in checks:
            assert c["same"] == (c["global_step"] == c["synced_step"]), c
    # both ranks log the same, reduced, metrics
    assert ranks[0][index[(strategy, "v4")]]["steps"] == ranks[1][index[(strategy, "v4")]]["steps"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_rank_pass_at_k_with_uneven_shards_equals_one_rank(two_ranks, tmp_path, strategy):
    _, index, ranks = two_ranks
    single = run_job(dict(max_steps=1, eval=EVAL, data=dict(prompts_per_step=2)), str(tmp_path))
    expected = single["eval"][0]
    assert 0 < expected["pass@1"] < 1  # a score with spread, so equality means something
    for rank in range(2):  # 5 questions, one per chunk: rank 0 evaluates 3, rank 1 evaluates 2 and idles once
        got = ranks[rank][index[(strategy, "v4")]]["eval"][0]
        assert got["pass@1"] == pytest.approx(expected["pass@1"], abs=1e-12)
        assert got["pass@2"] == pytest.approx(expected["pass@2"], abs=1e-12)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_rank_exact_resume(two_ranks, strategy):
    root, index, ranks = two_ranks
    straight = ranks[0][index[(strategy, "straight")]]["steps"]
    ckpt = str(root / f"{strategy}-half.ckpt")
    first = launch([dict(strategy=strategy, max_steps=3, ckpt_out=ckpt, **RESUME)], world=2,
                   workdir=root / f"{strategy}-first", timeout_s=300)[0][0]["steps"]
    second = launch([dict(strategy=strategy, max_steps=6, ckpt_in=ckpt, **RESUME)], world=2,
                    workdir=root / f"{strategy}-second", timeout_s=300)[0][0]["steps"]
    assert [s["train/staleness"] for s in straight] == [0, 1, 0, 1, 0, 1]  # the checkpoint holds a lagging engine
    assert len(first) == 3 and len(second) == 3
    assert_same_steps(straight, first + second)


def test_callback_warnings_come_from_rank_zero_only(two_ranks):
    root, _, _ = two_ranks
    logs = [(root / "run" / f"rank{r}.log").read_text() for r in range(2)]
    assert "cannot export its weights" in logs[0]
    assert "cannot export its weights" not in logs[1]

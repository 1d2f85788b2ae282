"""Loss aggregation over ranks: with totals summed over ranks, the ranks' weights are the one-process weights."""

import pytest
import torch

from lit_grpo.core.distributed import rank_slice
from lit_grpo.math.aggregation import AGGREGATION_MODES, token_weights
from lit_grpo.training.stat_reduction import reduce_stats


def simulated_ranks(mask: torch.Tensor, world: int):
    """Split rows over ``world`` ranks and return each rank's ``global_sum``: the sum of the same count computed
    on every rank's share (what an all-reduce returns)."""
    shares = mask.chunk(world, dim=0)

    def make_global_sum(mode: str):
        def count(share: torch.Tensor) -> torch.Tensor:
            if mode == "token_mean":
                return share.sum()
            if mode in ("seq_mean_token_mean", "seq_mean_token_sum"):
                return (share.sum(1) > 0).sum().float()
            return torch.tensor(float(share.shape[0]))

        return lambda _local: sum(count(s) for s in shares)

    return shares, make_global_sum


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_rank_weights_with_global_totals_equal_one_process_weights(mode):
    # rows of different lengths, one fully masked row (a zero-variance group under eq. 8)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]]).float()
    full = token_weights(mask, mode, 4)
    shares, make_global_sum = simulated_ranks(mask, 2)
    per_rank = [token_weights(share, mode, 4, global_sum=make_global_sum(mode)) for share in shares]
    assert torch.equal(torch.cat(per_rank), full)
    # hand values for token_mean: 11 counted tokens in all
    if mode == "token_mean":
        assert per_rank[1][0, 0].item() == pytest.approx(1 / 11)
    # without the global totals each rank normalises by its own share: not the one-process loss
    local_only = torch.cat([token_weights(share, mode, 4) for share in shares])
    assert not torch.equal(local_only, full)


def test_reduce_stats_without_process_group_is_identity_and_rank_slice_is_contiguous():
    stats = reduce_stats({"tokens": 3.0, "ratio_min": 0.5, "ratio_max": 2.0})
    assert {k: float(v) for k, v in stats.items()} == {"tokens": 3.0, "ratio_min": 0.5, "ratio_max": 2.0}
    assert rank_slice(list(range(6)), 1, 3, 2) == [2, 3]

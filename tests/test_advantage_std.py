"""``data.advantage_std``: the batch a fit trains on carries the advantages of the std it names (eq. 2's population
std by default, TRL's Bessel-corrected one on request), and a name that is neither is refused when the data module
is built."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_data, tiny_module, tiny_trainer
from lightning.pytorch.callbacks import Callback

from lit_grpo.math.advantages import group_advantages


class BatchAdvantages(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[torch.Tensor, torch.Tensor, str]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append((batch.rewards.clone(), batch.advantages.clone(), batch.advantage_std))


@pytest.mark.parametrize("std", ["population", "bessel"])
def test_a_fits_batches_carry_the_named_advantage(tmp_path, std):
    seen = BatchAdvantages()
    data = tiny_data(num_generations=4, advantage_std=std)
    tiny_trainer(tmp_path, max_steps=2, callbacks=[seen]).fit(tiny_module(), datamodule=data)
    assert len(seen.seen) == 2
    spread = 0
    for rewards, advantages, recorded in seen.seen:
        groups = rewards.view(-1, 4)
        assert recorded == std
        assert torch.allclose(advantages, group_advantages(groups, std=std).view(-1))
        other = group_advantages(groups, std="bessel" if std == "population" else "population").view(-1)
        spread += int((groups.max(1).values > groups.min(1).values).sum())
        if (groups.max(1).values > groups.min(1).values).any():
            assert not torch.allclose(advantages, other)  # the option changed the numbers
    assert spread > 0, "no group with a spread: the test would not tell the two definitions apart"


def test_an_unknown_advantage_std_is_refused_when_the_data_module_is_built():
    with pytest.raises(ValueError, match="^advantage_std must be one of population, bessel, got 'trl'$"):
        tiny_data(advantage_std="trl")

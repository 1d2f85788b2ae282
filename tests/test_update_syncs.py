"""Host syncs in the update: the statistics stay on the device for the whole step, so the number of times
lit_grpo's own code makes the host wait for the device does not grow with the number of micro-batches.

``torch.cuda.set_sync_debug_mode`` needs a GPU, so on the CPU the syncs are counted by name: calls, made from a file
of the ``lit_grpo`` package, of the tensor methods that read device memory back on an accelerator (``item``,
``cpu``, ``float()`` ...) or whose output size depends on the data (``x[mask]`` with a boolean mask, ``nonzero``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_data, tiny_module, tiny_trainer
from lit_grpo.callbacks import WeightSync
from scripted_engine import ScriptedDataModule

import lit_grpo

PACKAGE = Path(lit_grpo.__file__).parent
# The micro-batch layout (each slice's trimmed widths) is read on the host once per step, by RolloutBatch, three
# reads a micro-batch; left out here, this test is about the per-micro-batch loss and statistics.
NOT_COUNTED = {PACKAGE / "core" / "batch.py"}
READS = ("item", "cpu", "tolist", "numpy", "nonzero", "__bool__", "__float__", "__int__")


class HostSyncCounter:
    """Counts the calls of ``READS``, of boolean-mask indexing and of ``.to(<cpu>)`` made from lit_grpo's files,
    while ``active``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.active = False
        self.calls: list[str] = []
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name), lambda *_: True))
        monkeypatch.setattr(torch.Tensor, "__getitem__", self._wrap("x[mask]", torch.Tensor.__getitem__,
                                                                     lambda _, index, *__: boolean_index(index)))
        monkeypatch.setattr(torch.Tensor, "to", self._wrap("to(cpu)", torch.Tensor.to, to_host))

    def _wrap(self, name: str, original, counts):  # noqa: ANN001, ANN202
        def wrapper(tensor, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            if self.active and counts(tensor, *args, **kwargs):
                caller = sys._getframe(1).f_code.co_filename
                if Path(caller).is_relative_to(PACKAGE) and Path(caller) not in NOT_COUNTED:
                    self.calls.append(f"{name} in {Path(caller).name}")
            return original(tensor, *args, **kwargs)

        return wrapper


def boolean_index(index: object) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def to_host(_tensor: torch.Tensor, *args: object, **kwargs: object) -> bool:
    targets = [*args, kwargs.get("device")]
    return any(str(t) == "cpu" or (isinstance(t, torch.device) and t.type == "cpu") for t in targets)


def syncs_in_training_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, micro_batch_size: int,
                            **module_options: object) -> list[str]:
    """Host syncs counted during the training steps (not the rollouts) of a 2-step fit, 8 completions a step."""
    counter = HostSyncCounter(monkeypatch)
    module = tiny_module(**module_options)
    step = module.training_step

    def counted_step(*args: object, **kwargs: object) -> torch.Tensor:
        counter.active = True
        try:
            return step(*args, **kwargs)
        finally:
            counter.active = False

    module.training_step = counted_step
    trainer = tiny_trainer(tmp_path / f"mb{micro_batch_size}", max_steps=2, callbacks=[WeightSync(every_n_batches=1)])
    trainer.fit(module, datamodule=tiny_data(cls=ScriptedDataModule, micro_batch_size=micro_batch_size))
    return counter.calls


@pytest.mark.parametrize("options", [
    dict(beta=0.1),  # reference pass, TV-after-update pass
    dict(loss="rec_oneside_is", iterations_per_batch=2, monitor_tv_after_update=False, mask_zero_variance=True),
], ids=["grpo-beta", "rec-i2"])
def test_host_syncs_do_not_grow_with_the_number_of_micro_batches(tmp_path, monkeypatch, options):
    one = syncs_in_training_steps(tmp_path, monkeypatch, 8, **options)  # 1 micro-batch a step
    eight = syncs_in_training_steps(tmp_path, monkeypatch, 1, **options)  # 8 micro-batches a step
    assert one, "the counter saw nothing: it would not see a sync come back either"
    assert sorted(eight) == sorted(one)
    # what is left is per step: one transfer of the statistics (gradient norms included) and log_step's reads of
    # that host copy
    assert len(one) <= 60 * 2, one

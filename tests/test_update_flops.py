"""Model FLOPs and MFU of the update (``lit_grpo.training.flops``): hand computations, the peak table, and what a fit
logs."""

from __future__ import annotations

import pytest
import torch
from conftest import MetricsRecorder, tiny_data, tiny_module, tiny_trainer
from lit_grpo.callbacks import WeightSync
from scripted_engine import ScriptedDataModule
from torch import nn

from lit_grpo.core.batch import MicroBatch
from lit_grpo.core.prefix_tree import tree_token_count
from lit_grpo.training.flops import (
    fed_tokens,
    model_flops_utilisation,
    parameter_count,
    peak_flops_for,
    processed_tokens,
    update_flops,
)
from lit_grpo.training.module import GRPOModule


class TiedToy(nn.Module):
    """Embedding 5 x 3 tied to the output head, and a 3 -> 3 linear layer with bias: 15 + 9 + 3 = 27 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.mid = nn.Linear(3, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight


def test_parameter_count_by_hand_counts_tied_weights_once():
    assert parameter_count(TiedToy()) == 27


def test_processed_tokens_by_hand():
    # 2 distinct prompts with 3 and 2 real tokens (left-padded); 3 completions of 4, 2 and 1 real tokens in a
    # 4-column slice: the model reads columns 0..2, so 3 + 2 + 1 completion tokens
    prompt_mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    assert processed_tokens(prompt_mask, completion_mask).item() == 5 + 6


def shared_prefix_micro_batch() -> MicroBatch:
    """One prompt of 3 real tokens (5 6 7, left-padded to 4) and 4 completions sharing prefixes: 10 11 12 13 14,
    10 11 9 8, 10 15 16 and the first one again."""
    pad = 0
    rows = [[10, 11, 12, 13, 14], [10, 11, 9, 8, pad], [10, 15, 16, pad, pad], [10, 11, 12, 13, 14]]
    lengths = [5, 4, 3, 5]
    return MicroBatch(prompt_ids=torch.tensor([[pad, 5, 6, 7]]), prompt_mask=torch.tensor([[0, 1, 1, 1]]),
                      prompt_index=torch.zeros(4, dtype=torch.long), completion_ids=torch.tensor(rows),
                      completion_mask=torch.tensor([[1] * n + [0] * (5 - n) for n in lengths]), rows=slice(0, 4))


def test_fed_tokens_by_hand_count_a_prefix_trees_nodes_not_its_budget():
    mb = shared_prefix_micro_batch()
    # the rows fed are prompt + completion[:-1]: 5 6 7 10 11 12 13, 5 6 7 10 11 9, 5 6 7 10 15 and the first again.
    # As a tree: the prompt (3), then 10 11 12 13 (4), 9 off 11 (1), 15 off 10 (1); the duplicate adds none
    assert fed_tokens([mb], "packed_tree").item() == 3 + 4 + 1 + 1
    # the budget's bound subtracts no shared completion prefix: the prompt once, then 4 + 3 + 2 + 4
    assert int(tree_token_count(mb)) == 3 + 13
    # prompt copies: every row with its own prompt, (3 + 4) + (3 + 3) + (3 + 2) + (3 + 4)
    assert fed_tokens([mb], "packed").item() == 25
    # padded: the prompt once, every completion column but the last (width 5) of each row, 4 + 4 + 3 + 4
    assert fed_tokens([mb], "padded").item() == 3 + 15
    # two micro-batches add up
    assert fed_tokens([mb, mb], "packed_tree").item() == 2 * 9
    assert fed_tokens([mb], "packed_tree").dtype == torch.float64
    with pytest.raises(ValueError, match="layout must be .*got 'tree'"):
        fed_tokens([mb], "tree")


def test_update_flops_by_hand():
    # N = 1000 parameters, 50 tokens: i = 2 policy forward+backward passes (6 N each), the reference pass and one
    # TV pass (2 N each): (12 + 2 + 2) * 1000 * 50
    assert update_flops(1000, 50, 2, reference_pass=True, extra_no_grad_passes=1) == 800_000.0
    assert update_flops(1000, 50, 1, reference_pass=False, extra_no_grad_passes=0) == 300_000.0
    with pytest.raises(ValueError, match="iterations=-1"):
        update_flops(1000, 50, -1, reference_pass=False, extra_no_grad_passes=0)


def test_mfu_by_hand():
    # 8e14 FLOPs over 2 devices in 2 s: 2e14 FLOP/s per device, against a 1e15 peak
    assert model_flops_utilisation(8e14, 2.0, 2, 1e15) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="got 0.0"):
        model_flops_utilisation(1.0, 0.0, 1, 1e15)


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 SXM5 80GB", 989e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA L4", 121e12), ("NVIDIA L40S", 362e12),
    # another peak than their family's, or unknown: no number rather than a wrong one
    ("NVIDIA H100 NVL", None), ("NVIDIA H200 NVL", None), ("NVIDIA L40", None), ("NVIDIA GH200 480GB", None),
    ("Tesla T4", None), ("cpu", None),
])
def test_peak_table(name, peak):
    assert peak_flops_for(name) == peak


@pytest.mark.parametrize("bad", [0.0, -1e12, float("nan"), float("inf")])
def test_bad_peak_flops_is_refused_before_the_model_loads(monkeypatch, bad):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("lit_grpo.training.module.load_model_and_tokenizer", no_loading)
    with pytest.raises(ValueError, match=f"peak_flops .*got {bad!r}"):
        GRPOModule(model_name="tiny-random-llama", peak_flops=bad)


class BatchRecorder(MetricsRecorder):
    """Each step's metrics and its rollout batch."""

    def __init__(self) -> None:
        super().__init__()
        self.batches = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.batches.append(batch)


def tokens_by_hand(batch, micro_batch_size: int) -> int:  # noqa: ANN001
    """Per slice of ``micro_batch_size`` rows: the real tokens of its distinct prompts, and of each completion the
    real tokens before the slice's last column (a slice is as wide as its longest completion, 2 at least)."""
    total = 0
    for start in range(0, batch.num_sequences, micro_batch_size):
        rows = range(start, min(start + micro_batch_size, batch.num_sequences))
        prompts = {int(batch.group_index[r]) for r in rows}
        total += sum(int(batch.prompt_mask[p].sum()) for p in prompts)
        lengths = [int(batch.completion_mask[r].sum()) for r in rows]
        width = max(max(lengths), 2)
        total += sum(min(length, width - 1) for length in lengths)
    return total


@pytest.mark.parametrize("micro_batch_size", [4, 3])  # 3: a group's prompt runs (and counts) in two slices
def test_fit_logs_update_flops_and_mfu_against_the_set_peak(tmp_path, micro_batch_size):
    recorder = BatchRecorder()
    module = tiny_module(beta=0.1, iterations_per_batch=2, peak_flops=1e9)
    n = sum(p.numel() for p in module.policy.parameters())
    trainer = tiny_trainer(tmp_path, max_steps=2, callbacks=[WeightSync(every_n_batches=1), recorder])
    trainer.fit(module, datamodule=tiny_data(cls=ScriptedDataModule, micro_batch_size=micro_batch_size))
    for step, batch in zip(recorder.steps, recorder.batches, strict=True):
        # i = 2 policy passes, the reference's and the TV-after-update pass
        expected = (6 * 2 + 2 + 2) * n * tokens_by_hand(batch, micro_batch_size)
        assert step["train/update_flops"] == pytest.approx(expected, rel=1e-6)
        mfu = expected / step["train/update_seconds"] / 1e9
        assert step["train/mfu"] == pytest.approx(mfu, rel=1e-5)


def test_no_mfu_on_a_cpu_without_a_set_peak(tmp_path):
    recorder = MetricsRecorder()
    module = tiny_module(monitor_tv_after_update=False)
    trainer = tiny_trainer(tmp_path, max_steps=1, callbacks=[WeightSync(every_n_batches=1), recorder])
    trainer.fit(module, datamodule=tiny_data(cls=ScriptedDataModule))
    assert "train/mfu" not in recorder.steps[0]
    assert recorder.steps[0]["train/update_flops"] > 0


def tree_nodes_by_hand(batch, micro_batch_size: int) -> int:  # noqa: ANN001
    """Per slice of ``micro_batch_size`` rows, the nodes of its prefix tree: the distinct non-empty prefixes of the
    rows' ``prompt + completion[:-1]`` token sequences (a trie has one node per distinct prefix)."""
    total = 0
    for start in range(0, batch.num_sequences, micro_batch_size):
        prefixes = set()
        for row in range(start, min(start + micro_batch_size, batch.num_sequences)):
            prompt = batch.prompt_ids[batch.group_index[row]][batch.prompt_mask[batch.group_index[row]].bool()]
            completion = batch.completion_ids[row][batch.completion_mask[row].bool()]
            if completion.numel() == 0:
                continue
            sequence = tuple(prompt.tolist() + completion[:-1].tolist())
            prefixes.update(sequence[:k] for k in range(1, len(sequence) + 1))
        total += len(prefixes)
    return total


@pytest.mark.filterwarnings("ignore:model.packing")  # the rows of micro_batch_size, unbudgeted, are what is counted
def test_a_packed_tree_fit_counts_the_nodes_it_fed(tmp_path):
    """The scripted engine gives a prompt with an even token sum G identical completions, and the others
    completions that share their first tokens: the tree runs each shared prefix once, and the FLOPs count that."""
    recorder = BatchRecorder()
    module = tiny_module(beta=0.1, iterations_per_batch=2, packing=True, peak_flops=1e9)
    assert module.micro_batch_layout == "packed_tree"
    n = sum(p.numel() for p in module.policy.parameters())
    trainer = tiny_trainer(tmp_path, max_steps=2, callbacks=[WeightSync(every_n_batches=1), recorder])
    trainer.fit(module, datamodule=tiny_data(cls=ScriptedDataModule, micro_batch_size=4))
    shared = False
    for step, batch in zip(recorder.steps, recorder.batches, strict=True):
        nodes = tree_nodes_by_hand(batch, 4)
        bound = sum(int(tree_token_count(mb)) for mb in batch.micro_batches(layout="packed_tree"))
        shared = shared or nodes < bound
        expected = (6 * 2 + 2 + 2) * n * nodes  # i = 2 policy passes, pi_ref's and the TV-after-update pass
        assert step["train/update_flops"] == pytest.approx(expected, rel=1e-6)
        assert step["train/padded_fraction"] == 0.0
    assert shared  # completions shared prefixes: the bound would have overstated the work

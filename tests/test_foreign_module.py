"""The example module of docs/foreign-module.md (examples/own_module.py; not GRPOModule: group REINFORCE of its own)
trains with all four callbacks, and each callback does its job: the engine holds the policy's weights after a sync,
pi_ref equals the policy after a swap (KL exactly 0 on the next batch), Pass@1 is logged, and the exported directory
loads. The page shows the file verbatim, which the first test checks."""

import csv
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import torch
from lit_grpo.callbacks import GSM8KPassAtK, HFExport, RefModelSwap, WeightSync
from transformers import AutoModelForCausalLM

from lit_grpo.models.loading import tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "own_module.py"
DOC = ROOT / "docs" / "foreign-module.md"


def load_example() -> ModuleType:
    """examples/own_module.py as a fresh module (it is in no package): defines the module and main() without
    running it."""
    spec = importlib.util.spec_from_file_location("own_module_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_doc_shows_the_example_file_verbatim():
    """docs/foreign-module.md's python block is the file the other tests run, character for character."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert blocks, "docs/foreign-module.md has no python code block"
    assert blocks[0] == EXAMPLE.read_text(), "docs/foreign-module.md's example differs from examples/own_module.py"


def rows_by_step(metrics_csv: Path, key: str) -> list[float]:
    """The training rows' values of ``key``, in step order (evaluation rows leave it empty)."""
    with metrics_csv.open() as f:
        rows = [r for r in csv.DictReader(f) if r.get(key)]
    return [float(r[key]) for r in sorted(rows, key=lambda r: int(r["step"]))]


def test_the_example_module_trains_with_all_four_callbacks(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = load_example().main(steps=4, out=str(tmp_path / "run"))
    module = trainer.lightning_module
    assert type(module).__name__ != "GRPOModule" and trainer.global_step == 4
    by_type = {type(c): c for c in trainer.callbacks}
    sync, swap, evaluator, export = (by_type[t] for t in (WeightSync, RefModelSwap, GSM8KPassAtK, HFExport))
    policy = dict(module.policy.named_parameters())

    # WeightSync (every 2 batches): synced after batches 2 and 4, the engine holds the policy's final weights
    engine = trainer.datamodule.rollout_engine
    assert sync.num_syncs == 2 and engine.synced_step == 4
    assert all(torch.equal(p, policy[n]) for n, p in engine.model.named_parameters())
    metrics = next((tmp_path / "run").rglob("metrics.csv"))
    assert rows_by_step(metrics, "sync/count") == [0.0, 1.0, 1.0, 2.0]

    # RefModelSwap (every 2 batches): two swaps, pi_ref = the policy after the last; KL is 0 on the batch after each
    # swap (and on the first, pi_ref being the initial policy) and not on the others, so the policy did move
    assert swap.swaps == 2 and swap.stages_done == 2
    assert all(torch.equal(p, policy[n]) for n, p in module.reference.named_parameters())
    assert rows_by_step(metrics, "ref/swaps") == [0.0, 1.0, 1.0, 2.0]
    kl = rows_by_step(metrics, "train/kl")
    assert kl[0] == 0.0 and kl[2] == 0.0 and kl[1] > 0 and kl[3] > 0

    # GSM8KPassAtK: Pass@1 after batches 2 and 4, logged
    assert [h["step"] for h in evaluator.history] == [2.0, 4.0]
    assert "eval/pass@1" in trainer.callback_metrics
    assert len(rows_by_step(metrics, "eval/pass@1")) == 2

    # HFExport: a directory from_pretrained loads, holding the trained policy
    loaded = AutoModelForCausalLM.from_pretrained(export.dirpath)
    assert all(torch.equal(p, policy[n]) for n, p in loaded.named_parameters())
    assert (export.dirpath / "tokenizer_config.json").exists()


def test_the_example_with_a_tokenizer_without_pad_token(tmp_path, monkeypatch):
    """GPT-2 and Llama 3 tokenizers have no pad token: the data module, the engine, Pass@k and the export pad with the
    eos token instead, and the tokenizer is left as it was."""
    monkeypatch.chdir(tmp_path)
    example = load_example()
    tokenizers = []

    def padless_tokenizer():
        tokenizer = tiny_tokenizer()
        tokenizer.pad_token = None
        tokenizers.append(tokenizer)
        return tokenizer

    monkeypatch.setattr(example, "tiny_tokenizer", padless_tokenizer)  # the name the example's module calls
    trainer = example.main(steps=2, out=str(tmp_path / "run"))
    assert trainer.global_step == 2 and len(tokenizers) == 1 and tokenizers[0].pad_token is None
    evaluator = next(c for c in trainer.callbacks if isinstance(c, GSM8KPassAtK))
    assert [h["step"] for h in evaluator.history] == [2.0]
    export = next(c for c in trainer.callbacks if isinstance(c, HFExport))
    assert AutoModelForCausalLM.from_pretrained(export.dirpath).config.vocab_size == len(tokenizers[0])

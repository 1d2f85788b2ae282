"""The README's example module (not GRPOModule: group REINFORCE of its own) trains with all four callbacks, and each
callback does its job: the engine holds the policy's weights after a sync, pi_ref equals the policy after a swap
(KL exactly 0 on the next batch), Pass@1 is logged, and the exported directory loads."""

import csv
import re
from pathlib import Path

import torch
from lit_grpo.callbacks import GSM8KPassAtK, HFExport, RefModelSwap, WeightSync
from transformers import AutoModelForCausalLM

from lit_grpo.models.loading import tiny_tokenizer

README = Path(__file__).resolve().parents[1] / "README.md"
HEADING = "## Use the callbacks in your own LightningModule"


def readme_example() -> str:
    """The first python code block under the README's heading for foreign modules."""
    text = README.read_text()
    assert HEADING in text, f"README.md has no section {HEADING!r}"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, f"README.md's section {HEADING!r} has no python code block"
    return blocks[0]


def rows_by_step(metrics_csv: Path, key: str) -> list[float]:
    """The training rows' values of ``key``, in step order (evaluation rows leave it empty)."""
    with metrics_csv.open() as f:
        rows = [r for r in csv.DictReader(f) if r.get(key)]
    return [float(r[key]) for r in sorted(rows, key=lambda r: int(r["step"]))]


def test_readme_example_module_trains_with_all_four_callbacks(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme_example"}  # defines the module and main() without running it
    exec(compile(readme_example(), "<README example>", "exec"), namespace)
    trainer = namespace["main"](steps=4, out=str(tmp_path / "run"))
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


def test_readme_example_with_a_tokenizer_without_pad_token(tmp_path, monkeypatch):
    """GPT-2 and Llama 3 tokenizers have no pad token: the data module, the engine, Pass@k and the export pad with the
    eos token instead, and the tokenizer is left as it was."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(readme_example(), "<README example>", "exec"), namespace)
    tokenizers = []

    def padless_tokenizer():
        tokenizer = tiny_tokenizer()
        tokenizer.pad_token = None
        tokenizers.append(tokenizer)
        return tokenizer

    namespace["tiny_tokenizer"] = padless_tokenizer  # the name the example's module calls
    trainer = namespace["main"](steps=2, out=str(tmp_path / "run"))
    assert trainer.global_step == 2 and len(tokenizers) == 1 and tokenizers[0].pad_token is None
    evaluator = next(c for c in trainer.callbacks if isinstance(c, GSM8KPassAtK))
    assert [h["step"] for h in evaluator.history] == [2.0]
    export = next(c for c in trainer.callbacks if isinstance(c, HFExport))
    assert AutoModelForCausalLM.from_pretrained(export.dirpath).config.vocab_size == len(tokenizers[0])

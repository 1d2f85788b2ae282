"""The TRL side of ``benchmarks/tool_demo_packing.py`` trains in float32, as the fits of the tool demo do
(``configs/demo_tools_cpu.yaml``: ``32-true``): TRL's ``GRPOConfig`` would turn bf16 on if the benchmark left it
unset, and accelerate then autocasts every TRL forward on a CPU."""

from __future__ import annotations

import pytest
import yaml

pytest.importorskip("trl")

from benchmarks.tool_demo_packing import GROUP, REPO_ROOT, trl_config  # noqa: E402


def test_the_benchmarks_trl_side_runs_in_the_fits_precision(tmp_path):
    from datasets import Dataset
    from trl import GRPOTrainer

    from lit_grpo.models.loading import load_model_and_tokenizer

    fits = yaml.safe_load((REPO_ROOT / "configs" / "demo_tools_cpu.yaml").read_text())["trainer"]["precision"]
    assert fits == "32-true"
    args = trl_config(str(tmp_path), rows=GROUP, steps=1)
    assert (args.bf16, args.fp16) == (False, False)
    model, tokenizer = load_model_and_tokenizer("tiny-random-llama", "float32")
    model.save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    model.config._name_or_path = str(tmp_path / "policy")
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_list([{"prompt": "?"}]), processing_class=tokenizer)
    assert trainer.accelerator.mixed_precision == "no"

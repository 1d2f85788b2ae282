"""The long-context benchmark compares ours with TRL in equal settings: ours takes TRL's default AdamW kernel."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_trls_default_adamw_is_the_fused_kernel_the_benchmark_gives_ours(tmp_path):
    pytest.importorskip("trl")
    from trl import GRPOConfig

    config = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, fp16=False, report_to="none")
    # `--ours-adamw fused` (long_context.py's default) mirrors this; a TRL that changes it breaks the equality
    assert str(getattr(config.optim, "value", config.optim)) == "adamw_torch_fused"


@pytest.mark.parametrize("kernel,fused", [("fused", "true"), ("loop", "false")])
def test_the_cells_command_line_sets_ours_adamw_kernel(kernel, fused):
    sys.path.insert(0, str(ROOT))
    from benchmarks.long_context import cell_argv

    args = argparse.Namespace(prompts=1, generations=4, steps=1, threads=1, tokens=4096, trl_micro_batch_size=1,
                              mmap_threshold_kb="glibc", ours_adamw=kernel, ours_args=["model.beta=0.1"])
    argv = cell_argv(args, "smollm2", 64, ["ours-tree"], ["model.gradient_checkpointing=selective"], Path("out"))
    overrides = argv[argv.index("--ours-args") + 1:argv.index("--models")]
    assert overrides == ["data.micro_batch_tokens=4096", f"model.optimizer.fused={fused}", "model.beta=0.1",
                         "model.gradient_checkpointing=selective"]

"""The committed results stay light and reproducible: every sweep's raw curves are one gzip'd compact JSON file
(``curves.json.gz``, read and written by ``experiments/curves_file.py``), no committed JSON file is large, every
stored summary is what its runs give, and what the README's commands write into the working directory is ignored by
git while the committed results are not."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import corrections_study as study  # noqa: E402
import fig2_miniature as fig2  # noqa: E402
from curves_file import CURVES_FILE, read_curves, write_curves  # noqa: E402
from miniature_stats import summary  # noqa: E402

RESULTS = ROOT / "experiments" / "results"
#: the sweeps whose raw curves are committed: folder -> how its summary is computed from its runs
SWEEPS = {
    "corrections_study": lambda runs: study.summarise([study.deduplicated(r) for r in runs]),
    "fig2_miniature": lambda runs: summary(runs, list(fig2.SUITES["rec"].rows)),
    "fig2_paper": lambda runs: summary(runs, list(fig2.SUITES["paper"].rows)),
}
#: a committed JSON file above this many bytes is raw curves that belong compressed
LARGEST_JSON = 200_000


def committed(*folders: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", "--", *folders], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in out.decode().split("\0") if name]


def test_the_curves_file_is_compact_gzip_json_with_the_same_bytes_for_the_same_data(tmp_path):
    data = {"summary": {"a": {"pass@1_end": 0.75}}, "runs": [{"row": "a", "series": {"pass@1": [[0, 0.2], [20, 0.1]]}}]}
    first, second = tmp_path / "one" / CURVES_FILE, tmp_path / CURVES_FILE
    first.parent.mkdir()
    write_curves(first, data)
    write_curves(second, data)
    assert read_curves(first) == data
    text = gzip.decompress(first.read_bytes()).decode()
    assert text == json.dumps(data, separators=(",", ":"))  # compact: no indent, no spaces
    assert first.read_bytes() == second.read_bytes()  # no time stamp nor file name in the gzip header


@pytest.mark.parametrize("sweep", sorted(SWEEPS))
def test_each_sweeps_curves_are_committed_compressed_and_its_summary_is_what_its_runs_give(sweep):
    folder = RESULTS / sweep
    assert folder / CURVES_FILE in committed(str(folder.relative_to(ROOT)))
    assert not (folder / "curves.json").exists()
    saved = read_curves(folder / CURVES_FILE)
    again = SWEEPS[sweep](saved["runs"])
    # every value the file stored is recomputed from its runs (an older file may store fewer keys than today's)
    assert list(again) == list(saved["summary"])
    for key, stored in saved["summary"].items():
        assert {k: again[key][k] for k in stored} == stored, key


def test_no_committed_result_is_large_raw_json():
    large = sorted(str(p.relative_to(ROOT)) for p in committed("experiments", "benchmarks")
                   if p.suffix == ".json" and p.is_file() and p.stat().st_size > LARGEST_JSON)
    assert large == [], f"compress these with experiments/curves_file.py: {large}"


def ignored(path: str) -> bool:
    """Whether .gitignore's rules ignore ``path``, tracked or not."""
    return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT).returncode == 0


@pytest.mark.parametrize("path", ["pass_at_k.json", "out/demo_policy/model.safetensors", "demo.png", "demo.yaml",
                                  "preds.jsonl", "runs/demo_cpu/tensorboard"])
def test_what_the_readmes_commands_write_is_ignored(path):
    assert ignored(path)


@pytest.mark.parametrize("path", ["experiments/results/corrections_study/curves.json.gz",
                                  "experiments/results/demo_cpu.png", "experiments/results/demo_cpu_seeds.json",
                                  "experiments/results/demo_tools/seeds.json", "configs/demo_cpu.yaml", "docs/cli.md",
                                  "lit_grpo/data/assets/gsm8k_test.jsonl.gz"])
def test_committed_results_and_sources_are_not_ignored(path):
    assert not ignored(path)

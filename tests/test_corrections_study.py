"""The corrections study's pure parts: its grid, its refusals, the per-cell summary and the table (no fits)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import corrections_study as study  # noqa: E402


def run(setting: str, row: str, seed: int, passes: list[float], masked: float = 0.0) -> dict:
    steps = [0, 20, 40][: len(passes)]
    return {"setting": setting, "row": row, "seed": seed, "wall_s": 60.0,
            "series": {"pass@1": list(zip(steps, passes)), "masked": [(1, masked), (2, 3 * masked)],
                       "tv_pi_alpha": [(1, 0.01)]},
            "wall_clock": [(s, 10.0 * i) for i, s in enumerate(steps)]}


def test_the_grid_leaves_out_the_cells_that_cannot_differ_and_names_why():
    args = study.parse_args([])
    cells = study.cells(args)
    assert ("on-policy", "maxtv") not in cells and ("bf16", "exact") not in cells
    assert all((s, r) in cells for s in ("v8", "severe") for r in study.ROWS)  # every row where staleness grows
    assert len(cells) == len(set(cells))
    # every row's overrides name real module options: the corrections' old_policy as the module spells it
    assert study.ROWS["tis"][-1] == "proximal" and study.ROWS["opsm"][-1] == "decoupled"


@pytest.mark.parametrize("argv, message", [
    (["--settings", "v9"], "unknown"), (["--rows", "tis", "clip"], "unknown"), (["--steps", "0"], ">= 1"),
    (["--seeds", "0", "0"], "each seed once"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        study.parse_args(argv)
    assert message in capsys.readouterr().err


def test_summary_and_table_per_cell():
    results = [run("v8", "none", 0, [0.2, 0.5, 0.7]), run("v8", "none", 1, [0.2, 0.6, 0.5]),
               run("v8", "tis", 0, [0.2, 0.1, 0.1], masked=0.1)]
    stats = study.summarise(results)
    cell = stats["v8"]["none"]
    assert cell["seeds"] == 2 and cell["pass@1_end"] == pytest.approx(0.6)
    assert cell["pass@1_end_std"] == pytest.approx(statistics.pstdev([0.7, 0.5]))
    assert cell["pass@1_end_min"] == 0.5 and cell["pass@1_best"] == pytest.approx(0.65)
    assert stats["v8"]["tis"]["masked"] == pytest.approx(0.2)  # the run's mean over its steps
    text = study.table(stats, ["on-policy", "v8"], ["none", "tis", "maxtv"])
    assert "| none | - | 0.60 ± 0.10 [0.50] |" in text
    assert "n/a (v = 1 already syncs every step)" in text


def test_plot_only_redraws_from_the_compressed_curves_and_writes_them_back(tmp_path, monkeypatch, capsys):
    committed = study.OUT / "curves.json.gz"
    (tmp_path / "curves.json.gz").write_bytes(committed.read_bytes())
    drawn = []
    monkeypatch.setattr(study, "plot", lambda results, path, settings, rows: drawn.append((len(results), path)))
    study.main(["--plot-only", "--out", str(tmp_path)])
    assert drawn == [(87, tmp_path / "corrections_study.png")]  # 29 cells x 3 seeds
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.json.gz"]  # no plain curves.json beside it
    assert (tmp_path / "curves.json.gz").read_bytes() == committed.read_bytes()  # the same results, the same bytes
    assert "| none |" in capsys.readouterr().out

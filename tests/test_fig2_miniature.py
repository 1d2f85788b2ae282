"""The miniature Fig. 2 script's pure parts (seed statistics, the table, the suites' overrides and checks), its
rollout server's weight check, and the warm-start cache key."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import fig2_miniature as fig2  # noqa: E402
from miniature_stats import mean_std, seconds_since_first, summary, table_row, wall_clock_curve  # noqa: E402

from lit_grpo.training import warm_start  # noqa: E402
from lit_grpo.training.warm_start import WarmStartConfig, cache_key, training_data_digest, weights_fingerprint  # noqa: E402


def run(row: str, seed: int, passes: list[tuple[int, float]], seconds: list[tuple[int, float]] | None,
        wall_s: float = 100.0, syncs: float = 0.0) -> dict:
    out = {"row": row, "seed": seed, "wall_s": wall_s,
           "series": {"pass@1": passes, "sync_by_tv": [(0, 0.0), (10, syncs)] if syncs else []}}
    if seconds is not None:
        out["wall_clock"] = seconds
    return out


RUNS = [
    run("a", 0, [(0, 0.2), (10, 0.5), (20, 0.9)], [(0, 0.0), (10, 30.0), (20, 70.0)], wall_s=90.0, syncs=2.0),
    run("a", 1, [(0, 0.2), (10, 0.7), (20, 0.6)], [(0, 0.0), (10, 50.0), (20, 90.0)], wall_s=110.0, syncs=4.0),
    # logged no step-10 point: the curves keep only the steps every seed has
    run("b", 0, [(0, 0.2), (20, 0.4)], None),
]


def test_mean_and_std_over_seeds_at_the_shared_steps() -> None:
    steps, mean, std = mean_std(RUNS[:2], "pass@1")
    assert steps == [0, 10, 20]
    assert mean == pytest.approx([0.2, 0.6, 0.75])
    assert std == pytest.approx([0.0, 0.1, 0.15])  # population std: |0.5 - 0.7| / 2, |0.9 - 0.6| / 2
    assert mean_std([RUNS[0], RUNS[2]], "pass@1")[0] == [0, 20]


def test_wall_clock_curve_averages_seconds_and_pass_at_each_step() -> None:
    x, mean, std = wall_clock_curve(RUNS)  # run b has no times: left out
    assert x == pytest.approx([0.0, 40.0, 80.0])
    assert mean == pytest.approx([0.2, 0.6, 0.75]) and std == pytest.approx([0.0, 0.1, 0.15])
    assert wall_clock_curve([RUNS[2]]) == ([], [], [])


def test_seconds_since_first_is_relative_to_the_earliest_event_in_step_order() -> None:
    assert seconds_since_first([(20, 1010.5), (0, 1000.0), (10, 1004.0)]) == [(0, 0.0), (10, 4.0), (20, 10.5)]
    assert seconds_since_first([]) == []


def test_summary_and_table_row_report_mean_std_and_worst_seed() -> None:
    stats = summary(RUNS, ["b", "a", "missing"])
    assert list(stats) == ["b", "a"]
    a = stats["a"]
    assert a["seeds"] == 2 and a["pass@1_start"] == pytest.approx(0.2)
    assert a["pass@1_end"] == pytest.approx(0.75) and a["pass@1_end_std"] == pytest.approx(0.15)
    assert a["pass@1_end_min"] == pytest.approx(0.6) and a["pass@1_best"] == pytest.approx((0.9 + 0.7) / 2)
    assert a["syncs_by_tv"] == pytest.approx(3.0)
    assert a["train_s"] == pytest.approx(80.0) and a["train_s_std"] == pytest.approx(10.0)
    assert a["wall_s"] == pytest.approx(100.0) and a["wall_s_std"] == pytest.approx(statistics.pstdev([90, 110]))
    assert table_row("a", a) == "| a | 2 | 0.200 | 0.750 ± 0.150 | 0.600 | 0.800 | 80 ± 10 |"
    assert table_row("b", stats["b"]).endswith("| 0.400 | 0.400 | - |")


def cell(end: float, std: float, worst: float, seconds: float | None) -> dict:
    return {"pass@1_end": end, "pass@1_end_std": std, "pass@1_end_min": worst, "train_s": seconds,
            "train_s_std": None if seconds is None else 2.4}


def test_the_docs_tables_round_to_two_decimals_and_bold_by_their_rules() -> None:
    """The paper table bolds the highest Pass@1 and the fewest seconds among rows at i = 1: v1-i10, faster on the
    clock because it samples a tenth of the batches, is not bolded; the rec table pads its shorter side."""
    paper = {"v1-i1": cell(0.899, 0.0149, 0.8249, 83.0), "v1-i10": cell(0.79, 0.02, 0.75, 36.0),
             "v1-i1-k1": cell(0.894, 0.01, 0.88, 68.4), "v10-i1-k1": cell(0.82, 0.02, 0.79, None)}
    assert fig2.paper_doc_table(paper).splitlines()[2:] == [
        "| v1-i1 (on-policy) | **0.90 +- 0.01** | 0.82 | 83 +- 2 |",
        "| v1-i10 (sample reuse) | 0.79 +- 0.02 | 0.75 | 36 +- 2 |",
        "| v1-i1, asynchronous K = 1 | 0.89 +- 0.01 | 0.88 | **68 +- 2** |",
        "| v10-i1, asynchronous K = 1 | 0.82 +- 0.02 | 0.79 | - |"]
    rec = {"v1-i1": cell(0.9, 0.01, 0.89, 80.0), "rec_ring-v10": cell(0.85, 0.02, 0.83, 82.0),
           "red_drop-v10": cell(0.1, 0.13, 0.0, 85.0)}
    assert fig2.rec_doc_table(rec).splitlines()[2:] == [
        "| v1-i1 (on-policy) | 0.90 +- 0.01 | | rec_ring | 0.85 +- 0.02 |", "| | | | red_drop | 0.10 +- 0.13 |"]


def test_swap_every_makes_s_plus_one_stages() -> None:
    assert fig2.swap_every(100, 3) == 25
    assert fig2.swap_every(8, 3) == 2
    assert fig2.swap_every(100, 0) == 100
    with pytest.raises(ValueError, match="at least 4 steps"):
        fig2.swap_every(3, 3)
    with pytest.raises(ValueError, match="--swaps must be >= 0, got -1"):
        fig2.swap_every(10, -1)


def test_paper_suite_overrides() -> None:
    args = fig2.parse_args(["--suite", "paper"])
    assert args.seeds == [0, 1, 2, 3, 4] and args.jobs == 1 and args.beta == 0.1 and args.swaps == 3
    assert args.rows == ["v1-i1", "v1-i1-eq8", "v10-i1", "v1-i10", "v10-i1-maxtv", "v1-i1-k1", "v10-i1-k1"]
    suite = fig2.SUITES["paper"]
    got = fig2.overrides(suite, "v10-i1-k1", args, "arith-tiny-sft")
    assert got == ["--sync.every_n_batches", "10", "--model.beta", "0.1", "--ref_swap.every_n_optimizer_steps",
                   "25", "--ref_swap.max_swaps", "3", "--data.max_staleness", "1"]
    assert "--data.max_staleness" not in fig2.overrides(suite, "v10-i1", args, "arith-tiny-sft")
    assert fig2.overrides(suite, "v1-i1-eq8", args, "arith-tiny-sft")[:2] == ["--model.mask_zero_variance", "true"]
    assert all(fig2.uses_server(suite, row, args) for row in suite.rows)
    in_process = fig2.parse_args(["--suite", "paper", "--sync-engine", "in_process"])
    assert [r for r in suite.rows if fig2.uses_server(suite, r, in_process)] == ["v1-i1-k1", "v10-i1-k1"]
    hard = fig2.parse_args(["--suite", "paper", "--task", "add_3digit", "--beta", "0.05", "--swaps", "1"])
    got = fig2.overrides(suite, "v1-i1", hard, "/cache/arith-tiny-sft-abc")
    assert got == ["--model.beta", "0.05", "--ref_swap.every_n_optimizer_steps", "50", "--ref_swap.max_swaps", "1",
                   "--model.model_name", "/cache/arith-tiny-sft-abc", "--data.dataset", "synthetic:add_3digit",
                   "--eval.dataset", "synthetic:add_3digit", "--data.max_new_tokens", "48"]


def test_rec_suite_keeps_its_settings() -> None:
    args = fig2.parse_args([])
    assert args.seeds == [0, 1, 2] and args.beta == 0.0 and args.swaps == 0 and len(args.rows) == 13
    suite = fig2.SUITES["rec"]
    # the row was run with the renormalised form, now named drop_zero_variance
    assert fig2.overrides(suite, "v1-i1-mask", args, "arith-tiny-sft") == ["--model.drop_zero_variance", "true"]
    assert fig2.overrides(suite, "rec_ring-v10", args, "arith-tiny-sft") == [
        "--model.loss", "rec_ring", "--sync.every_n_batches", "10"]
    assert not any(fig2.uses_server(suite, row, args) for row in suite.rows)


@pytest.mark.parametrize(("argv", "message"), [
    (["--suite", "paper", "--rows", "v1-i1", "rec_ring-v10"], "unknown row(s) ['rec_ring-v10'] for --suite paper"),
    (["--beta", "0.1"], "--beta 0.1: the rec suite runs at beta = 0"),
    (["--task", "add_3digit"], "--task add_3digit: the rec suite runs on add_2digit"),
    (["--suite", "paper", "--beta", "0"], "--swaps 3 needs --beta > 0"),
    (["--suite", "paper", "--steps", "3"], "--steps 3 cannot hold 3 reference swaps"),
    (["--suite", "paper", "--eval-questions", "0"], "--eval-questions must be >= 1, got 0"),
    (["--suite", "paper", "--seeds", "0", "0"], "--seeds [0, 0]: each seed once"),
    (["--warm-start-label-smoothing", "0.05"], "--warm-start-label-smoothing: the rec suite starts from"),
    (["--suite", "paper", "--warm-start-label-smoothing", "1"], "must lie in [0, 1), got 1.0"),
])
def test_bad_arguments_are_one_line_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        fig2.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_server_check_refuses_weights_other_than_the_trainers(tmp_path: Path) -> None:
    from miniature_server import MiniatureServer, parameter_checksums

    baseline = parameter_checksums("tiny-random-llama")
    name = next(iter(baseline))
    wrong = dict(baseline, **{name: "0" * 64})
    server = MiniatureServer("tiny-random-llama", tmp_path / "wrong", wrong)
    with pytest.raises(RuntimeError, match=f"differ from the trainer's in \\['{name}'\\]"):
        server.__enter__()
    assert server.proc.poll() is not None  # stopped on the failed check
    with MiniatureServer("tiny-random-llama", tmp_path / "right", baseline) as server:
        assert server.url.startswith("http://127.0.0.1:")
    assert server.proc.poll() is not None


ENV = {"torch": "2.13.0", "transformers": "5.23.0", "cpu_capability": "AVX512"}


def test_cache_key_covers_config_environment_and_data() -> None:
    config = WarmStartConfig()
    key = cache_key(config, ENV, "d" * 64)
    assert key == cache_key(WarmStartConfig(), dict(ENV), "d" * 64) and len(key) == 12
    others = [cache_key(WarmStartConfig(seed=1), ENV, "d" * 64), cache_key(WarmStartConfig(lr=2e-2), ENV, "d" * 64),
              cache_key(WarmStartConfig(steps=801), ENV, "d" * 64),
              cache_key(WarmStartConfig(data_seed=1), ENV, "d" * 64),
              cache_key(config, dict(ENV, torch="2.12.0"), "d" * 64),
              cache_key(config, dict(ENV, transformers="5.22.0"), "d" * 64),
              cache_key(config, dict(ENV, cpu_capability="AVX2"), "d" * 64),
              cache_key(config, ENV, "e" * 64)]
    assert len({key, *others}) == len(others) + 1


def test_training_data_digest_sees_the_data_and_its_format(monkeypatch: pytest.MonkeyPatch) -> None:
    config = WarmStartConfig()
    digest = training_data_digest(config)
    assert digest == training_data_digest(WarmStartConfig(lr=0.5))  # training settings are not data
    assert digest != training_data_digest(WarmStartConfig(data_seed=1))
    assert digest != training_data_digest(WarmStartConfig(task="add_3digit"))
    original = warm_start.worked_answer
    monkeypatch.setattr(warm_start, "worked_answer", lambda columns: original(columns).replace("####", "Answer:"))
    assert training_data_digest(config) != digest  # a new answer format is new training data
    monkeypatch.undo()
    original_template = warm_start.tiny_tokenizer

    def other_template():  # noqa: ANN202
        tokenizer = original_template()
        tokenizer.chat_template = tokenizer.chat_template.replace("im_start", "start")
        return tokenizer

    monkeypatch.setattr(warm_start, "tiny_tokenizer", other_template)
    assert training_data_digest(config) != digest


def test_weights_fingerprint_is_bit_exact() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    clone = torch.nn.Linear(3, 2)
    clone.load_state_dict(model.state_dict())
    assert weights_fingerprint(model) == weights_fingerprint(clone)
    with torch.no_grad():
        clone.weight[0, 0] = torch.nextafter(clone.weight[0, 0], torch.tensor(1.0))  # one ulp
    assert weights_fingerprint(model) != weights_fingerprint(clone)


@pytest.mark.parametrize(("suite", "folder", "figure", "runs"), [
    ("rec", "fig2_miniature", "plot_rec", 39), ("paper", "fig2_paper", "plot_paper", 35)])
def test_plot_only_redraws_from_the_compressed_curves(suite, folder, figure, runs, tmp_path, monkeypatch) -> None:
    from curves_file import read_curves

    committed = fig2.RESULTS / folder / "curves.json.gz"
    (tmp_path / "curves.json.gz").write_bytes(committed.read_bytes())
    drawn = []
    monkeypatch.setattr(fig2, figure, lambda results, path, *rest: drawn.append((len(results), path.name)))
    fig2.main(["--suite", suite, "--plot-only", "--out", str(tmp_path)])
    assert drawn == [(runs, f"{folder}.png")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.json.gz"]
    assert read_curves(tmp_path / "curves.json.gz")["runs"] == read_curves(committed)["runs"]

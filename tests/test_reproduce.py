"""The committed results reproduce: ``experiments/reproduce.py`` re-runs a committed cell and compares it with the
committed numbers. The comparison's parts are checked by hand, and one real cell (the demo's seed 0, its first 50
steps: about a minute on one core) runs here through the same code, so a change that moves the demo's numbers, or a
committed number edited by hand, fails. Each result also has an AVX2 reference cell (``experiments/avx2_reference.py``)
that any x86-64 CPU with AVX2 replays: every result has one that stands beside its committed points, a machine that
cannot run a cell says why in its own words, and one reference cell runs here on any such CPU."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import avx2_reference as reference  # noqa: E402
import reproduce  # noqa: E402


@pytest.fixture
def recorded_transformers(monkeypatch) -> str:
    """transformers' version as the committed results were recorded with it, for the tests of how a result is
    judged (cache keys hash the version): they hold whichever release is installed. Whether this environment
    replays a result is the slow tests' question, which skip, naming the versions, where it cannot."""
    import transformers

    recorded = reference.load("fig2_miniature")["transformers"]
    monkeypatch.setattr(transformers, "__version__", recorded)
    return recorded


def test_the_prefix_keeps_what_a_shorter_run_logs_and_its_evaluations_at_the_last_step():
    series = {"reward": {0: 0.1, 1: 0.2, 2: 0.3, 3: 0.4}, "pass@1": {0: 0.2, 2: 0.5, 4: 0.7}}
    assert reproduce.prefix_points(series, 2, ("pass@1",)) == {"reward": {0: 0.1, 1: 0.2},
                                                               "pass@1": {0: 0.2, 2: 0.5}}
    with pytest.raises(ValueError, match="steps must be >= 1"):
        reproduce.prefix_points(series, 0, ())


def test_the_largest_difference_and_where_it_is():
    expected = {"a": {0: 1.0, 1: 2.0}, "b": {5: 0.5}}
    assert reproduce.max_abs_difference(expected, {"a": {0: 1.0, 1: 2.0}, "b": {5: 0.5}}) == (0.0, "a@0")
    diff, where = reproduce.max_abs_difference(expected, {"a": {0: 1.0, 1: 2.25}, "b": {5: 0.4}})
    assert (round(diff, 12), where) == (0.25, "a@1")
    # a committed point the run does not log is a difference, not a skip
    assert reproduce.max_abs_difference(expected, {"a": {0: 1.0, 1: 2.0}}) == (math.inf, "b@5")
    assert reproduce.max_abs_difference({"a": {0: math.nan}}, {"a": {0: math.nan}}) == (0.0, "a@0")
    assert reproduce.max_abs_difference({"a": {0: math.nan}}, {"a": {0: 1.0}})[0] == math.inf
    with pytest.raises(ValueError, match="no committed point"):
        reproduce.max_abs_difference({"a": {}}, {"a": {0: 1.0}})


def test_the_first_difference_is_the_earliest_step_off_by_more_than_the_tolerance():
    expected = {"pass@1": {0: 0.2, 20: 0.5}, "reward": {0: 0.1, 1: 0.2, 2: 0.3}}
    assert reproduce.first_difference(expected, {"pass@1": {0: 0.2, 20: 0.5}, "reward": {0: 0.1, 1: 0.2, 2: 0.3}}) \
        is None
    assert reproduce.first_difference(expected, {"pass@1": {0: 0.2, 20: 0.9},
                                                 "reward": {0: 0.1, 1: 0.2 + 1e-7, 2: 0.4}}) == "reward@2"
    assert reproduce.first_difference(expected, {"pass@1": {20: 0.5}, "reward": {0: 0.1, 1: 0.2, 2: 0.3}}) \
        == "pass@1@0"


def test_the_verdict_fails_a_difference_only_where_the_result_is_not_listed_stale():
    assert reproduce.verdict(5e-7, "a@0", None) == ("match (max abs difference 5.0e-07 at a@0)", False)
    line, fails = reproduce.verdict(0.0625, "reward@12", None)
    assert (line, fails) == ("differs (max abs difference 0.0625 at reward@12)", True)
    line, fails = reproduce.verdict(0.0625, "reward@12", "made before X")
    assert (line, fails) == ("stale (made before X; differs by 0.0625 at reward@12)", False)
    line, fails = reproduce.verdict(0.0, "a@0", "made before X")
    assert not fails and "remove it from STALE" in line


def test_every_committed_result_has_a_cell_whose_prefix_compares_points(tmp_path):
    for name, make in reproduce.CELLS.items():
        cell = make()
        compared = reproduce.prefix_points(cell.expected, cell.steps, cell.evaluations)
        assert sum(len(p) for p in compared.values()) > cell.steps, name  # every step's reward at least
        assert all(any(s == cell.steps for s in compared[e]) for e in cell.evaluations if e in compared), name
        assert set(cell.tags) == set(cell.expected), name


def test_a_demo_seeds_file_of_another_layout_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "seeds.json"
    bad.write_text(json.dumps({"0": {"eval/pass@1": {"0": 0.2}}}))
    with pytest.raises(ValueError, match="no 'seeds' record"):
        reproduce.demo_cell(path=bad)
    with pytest.raises(ValueError, match="has no seed 7"):
        reproduce.demo_cell(seed=7)


@pytest.mark.usefixtures("recorded_transformers")
def test_a_result_made_on_avx512_is_skipped_on_an_avx2_cpu_in_words_that_name_both_instruction_sets(monkeypatch):
    cell = reproduce.demo_cell()
    assert reproduce.key_capability(cell.warm_start_key) == "AVX512"  # the committed demo was made on AVX-512
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert reproduce.native_blocker(cell, "AVX512", "x86_64") is None
    assert reproduce.native_blocker(cell, "AVX2", "x86_64") == (
        "made under AVX512; torch here dispatches to AVX2 at most (this CPU's widest instruction set)")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert reproduce.native_blocker(cell, "AVX2", "x86_64").endswith("(ATEN_CPU_CAPABILITY=avx2 here)")
    assert reproduce.native_blocker(cell, "DEFAULT", "aarch64") == (
        "made on an x86-64 CPU under AVX512; this CPU is aarch64")
    # a key no instruction set gives here: the versions are named, not guessed at
    import torch
    import transformers

    other = reproduce.native_blocker(dataclasses.replace(cell, warm_start_key="0123456789ab"), "AVX512", "x86_64")
    assert "0123456789ab" in other and torch.__version__ in other and transformers.__version__ in other


@pytest.mark.usefixtures("recorded_transformers")
def test_the_committed_line_of_an_avx2_machine_is_skipped_without_running_anything(monkeypatch, tmp_path):
    monkeypatch.setattr(reproduce, "native_capability", lambda: "AVX2")
    monkeypatch.setattr(reproduce, "run_cell", lambda *args, **kwargs: pytest.fail("nothing may run"))
    line, fails = reproduce.check("demo_cpu_seeds", tmp_path)
    assert line.startswith("skipped (made under AVX512; torch here dispatches to AVX2 at most") and not fails


@pytest.mark.usefixtures("recorded_transformers")
def test_every_committed_result_has_an_avx2_reference_that_stands_beside_its_committed_points():
    """Each result's reference was recorded from its committed cell as it is now (the digest of the compared
    points), under the replay environment, with every point the committed cell compares, from the result's own warm
    start, committed beside it (its weights are the ones the result records) and filed under the AVX2 cache key
    this code gives it."""
    fingerprints = {}
    for name, make in reproduce.CELLS.items():
        record = reference.load(name)
        assert record is not None, f"{name} has no AVX2 reference; record it with --record-avx2-reference {name}"
        cell = make()
        committed = reproduce.prefix_points(cell.expected, cell.steps, cell.evaluations)
        assert record["result_digest"] == reference.points_digest(committed), f"{name}: re-record its reference"
        assert record["steps"] == cell.steps and record["environment"]["ATEN_CPU_CAPABILITY"] == "avx2", name
        assert {k: set(v) for k, v in reference.series_of(record).items()} == \
            {k: set(v) for k, v in committed.items()}, name
        warm = record["warm_start"]
        weights = reference.REFERENCE / warm["folder"] / "model.safetensors"
        assert weights.is_file(), f"{name}: its warm start is not beside it"
        ignored = subprocess.run(["git", "check-ignore", "-q", str(weights)], cwd=ROOT).returncode == 0
        assert not ignored, f"{weights} is ignored by git; the replays need it committed"
        assert (warm["cache_key"], warm["fingerprint"]) == (cell.warm_start_key, cell.warm_start_fingerprint), name
        assert warm["replay_key"] == reference.avx2_key(warm["model"]), f"{name}: the warm-start recipe changed"
        fingerprints[warm["folder"]] = warm["fingerprint"]
    from transformers import LlamaForCausalLM

    from lit_grpo.training.warm_start import weights_fingerprint

    for folder, fingerprint in fingerprints.items():
        assert weights_fingerprint(LlamaForCausalLM.from_pretrained(reference.REFERENCE / folder)) == fingerprint


def test_the_digest_of_committed_points_changes_with_any_value_and_not_with_their_order():
    points = {"reward": {0: 0.25, 1: 0.5}, "pass@1": {0: 0.2}}
    same = {"pass@1": {0: 0.2}, "reward": {1: 0.5, 0: 0.25}}
    assert reference.points_digest(points) == reference.points_digest(same)
    moved = {"pass@1": {0: 0.2}, "reward": {0: 0.25, 1: math.nextafter(0.5, 1.0)}}
    assert reference.points_digest(points) != reference.points_digest(moved)


def test_a_machine_that_cannot_replay_a_reference_says_why():
    record = reference.load("fig2_miniature")
    here = {"torch": record["torch"], "transformers": record["transformers"]}
    assert reference.replay_blocker(record, "AVX2", "x86_64", here) is None
    assert reference.replay_blocker(record, "AVX512", "x86_64", here) is None
    assert "torch here dispatches to DEFAULT at most" in reference.replay_blocker(record, "DEFAULT", "x86_64", here)
    assert reference.replay_blocker(record, "DEFAULT", "aarch64", here).endswith("this CPU is aarch64")
    assert reference.replay_blocker(record, "AVX2", "x86_64", {**here, "torch": "9.9.9"}) == (
        f"recorded with torch {record['torch']}, this environment has 9.9.9")


@pytest.mark.usefixtures("recorded_transformers")
def test_a_reference_recorded_beside_an_earlier_result_or_another_recipe_is_stale(monkeypatch, tmp_path):
    record = reference.load("fig2_miniature")
    monkeypatch.setattr(reproduce, "native_capability", lambda: "AVX2")
    monkeypatch.setattr(reference, "cpu_name", lambda: "AMD EPYC 7B13")  # the recording vendor's CPU
    monkeypatch.setattr(reproduce, "run_cell", lambda *args, **kwargs: pytest.fail("nothing may run"))
    assert reproduce.reference_blocker("fig2_miniature", record) is None
    earlier = {**record, "result_digest": "0" * 16}
    word, why = reproduce.reference_blocker("fig2_miniature", earlier)
    assert word == "stale" and "earlier version of the result" in why
    other_recipe = {**record, "warm_start": {**record["warm_start"], "replay_key": "0123456789ab"}}
    word, why = reproduce.reference_blocker("fig2_miniature", other_recipe)
    assert word == "stale" and "0123456789ab" in why and record["warm_start"]["replay_key"] in why
    monkeypatch.setattr(reference, "load", lambda name: earlier)
    line, fails = reproduce.check_reference("fig2_miniature", tmp_path)
    assert line.startswith("stale (its AVX2 reference was recorded beside an earlier") and not fails


def test_a_reference_warm_start_whose_weights_changed_is_refused(monkeypatch, tmp_path):
    record = reference.load("fig2_miniature")
    folder = tmp_path / record["warm_start"]["folder"]
    shutil.copytree(reference.REFERENCE / record["warm_start"]["folder"], folder)
    monkeypatch.setattr(reference, "REFERENCE", tmp_path)
    env, baseline = reference.prepare(record, tmp_path / "cache")
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["LIT_GRPO_CACHE"] == str(tmp_path / "cache")
    assert (tmp_path / "cache" / f"arith-tiny-sft-{record['warm_start']['replay_key']}" / "config.json").exists()
    assert "model.embed_tokens.weight" in baseline
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    name = sorted(weights)[0]
    weights[name].view(-1)[0] += 1.0
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="expected the committed weights unchanged"):
        reference.prepare(record, tmp_path / "cache2")


def test_a_reference_run_that_misses_a_committed_point_is_not_recorded():
    committed = {"reward": {0: 0.1, 1: 0.2}, "pass@1": {0: 0.2}}
    with pytest.raises(ValueError, match=r"logged no reward@1; expected every point"):
        reference.record_for("x", "x", 2, committed, {"reward": {0: 0.1}, "pass@1": {0: 0.2}}, {}, "AVX512")


@pytest.mark.slow
def test_the_demos_committed_seed_0_reproduces_over_its_first_50_steps(tmp_path):
    """The demo's seed 0 (``configs/demo_cpu.yaml``), 50 steps, through ``reproduce.run_cell``: its train reward at
    every step and its held-out Pass@1 and Pass@8 at steps 0 and 50 equal the committed ``demo_cpu_seeds.json`` to
    1e-6. Skipped, with the reason, where this machine cannot run the committed cell (an AVX2 CPU: the AVX2
    reference test below runs there)."""
    cell = reproduce.demo_cell(steps=50, seed=0)
    blocked = reproduce.native_blocker(cell, reproduce.native_capability(), cpu=reference.cpu_name())
    if blocked:
        pytest.skip(f"the committed demo cell: {blocked}")
    measured = reproduce.run_cell(cell, tmp_path / "demo", reproduce.capability_for(cell.warm_start_key))
    expected = reproduce.prefix_points(cell.expected, cell.steps, cell.evaluations)
    assert sorted(expected["eval/pass@1"]) == [0, 50] and len(expected["rollout/reward_mean"]) == 50
    difference, where = reproduce.max_abs_difference(expected, measured)
    assert difference <= reproduce.TOLERANCE, f"the demo's seed 0 differs from the committed curve at {where}"


@pytest.mark.slow
def test_the_miniatures_avx2_reference_cell_replays_on_any_x86_64_cpu(tmp_path):
    """The REC suite's v1-i1 seed 0, 20 steps, under AVX2 from the committed warm start (``avx2_reference``): its
    train reward, TV, KL and clip fractions at every step and held-out Pass@1 at steps 0 and 20 equal the committed
    reference to 1e-6, on an AVX-512 CPU as on an AVX2 one. Skipped, with the reason, only off x86-64, without
    AVX2, with another torch or transformers than the reference's, or on a CPU of a vendor whose series is not
    recorded (an AMD-recorded reference drifts on an Intel CPU: ``avx2_reference.other_vendor``; each vendor's CPUs
    compare with their own series, ``avx2_reference.for_cpu``)."""
    name = "fig2_miniature"
    record = reference.load(name)
    blocked = reproduce.reference_blocker(name, record)
    if blocked:
        assert blocked[0] == "skipped", blocked[1]  # a stale reference fails: it must be re-recorded
        pytest.skip(f"the AVX2 reference cell: {blocked[1]}")
    measured = reproduce.replay_reference(name, tmp_path, record)
    cell = reproduce.reference_cell(reproduce.CELLS[name](), record)
    expected = reproduce.prefix_points(cell.expected, cell.steps, cell.evaluations)
    assert sorted(expected["pass@1"]) == [0, 20] and len(expected["reward"]) == 20
    difference, where = reproduce.max_abs_difference(expected, measured)
    assert difference <= reproduce.TOLERANCE, f"the AVX2 reference of {name} differs at {where}"


def test_a_result_is_compared_on_the_recording_vendors_cpus_only():
    """An AMD-recorded curve drifts on an Intel CPU (measured: the demo from step 40, the AVX2 miniature from step
    13): the skip names both CPUs; the same vendor, or an unknown one, is compared."""
    line = reference.other_vendor("AMD EPYC", "Intel(R) Xeon(R) Processor")
    assert "recorded on an AMD EPYC" in line and "Intel(R) Xeon(R) Processor" in line and "AMD CPUs only" in line
    assert reference.other_vendor("AMD EPYC", "AMD EPYC 9B14") is None
    assert reference.other_vendor("AMD EPYC", "Some Other CPU") is None
    assert reference.other_vendor("AMD EPYC", None) is None
    record = {"torch": "1", "transformers": "2", "recorded_on": "AMD EPYC (AVX512 here, AVX2 dispatched)"}
    here = {"torch": "1", "transformers": "2"}
    line = reference.replay_blocker(record, "AVX2", "x86_64", here, "Intel(R) Xeon(R)")
    assert "another vendor's" in line and "--record-vendor-series" in line
    assert reference.replay_blocker(record, "AVX2", "x86_64", here, "AMD EPYC 7B13") is None
    # with the other vendor's own series recorded beside it, that vendor's CPUs compare with it
    record = {**record, "vendors": {"Intel": {"recorded_on": "Intel(R) Xeon(R) (AVX512 here, AVX2 dispatched)",
                                              "series": {"reward": {"0": 0.5}}}}}
    assert reference.replay_blocker(record, "AVX2", "x86_64", here, "Intel(R) Xeon(R)") is None


def test_each_vendor_replays_its_own_series_of_a_reference(monkeypatch):
    record = {"result": "r", "recorded_on": "AMD EPYC (AVX512 here, AVX2 dispatched)", "steps": 2,
              "series": {"reward": {"0": 0.25, "1": 0.5}, "pass@1": {"0": 0.1}}}
    assert reference.for_cpu(record, "Intel(R) Xeon(R) Processor") is record  # none recorded for Intel yet
    monkeypatch.setattr(reference, "cpu_name", lambda: "AMD EPYC 7B13")
    with pytest.raises(ValueError, match="the recording vendor's"):
        reference.with_vendor_series(record, {"reward": {0: 0.3, 1: 0.6}, "pass@1": {0: 0.2}}, "AVX512")
    monkeypatch.setattr(reference, "cpu_name", lambda: "Intel(R) Xeon(R) Processor")
    with pytest.raises(ValueError, match=r"logged no pass@1@0"):
        reference.with_vendor_series(record, {"reward": {0: 0.3, 1: 0.6}}, "AVX512")
    both = reference.with_vendor_series(record, {"reward": {0: 0.3, 1: 0.6, 2: 0.9}, "pass@1": {0: 0.2}}, "AVX512")
    assert both["series"] == record["series"]  # the recording vendor's points unchanged
    intel = reference.for_cpu(both, "Intel(R) Xeon(R) Gold")
    assert reference.series_of(intel) == {"reward": {0: 0.3, 1: 0.6}, "pass@1": {0: 0.2}}  # the record's points only
    assert intel["recorded_on"].startswith("Intel(R) Xeon(R) Processor (AVX512 here")
    assert reference.for_cpu(both, "AMD EPYC 9B14")["series"] == record["series"]


def test_every_committed_reference_holds_a_series_for_amd_and_for_intel_cpus():
    """Any x86-64 machine with AVX2 replays one cell of each committed result: each reference holds the points of
    both vendors' CPUs, the same points."""
    for name in reproduce.CELLS:
        record = reference.load(name)
        vendors = {reference.vendor_of(record["recorded_on"]), *record.get("vendors", {})}
        assert vendors == {"AMD", "Intel"}, f"{name}: series for {sorted(v for v in vendors if v)} only"
        for other in record["vendors"].values():
            assert {k: set(v) for k, v in other["series"].items()} == {k: set(v) for k, v in record["series"].items()}

"""DAPO's dynamic sampling (``data.dynamic_sampling``): zero-variance groups are dropped and refilled from seeded
draws, the round cap pads or stops, and a run resumed from its checkpoint trains on the batches of a run straight
through, at K = 0 and at K = 1 (the producer thread forms whole batches; the checkpoint keeps the one formed ahead).

The fits use the scripted engine (``tests/scripted_engine.py``): a prompt with an even token sum gets G identical
completions (a zero-variance group), any other a group with a spread, so about half the groups are dropped."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import MetricsRecorder, tiny_data, tiny_module, tiny_trainer
from lit_grpo.callbacks import WeightSync
from scripted_engine import ScriptedDataModule, ScriptedEngine

from lit_grpo.data.async_rollouts import AsyncRollouts
from lit_grpo.data.dynamic_sampling import (
    DynamicSampling,
    DynamicSamplingError,
    Scored,
    draw_rows,
    form_batch,
    sampling_seed,
)
from lit_grpo.data.rollout import rollout_seed
from lit_grpo.engines.base import Completion, RemoteEngine, Rollouts

G = 2


# ---- form_batch on its own: rows with an odd number have a reward spread ---------------------------------------
def fake_sample(calls: list):
    def sample(rows, seed):
        calls.append((list(rows), seed))
        return Rollouts([[Completion([row], [0.0], False) for _ in range(G)] for row in rows])
    return sample


def fake_score(rows, groups) -> Scored:
    rewards = [float(j) if row % 2 else 1.0 for row in rows for j in range(G)]
    return Scored(rewards, errors=1, timeouts=0)


def test_zero_variance_groups_are_dropped_and_refilled_from_seeded_draws():
    calls = []
    options = DynamicSampling(enabled=True, max_rounds=10)
    rollouts, formed = form_batch(options, 3, [2, 4, 5], 40, seed=7, batch_index=3, rank=0,
                                  sample=fake_sample(calls), score=fake_score)
    assert calls[0] == ([2, 4, 5], rollout_seed(7, 3, 0))  # round 0: the batch's own prompts and seed
    # each later round draws as many prompts as groups with a spread are still missing
    for r in range(1, len(calls)):
        kept_before = sum(row % 2 for rows, _ in calls[:r] for row in rows)
        assert len(calls[r][0]) == 3 - kept_before
    assert len(calls) > 1
    tried = [r for rows, _ in calls for r in rows]
    assert len(tried) == len(set(tried))  # a prompt is never drawn twice in one batch
    assert [seed for _, seed in calls] == [sampling_seed(7, 3, 0, r) for r in range(len(calls))]
    assert len(set(seed for _, seed in calls)) == len(calls)
    odd = [r for r in tried if r % 2]
    assert formed.rows == odd[:3] and all(r % 2 for r in formed.rows)
    assert [[c.token_ids[0] for c in g] for g in rollouts.groups] == [[r] * G for r in formed.rows]
    assert formed.rewards == [0.0, 1.0] * 3
    assert formed.reward_errors == len(calls)  # every round's reward failures count, dropped groups' included
    stats = formed.stats
    assert stats["dynamic_rounds"] == len(calls) and stats["dynamic_generated_groups"] == len(tried)
    assert stats["dropped_groups"] == len(tried) - len(odd) and stats["dynamic_padded_groups"] == 0
    assert stats["dynamic_surplus_groups"] == len(odd) - 3
    assert stats["dynamic_generated_per_kept"] == len(tried) / 3
    # the same arguments draw the same prompts: what an exact resume relies on
    again = []
    assert form_batch(options, 3, [2, 4, 5], 40, 7, 3, 0, fake_sample(again), fake_score)[1] == formed
    assert again == calls
    # another batch, round or rank draws other prompts
    assert draw_rows(40, set(), 5, 1) != draw_rows(40, set(), 5, 2)


def test_oversampling_draws_extra_prompts_in_round_zero_and_discards_the_surplus():
    calls = []
    _, formed = form_batch(DynamicSampling(enabled=True, oversample=3.0), 2, [1, 3], 40, 0, 0, 0,
                           fake_sample(calls), fake_score)
    assert len(calls[0][0]) == 6 and calls[0][0][:2] == [1, 3]
    assert formed.rows == [1, 3] and formed.stats["dynamic_rounds"] == 1
    assert formed.stats["dynamic_surplus_groups"] == sum(r % 2 for r in calls[0][0]) - 2


def test_at_the_cap_the_batch_is_padded_with_zero_variance_groups_or_the_run_stops():
    calls = []
    _, formed = form_batch(DynamicSampling(enabled=True, max_rounds=1), 3, [2, 3, 4], 40, 0, 0, 0,
                           fake_sample(calls), fake_score)
    assert len(calls) == 1 and formed.rows == [3, 2, 4]  # the one with a spread, then the flat ones in order
    assert formed.rewards == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert formed.stats["dynamic_padded_groups"] == 2 and formed.stats["dropped_groups"] == 0
    with pytest.raises(DynamicSamplingError, match=r"found 1 of 3 groups .*max_rounds=1"):
        form_batch(DynamicSampling(enabled=True, max_rounds=1, at_cap="error"), 3, [2, 3, 4], 40, 0, 0, 0,
                   fake_sample([]), fake_score)
    # a dataset with no row left to draw ends the rounds early
    _, formed = form_batch(DynamicSampling(enabled=True, max_rounds=5), 2, [0, 2], 3, 0, 0, 0,
                           fake_sample(calls := []), fake_score)
    assert [rows for rows, _ in calls] == [[0, 2], [1]] and formed.rows == [1, 0]


def test_a_failed_request_ends_the_batch_as_its_error():
    def broken(rows, seed):
        return Rollouts(None, "server at http://127.0.0.1:1 is gone")
    rollouts, formed = form_batch(DynamicSampling(enabled=True), 2, [1, 2], 10, 0, 0, 0, broken, fake_score)
    assert formed is None and rollouts.error == "server at http://127.0.0.1:1 is gone"


@pytest.mark.parametrize("kwargs, match", [
    ({"max_rounds": 0}, "max_rounds must be an integer >= 1, got 0"),
    ({"oversample": 0.5}, "oversample must be a number >= 1, got 0.5"),
    ({"at_cap": "drop"}, "at_cap must be 'pad' or 'error', got 'drop'"),
    ({"enabled": "yes"}, "enabled must be true or false"),
])
def test_bad_options_are_refused_in_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicSampling(**kwargs)
    with pytest.raises(ValueError, match=match):
        tiny_data(dynamic_sampling=kwargs)


# ---- fits with the scripted engine -------------------------------------------------------------------------------
class ScriptedRemote(RemoteEngine):
    """The scripted engine behind the remote contract (a rollout request, then the ranks' agreement), with the
    weight version a server reports: what asynchronous rollouts (K >= 1) need, without a server process."""

    rescore = True

    def __init__(self) -> None:
        self.inner = ScriptedEngine()
        self.before_push = []
        self.synced_step = 0

    def request_rollouts(self, prompts, n, sampling, seed) -> Rollouts:  # noqa: ANN001
        version = (str(self.synced_step),)
        groups = self.inner.generate(prompts, n, sampling, seed)
        return Rollouts([[replace(c, versions=version) for c in g] for g in groups])

    def check_lockstep(self, rollouts: Rollouts) -> list[list[Completion]]:
        if rollouts.error is not None:
            raise RuntimeError(rollouts.error)
        return rollouts.groups

    def load_weights(self, named_tensors, step: int) -> None:  # noqa: ANN001
        for hook in self.before_push:
            hook()
        self.inner.load_weights(named_tensors, step)  # consumes the push, as a server's client does
        self.synced_step = int(step)


class AsyncScripted(ScriptedDataModule):
    """K = 1 on the scripted remote engine (the constructor would ask for a server URL, so K is set after it)."""

    def __init__(self, **kwargs) -> None:  # noqa: ANN003
        super().__init__(**kwargs)
        self.async_rollouts = AsyncRollouts(1, self.rollout_job)
        self.engine_kind = "server"

    def build_engine(self, module) -> RemoteEngine:  # noqa: ANN001
        return ScriptedRemote()


KEYS = ("train/loss", "rollout/reward_mean", "rollout/frac_zero_variance", "rollout/dynamic_rounds",
        "rollout/dropped_groups", "rollout/dynamic_padded_groups", "rollout/dynamic_generated_per_kept")


def fit(workdir, steps: int, cls=ScriptedDataModule, ckpt_in=None, ckpt_out=None, **options) -> list[dict]:
    recorder = MetricsRecorder()
    trainer = tiny_trainer(workdir, max_steps=steps, callbacks=[WeightSync(every_n_batches=1), recorder])
    dynamic = {"enabled": True, "max_rounds": 6, **options}
    trainer.fit(tiny_module(lr=1e-2), datamodule=tiny_data(cls=cls, dynamic_sampling=dynamic), ckpt_path=ckpt_in)
    if ckpt_out:
        trainer.save_checkpoint(ckpt_out)
    return [{k: s[k] for k in KEYS} for s in recorder.steps]


def test_the_cap_pads_with_zero_variance_groups(tmp_path):
    steps = fit(tmp_path, 2, max_rounds=1)
    assert all(s["rollout/dynamic_rounds"] == 1 for s in steps)
    padded = [s for s in steps if s["rollout/dynamic_padded_groups"] > 0]
    assert padded and all(s["rollout/frac_zero_variance"] > 0 for s in padded)


@pytest.mark.parametrize("cls", [ScriptedDataModule, AsyncScripted], ids=["K=0", "K=1"])
def test_a_resumed_run_trains_on_the_batches_of_a_run_straight_through(tmp_path, cls):
    straight = fit(tmp_path / "a", 3, cls)
    # every batch holds groups with a spread only, refilled where round 0 fell short
    assert [s["rollout/frac_zero_variance"] for s in straight] == [0.0] * 3
    assert all(s["rollout/dynamic_padded_groups"] == 0 for s in straight)
    assert any(s["rollout/dropped_groups"] > 0 and s["rollout/dynamic_rounds"] > 1 for s in straight)
    assert all(s["rollout/dynamic_generated_per_kept"] >= 1 for s in straight)
    # stopped after one step (at K = 1 the checkpoint holds batch 1, formed ahead), resumed for two more
    first = fit(tmp_path / "b", 1, cls, ckpt_out=str(tmp_path / "half.ckpt"))
    second = fit(tmp_path / "c", 3, cls, ckpt_in=str(tmp_path / "half.ckpt"))
    assert len(first) == 1 and len(second) == 2
    for expected, got in zip(straight, first + second):
        assert got == pytest.approx(expected, abs=1e-6)
    assert len({round(s["train/loss"], 6) for s in straight}) > 1

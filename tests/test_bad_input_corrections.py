"""Sampler corrections that could not act are refused in one line, before any rollout.

``correction.old_policy: decoupled`` weighs by rho = alpha / mu with alpha recomputed from the weights that sampled
the batch. The project's rollout server reports only its own log-probs; the trainer rescores only a batch sampled
by its current weights (alpha is then pi_k) or, with ``keep_pushed_weights``, by the last pushed ones. Whenever a
batch can reach the trainer after the policy moved on (``data.max_staleness`` K >= 1, ``sync.every_n_batches``
v > 1, ``sync.delay_batches`` >= 1) or alpha is never the trainer's forward (``data.reuse_policy_logprobs:
false``), alpha is the server's report, rho = 1, and the ratio modes would correct nothing.
"""

from __future__ import annotations

import json

import pytest
from cli_runner import refusal_line
from conftest import tiny_data, tiny_module, tiny_trainer
from lit_grpo.callbacks import WeightSync

from lit_grpo.data.fit_checks import decoupled_on_stale_server, stale_sampling, sync_schedule
from lit_grpo.math.corrections import CorrectionOptions

#: a server nobody listens on: a check that came after the engine is built would fail on connecting instead
NO_SERVER = {"url": "http://127.0.0.1:9", "token": "secret"}


@pytest.mark.parametrize("staleness, interval, delay, reuse, named", [
    (1, 1, 0, True, "data.max_staleness=1"),
    (0, 4, 0, True, "sync.every_n_batches=4"),
    (0, 1, 2, True, "sync.delay_batches=2"),
    (0, 1, 0, False, "data.reuse_policy_logprobs=false"),
])
def test_stale_sampling_names_the_setting_that_makes_batches_stale(staleness, interval, delay, reuse, named):
    assert named in stale_sampling(staleness, interval, delay, reuse)


def test_k0_and_v1_sample_every_batch_with_the_current_weights():
    assert stale_sampling(0, 1, 0, True) is None


def test_sync_schedule_reads_the_syncing_callbacks():
    assert sync_schedule([]) == (1, 0)
    assert sync_schedule([object(), WeightSync(every_n_batches=3)]) == (3, 0)
    assert sync_schedule([WeightSync(delay_batches=2)]) == (1, 2)


@pytest.mark.parametrize("correction", [
    {"mode": "token_truncate", "old_policy": "decoupled"},
    CorrectionOptions(mode="sequence_mask"),  # decoupled is the default
    {"mode": "icepop"},
    {"mode": "geometric_mask", "old_policy": "decoupled"},
])
def test_a_ratio_mode_against_a_stale_project_server_is_refused_naming_keep_pushed_weights(correction):
    message = decoupled_on_stale_server(correction, {"url": "http://x", "kind": "lit_grpo"}, "data.max_staleness=2")
    assert message is not None and "\n" not in message
    for text in ("old_policy 'decoupled'", "data.max_staleness=2", "keep_pushed_weights", "proximal", "rho = 1"):
        assert text in message, (text, message)


@pytest.mark.parametrize("correction, options, stale", [
    ({"mode": "token_truncate"}, {"url": "u"}, None),  # K = 0, v = 1: nothing stale, alpha = pi_k
    ({"mode": "token_truncate"}, {"url": "u", "keep_pushed_weights": True}, "data.max_staleness=1"),  # recomputed
    ({"mode": "token_truncate", "old_policy": "proximal"}, {"url": "u"}, "data.max_staleness=1"),  # pi_k
    ({"mode": "none"}, {"url": "u"}, "data.max_staleness=1"),
    # the masks on pi_theta against mu act whatever alpha is (the loss then divides by mu, SkyRL's bypass form)
    ({"mode": "off_policy_mask"}, {"url": "u"}, "sync.every_n_batches=4"),
    ({"mode": "dppo_tv"}, {"url": "u"}, "sync.every_n_batches=4"),
    # vllm serve (and rescore: false) are refused whatever the staleness, by decoupled_without_recompute
    ({"mode": "token_truncate"}, {"url": "u", "kind": "vllm"}, "data.max_staleness=1"),
    ({"mode": "token_truncate"}, {"url": "u", "rescore": False}, "data.max_staleness=1"),
])
def test_what_can_act_stays_allowed(correction, options, stale):
    assert decoupled_on_stale_server(correction, options, stale) is None


def no_server_check(monkeypatch) -> None:  # noqa: ANN001
    """The data module asks the server for its weight info when it is made; none listens here, and the engine
    would ask again when it is built, which the refusal must come before."""
    import lit_grpo.engines.remote.client as client

    monkeypatch.setattr(client, "check_servers", lambda options: None)


def test_the_data_module_refuses_before_building_the_engine(tmp_path, monkeypatch):
    """A fit in Python: the refusal comes at ``setup``, before the engine connects to a server (none listens) and
    before any rollout."""
    no_server_check(monkeypatch)
    module = tiny_module(correction=CorrectionOptions(mode="token_truncate"))
    data = tiny_data(engine="server", engine_options=NO_SERVER, max_staleness=1)
    trainer = tiny_trainer(tmp_path, 1, callbacks=[WeightSync(every_n_batches=1)])
    with pytest.raises(ValueError, match=r"data\.max_staleness=1.*keep_pushed_weights") as raised:
        trainer.fit(module, datamodule=data)
    assert "\n" not in str(raised.value)


def test_the_data_module_reads_v_from_weight_sync(tmp_path, monkeypatch):
    no_server_check(monkeypatch)
    module = tiny_module(correction=CorrectionOptions(mode="icepop"))
    data = tiny_data(engine="server", engine_options=NO_SERVER)
    trainer = tiny_trainer(tmp_path, 1, callbacks=[WeightSync(every_n_batches=2)])
    with pytest.raises(ValueError, match=r"sync\.every_n_batches=2.*keep_pushed_weights"):
        trainer.fit(module, datamodule=data)


@pytest.mark.parametrize("extra, texts", [
    (["--data.max_staleness", "1"], ["data.max_staleness=1", "(model.correction.mode, on the command line; "
                                     "data.max_staleness, on the command line)"]),
    (["--sync.every_n_batches", "4"], ["sync.every_n_batches=4", "sync.every_n_batches, on the command line"]),
    (["--data.reuse_policy_logprobs", "false"], ["data.reuse_policy_logprobs=false"]),
])
def test_cli_refuses_decoupled_on_a_stale_project_server_before_the_model_loads(extra, texts, tmp_path, monkeypatch,
                                                                               capsys):
    from test_cli_errors import TINY_RUN

    line = refusal_line(["fit", "--model.model_name", "tiny-random-llama", *TINY_RUN,
                         f"--trainer.default_root_dir={tmp_path}", "--data.engine", "server",
                         "--data.engine_options", json.dumps(NO_SERVER), "--model.correction.mode", "token_truncate",
                         *extra], tmp_path, monkeypatch, capsys)
    for text in ("model.correction.mode='token_truncate' with old_policy 'decoupled'", "keep_pushed_weights",
                 *texts):
        assert text in line, (text, line)

"""Your own loss by import path (``model.loss: package.module:function``), the loss registry and its batch hook,
and the typed option groups (``model.optimizer``, ``model.loss_options``) with their checkpoint round trip."""

from __future__ import annotations

from dataclasses import dataclass, fields

import lightning as L
import pytest
import torch
from conftest import MetricsRecorder, tiny_data, tiny_module, tiny_trainer
from lit_grpo.callbacks import WeightSync

from lit_grpo.core.option_groups import as_group, plain
from lit_grpo.math.objective import LossConfig, token_stats
from lit_grpo.math.rec import ClipOptions, REDWeightOptions, RingOptions, TauOptions
from lit_grpo.training.losses import (
    BUILTIN_LOSSES,
    STAT_KEYS,
    CustomLossConfig,
    GRPOOptions,
    LossOptions,
    build_loss,
    check_loss_output,
    config_class,
    loss_inputs,
    red_drop_batch,
)
from lit_grpo.training.module import GRPOModule
from lit_grpo.training.optim import OptimizerArgs, build_optimizer

HERE = "test_custom_loss"  # this file, importable by name: conftest puts tests/ on sys.path


@dataclass(frozen=True)
class ClipConfig:
    """The options of :func:`written_out_grpo`; ``beta`` is filled from ``model.beta``."""

    eps: float = 0.2
    beta: float = 0.0


def written_out_grpo(logp, alpha_logp, advantages, weights, mask, config: ClipConfig, pik_logp=None, ref_logp=None):
    """Eq. 7 of Mroueh et al. with r' = 1, written out here rather than through lit_grpo.math: per token
    ``-min(r A, clip(r, 1 - eps, 1 + eps) A) + beta (exp(d) - d - 1)``, ``r = pi / alpha``, ``d = log pi_ref -
    log pi``, summed with the aggregation's weights."""
    ratio = torch.exp(logp - alpha_logp)
    adv = advantages.to(logp.dtype).unsqueeze(-1)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - config.eps, 1 + config.eps) * adv)
    kl = None
    if config.beta > 0:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1
        per_token = per_token + config.beta * kl
    m = mask.bool()
    no_clip = torch.zeros_like(m)
    return (per_token * weights).sum(), token_stats(m, ratio.detach(), no_clip, no_clip, kl)


def no_annotation(logp, alpha_logp, advantages, weights, mask, config, pik_logp=None, ref_logp=None):
    """A loss whose ``config`` names no dataclass: it receives a CustomLossConfig."""
    return written_out_grpo(logp, alpha_logp, advantages, weights, mask, ClipConfig(beta=config.beta),
                            pik_logp, ref_logp)


def takes_kwargs(**kwargs):
    return written_out_grpo(**{**kwargs, "config": ClipConfig()})


def missing_arguments(logp, advantages, weights, config):
    raise AssertionError("never called")


def needs_more(logp, alpha_logp, advantages, weights, mask, config, pik_logp, ref_logp, temperature):
    raise AssertionError("never called")


def bad_stats(logp, alpha_logp, advantages, weights, mask, config, pik_logp=None, ref_logp=None):
    return (logp * weights).sum(), {"tokens": mask.sum()}


NOT_CALLABLE = 3


@pytest.fixture
def no_model_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the loss was checked")

    monkeypatch.setattr("lit_grpo.training.module.load_model_and_tokenizer", refuse)


def fit(tmp_path, steps: int = 1, **module_kwargs) -> tuple[GRPOModule, MetricsRecorder]:
    L.seed_everything(0, verbose=False)
    # lr 1e-3: Adam scales a gradient that is 0 up to rounding (~1e-12) by lr / eps, so the runs' rounding noise
    # stays well under the tolerance below (1e-2 would put it at ~1e-6)
    module = tiny_module(beta=0.1, lr=1e-3, **module_kwargs)
    recorder = MetricsRecorder()
    tiny_trainer(tmp_path, max_steps=steps, callbacks=[WeightSync(every_n_batches=1), recorder]).fit(
        module, datamodule=tiny_data())
    return module, recorder


def test_own_loss_by_import_path_gives_the_update_of_builtin_grpo(tmp_path):
    builtin, builtin_steps = fit(tmp_path / "builtin")
    own, own_steps = fit(tmp_path / "own", loss=f"{HERE}:written_out_grpo",
                         loss_options=LossOptions(custom={"eps": 0.2}))
    assert own.loss_fn is written_out_grpo and own.loss_config == ClipConfig(eps=0.2, beta=0.1)
    initial = tiny_module().policy.state_dict()
    moved = False
    for (name, a), b in zip(builtin.policy.state_dict().items(), own.policy.state_dict().values()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), name
        moved = moved or not torch.equal(a, initial[name])
    assert moved  # the update did something, so agreeing is not trivial
    assert len(builtin_steps.steps) == len(own_steps.steps) == 1
    for a, b in zip(builtin_steps.steps, own_steps.steps):
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-6)
        assert a["train/kl"] == pytest.approx(b["train/kl"], abs=1e-6)


def names_correction_only(logp, alpha_logp, advantages, weights, mask, config: ClipConfig, pik_logp=None,
                          ref_logp=None, correction=None):
    """A loss written before ``policy_mask`` existed: it takes the top-entropy mask inside ``correction``."""
    raise AssertionError("never called")


def test_the_correction_and_the_policy_mask_reach_a_loss_by_the_parameters_it_names():
    weight, keep = torch.tensor([[0.5, 2.0, 1.5]]), torch.tensor([[1.0, 0.0, 1.0]])
    both = frozenset({"correction", "policy_mask"})
    # apart: the ratio as the correction, the top-entropy mask as the policy mask
    given = loss_inputs(both, "token_truncate", weight, keep)
    assert given["correction"] is weight and given["policy_mask"] is keep
    # a keep mask among the corrections is a policy mask too, multiplied with the top-entropy one
    opsm = torch.tensor([[0.0, 1.0, 1.0]])
    given = loss_inputs(both, "off_policy_mask", opsm, keep)
    assert given["correction"] is None and torch.equal(given["policy_mask"], opsm * keep)
    # a loss naming only `correction` (today's losses written by hand) gets everything in it
    assert torch.equal(loss_inputs(frozenset({"correction"}), "token_truncate", weight, keep)["correction"],
                       weight * keep)
    assert torch.equal(loss_inputs(frozenset({"correction"}), "none", None, keep)["correction"], keep)
    assert loss_inputs(frozenset(), "none", None, None) == {}
    assert loss_inputs(both, "none", None, None) == {"correction": None, "policy_mask": None}
    # and such a loss is still accepted with the top-entropy mask on
    module = tiny_module(loss=f"{HERE}:names_correction_only", loss_options=LossOptions(custom={"eps": 0.2}),
                         entropy={"top_entropy_quantile": 0.5})
    assert module.loss_keywords == frozenset({"correction"})


def test_own_loss_without_a_config_dataclass_gets_beta_and_its_options(no_model_loading):
    loss = build_loss(f"{HERE}.no_annotation", LossOptions(custom={"k": 1}), beta=0.3)
    assert loss.fn is no_annotation and loss.config == CustomLossConfig(beta=0.3, options={"k": 1})
    assert build_loss(f"{HERE}:takes_kwargs", None, 0.0).fn is takes_kwargs  # **kwargs takes every argument


@pytest.mark.parametrize("spec, error, match", [
    (f"{HERE}:missing_arguments", TypeError, r"wrong signature.*does not take \['alpha_logp', 'mask', 'pik_logp'"),
    (f"{HERE}:needs_more", TypeError, r"wrong signature.*\['temperature'\]"),
    (f"{HERE}:NOT_CALLABLE", ValueError, "'NOT_CALLABLE' is a int, not callable"),
    (f"{HERE}:no_such_function", ValueError, f"module '{HERE}' has no attribute 'no_such_function'"),
    ("no_such_package_xyz.losses:my_loss", ValueError, "no_such_package_xyz.losses:my_loss.*cannot import"),
    ("ppo", ValueError, "unknown loss 'ppo'.*grpo, gspo, cispo, rec_oneside_nois"),
])
def test_bad_loss_is_refused_with_one_line_before_the_model_loads(spec, error, match, no_model_loading):
    with pytest.raises(error, match=match) as err:
        tiny_module(loss=spec)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("custom, match", [
    ({"epz": 0.1}, r"\['epz'\].*ClipConfig"),
    ({"beta": 0.1}, "model.beta"),
])
def test_own_loss_options_are_checked_against_its_config(custom, match, no_model_loading):
    with pytest.raises(ValueError, match=match):
        tiny_module(loss=f"{HERE}:written_out_grpo", loss_options=LossOptions(custom=custom))


def test_options_of_a_loss_not_chosen_are_refused_not_ignored(no_model_loading):
    with pytest.raises(ValueError, match=r"loss_options.custom is set.*'grpo' reads loss_options.grpo only"):
        build_loss("grpo", LossOptions(custom={"eps": 0.1}), 0.0)
    with pytest.raises(ValueError, match=r"loss_options.opmd is set.*'red_drop' has no options"):
        build_loss("red_drop", {"opmd": {"tau": 0.5}}, 0.0)
    # at their defaults, the other sections are fine (a base config may spell out grpo's while a REC loss runs)
    assert build_loss("opmd", {"grpo": {"eps_low": 0.2}, "opmd": {"tau": 0.5}}, 0.1).config == TauOptions(
        tau=0.5).with_beta(0.1)


def test_loss_output_is_checked_against_the_contract():
    good = (torch.tensor(1.0), dict.fromkeys(STAT_KEYS, torch.tensor(0.0)))
    loss, stats = check_loss_output("x", good)
    assert loss is good[0] and stats is good[1]
    with pytest.raises(TypeError, match=r"stats without \['ratio_sum'"):
        check_loss_output("x", bad_stats(torch.zeros(2, 3), None, None, torch.ones(2, 3), torch.ones(2, 3), None))
    with pytest.raises(TypeError, match=r"loss of \(2,\); expected a 0-d tensor"):
        check_loss_output("x", (torch.zeros(2), good[1]))
    with pytest.raises(TypeError, match="expected a .loss, stats. tuple"):
        check_loss_output("x", torch.tensor(1.0))


def test_registry_covers_every_builtin_loss_and_its_options_section():
    sections = {f.name: f.type for f in fields(LossOptions)} | {"custom": None}
    for name, entry in BUILTIN_LOSSES.items():
        kind = config_class(entry.fn, name)
        # the loss's options class is its config: the class of its LossOptions section (red_drop has none)
        assert issubclass(kind, LossConfig), name
        assert sections.get(name, "LossConfig") == kind.__name__, name
        assert (entry.shape_batch is not None) == (name == "red_drop")  # only RED-Drop shapes the batch
    assert set(sections) - set(BUILTIN_LOSSES) == {"custom"}


@pytest.mark.parametrize("name, options, config", [
    ("grpo", {"grpo": {"eps_low": 0.1, "ratio_cap": 3.0}}, GRPOOptions(eps_low=0.1, ratio_cap=3.0)),
    ("grpo", {"grpo": {"eps_low": 0.1, "eps_high": 0.28}}, GRPOOptions(eps_low=0.1, eps_high=0.28)),
    ("rec_twoside_is", {"rec_twoside_is": {"eps_low": 0.3}}, ClipOptions(eps_low=0.3)),
    ("rec_ring", {"rec_ring": {"ring_eps_low": 0.5}}, RingOptions(ring_eps_low=0.5)),
    ("red_weight", {"red_weight": {"temperature": 2.0}}, REDWeightOptions(temperature=2.0)),
    ("asymre", {"asymre": {"tau": 0.3}}, TauOptions(tau=0.3)),
    ("red_drop", None, LossConfig()),
])
def test_each_loss_reads_its_own_section(name, options, config):
    loss = build_loss(name, options, beta=0.2)
    assert loss.fn is BUILTIN_LOSSES[name].fn and loss.config == config.with_beta(0.2)
    assert loss.config.beta == 0.2 and config.beta == 0.0  # beta is model.beta, set on a copy


def test_beta_is_no_option_of_a_section(no_model_loading):
    with pytest.raises(ValueError, match=r"loss_options.grpo \(GRPOOptions\) has no option\(s\) \['beta'\]"):
        build_loss("grpo", {"grpo": {"beta": 0.1}}, 0.0)
    with pytest.raises(ValueError, match="beta must be a number >= 0"):
        build_loss("rec_ring", None, -0.5)
    # a bad value in a section is named by its section, though one options class serves several
    with pytest.raises(ValueError, match=r"^loss_options.rec_twoside_is: eps_low must be in \(0, 1\]"):
        build_loss("rec_twoside_is", {"rec_twoside_is": {"eps_low": 2.0}}, 0.0)


def test_red_drop_hook_returns_a_shaped_copy_and_keeps_a_balanced_subset():
    from lit_grpo.core.batch import RolloutBatch

    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])  # group 0: 1 positive, 3 negatives
    s, c = rewards.numel(), 3
    collated = torch.full((s,), 7.0)
    batch = RolloutBatch(prompt_ids=torch.zeros(2, 2, dtype=torch.long), prompt_mask=torch.ones(2, 2),
                         completion_ids=torch.zeros(s, c, dtype=torch.long), completion_mask=torch.ones(s, c),
                         group_index=torch.arange(s) // 4, rewards=rewards, advantages=collated.clone(),
                         group_mask=torch.ones(s), truncated=torch.zeros(s, dtype=torch.bool), group_size=4,
                         batch_index=5)
    shaped, keep = red_drop_batch(batch, rank=0)
    assert torch.equal(batch.advantages, collated)  # the batch as collated is not changed
    assert shaped is not batch and shaped.rewards is batch.rewards and shaped.batch_index == 5
    assert keep[:4].sum() == 2 and keep[0] == 1  # the positive and one of the three negatives
    assert keep[4:].sum() == 4  # 3 positives, 1 negative: nothing to drop
    kept = shaped.advantages[:4][keep[:4].bool()]
    assert torch.allclose(kept.abs(), torch.ones(2), atol=1e-3) and kept.sum().abs() < 1e-6  # +-1 on the pair
    assert (shaped.advantages[:4][~keep[:4].bool()] == 0).all()
    again, keep_again = red_drop_batch(batch, rank=0)  # seeded by batch and rank: a resumed run drops the same
    assert torch.equal(again.advantages, shaped.advantages) and torch.equal(keep_again, keep)


def test_optimizer_group_validates_and_builds_adamw():
    args = OptimizerArgs(lr=3e-4, weight_decay=0.01, betas=(0.8, 0.95), warmup_steps=4, schedule="linear")
    optimizer, scheduler = build_optimizer([torch.nn.Parameter(torch.zeros(2))], args, total_steps=10)
    group = optimizer.param_groups[0]
    assert (group["weight_decay"], group["betas"]) == (0.01, (0.8, 0.95))
    assert group["lr"] == pytest.approx(3e-4 / 4)  # the first warmup step
    for kwargs, match in [({"lr": 0.0}, "optimizer.lr"), ({"lr": float("nan")}, "optimizer.lr"),
                          ({"weight_decay": -1.0}, "weight_decay"), ({"betas": (0.9, 1.0)}, "betas"),
                          ({"warmup_steps": -1}, "warmup_steps"), ({"schedule": "step"}, "'step'")]:
        with pytest.raises(ValueError, match=match):
            OptimizerArgs(**kwargs)


def test_groups_are_plain_dicts_in_the_checkpoint_and_load_back(tmp_path):
    options = LossOptions(grpo=GRPOOptions(eps_low=0.1, eps_high=0.3))
    trainer = tiny_trainer(tmp_path, max_steps=1, callbacks=[WeightSync()])
    trainer.fit(tiny_module(lr=2e-3, loss_options=options, optimizer=OptimizerArgs(lr=2e-3, betas=(0.8, 0.9))),
                datamodule=tiny_data())
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    hp = torch.load(tmp_path / "m.ckpt", weights_only=True)["hyper_parameters"]  # plain types only
    assert hp["optimizer"] == {"lr": 2e-3, "weight_decay": 0.0, "betas": (0.8, 0.9), "warmup_steps": 0,
                               "schedule": "constant", "fused": False}
    assert hp["loss_options"]["grpo"] == {"eps_low": 0.1, "eps_high": 0.3, "exact_ref_ratio": False,
                                          "ratio_cap": None, "delta": None}
    assert "beta" not in hp["loss_options"]["grpo"]  # model.beta is its own hyperparameter, not an option
    loaded = GRPOModule.load_from_checkpoint(tmp_path / "m.ckpt")
    assert loaded.optimizer_args == OptimizerArgs(lr=2e-3, betas=(0.8, 0.9))
    assert loaded.loss_config == GRPOOptions(eps_low=0.1, eps_high=0.3)


# loss_options as a checkpoint written before the options classes became the losses' configs stores them
OLD_LOSS_OPTIONS = {
    "grpo": {"eps_low": 0.1, "eps_high": 0.28, "exact_ref_ratio": False, "ratio_cap": None},
    "rec_oneside_nois": {"eps_low": 0.2, "eps_high": None}, "rec_oneside_is": {"eps_low": 0.2, "eps_high": None},
    "rec_twoside_is": {"eps_low": 0.2, "eps_high": None},
    "rec_ring": {"eps_low": 0.2, "eps_high": None, "ring_eps_low": 0.6, "ring_eps_high": 2.0},
    "red_weight": {"temperature": 1.0}, "opmd": {"tau": 0.1}, "asymre": {"tau": 0.1}, "custom": {},
}


def test_loss_options_of_an_earlier_checkpoint_load_unchanged():
    options = as_group(LossOptions, OLD_LOSS_OPTIONS, "loss_options")
    written = plain(options)
    # the same structure is written back, with the fields added since at their defaults (grpo's delta)
    assert {key: written[key] for key in OLD_LOSS_OPTIONS} == {**OLD_LOSS_OPTIONS,
                                                               "grpo": {**OLD_LOSS_OPTIONS["grpo"], "delta": None}}
    # sections of losses added since (gspo, cispo) come back at their defaults
    assert all(getattr(options, key) == getattr(LossOptions(), key) for key in written.keys() - OLD_LOSS_OPTIONS.keys())
    assert build_loss("grpo", OLD_LOSS_OPTIONS, 0.1).config == GRPOOptions(eps_low=0.1, eps_high=0.28).with_beta(0.1)


@dataclass(frozen=True)
class OwnOptions(LossConfig):
    """Your own loss's options may subclass LossConfig, as the built-in ones do: beta comes by ``with_beta``."""

    eps: float = 0.2


def own_options_loss(logp, alpha_logp, advantages, weights, mask, config: OwnOptions, pik_logp=None, ref_logp=None):
    return written_out_grpo(logp, alpha_logp, advantages, weights, mask, ClipConfig(config.eps, config.beta))


def test_own_loss_options_may_subclass_loss_config(no_model_loading):
    loss = build_loss(f"{HERE}:own_options_loss", LossOptions(custom={"eps": 0.3}), 0.2)
    assert loss.config == OwnOptions(eps=0.3).with_beta(0.2) and loss.config.beta == 0.2

"""Our sampler corrections against TRL's own code (float64): the four importance-sampling modes against the block of
``GRPOTrainer._generate_and_score_completions`` that computes ``vllm_importance_sampling_ratio`` (its source,
extracted and run on the same inputs), ``off_policy_mask`` against ``GRPOTrainer.get_off_policy_mask``, and the
end-to-end loss and gradient: TRL's ``_compute_loss`` with that ratio against our ``grpo`` loss with our weight, and
``vespo`` with each correction TRL runs it with (``token_truncate``, ``token_mask``, the off-policy mask).

Written against TRL 1.16. On another version the extraction or a stand-in attribute may no longer fit: the test
then fails and says what is missing, rather than skipping, so that a drift in TRL's formulas cannot go unseen.
"""

from __future__ import annotations

import inspect
import math
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from lit_grpo.math.corrections import CorrectionOptions, correction_weight
from lit_grpo.training.losses import build_loss, loss_inputs

trl = pytest.importorskip("trl", reason="TRL is a dev extra (pip install -e '.[dev]')")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402

S, T = 6, 5
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# the line that opens TRL's block, right after old_per_token_logps is computed
BLOCK_START = "if self.use_vllm and self.vllm_importance_sampling_correction:"
OLD_LOGPS_LINE = "old_per_token_logps, _, _ = self._get_per_token_logps_and_entropies("
# between the inputs' mean divergences mean_t(log mu - log pi): 0.0923 (sequence 1, dropped) and 0.0623 (kept)
OPSM_DELTA = 0.07
WEIGHT_TOLERANCE = 1e-12
LOSS_TOLERANCE = 1e-6


def where_written() -> str:
    return f"TRL {trl.__version__} (this test was written against TRL 1.16)"


def trl_ratio_block() -> str:
    """The source of TRL's ``vllm_importance_sampling_ratio`` block, dedented: from :data:`BLOCK_START` after the
    old log-probs' computation to the end of that ``if``."""
    try:
        source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    except (AttributeError, OSError, TypeError) as e:
        pytest.fail(f"{where_written()}: cannot read GRPOTrainer._generate_and_score_completions ({e!r})")
    lines = source.splitlines()
    anchor = next((i for i, line in enumerate(lines) if OLD_LOGPS_LINE in line), None)
    if anchor is None:
        pytest.fail(f"{where_written()}: GRPOTrainer._generate_and_score_completions no longer holds "
                    f"{OLD_LOGPS_LINE!r}; the importance-sampling block cannot be located")
    start = next((i for i in range(anchor, len(lines)) if lines[i].strip() == BLOCK_START), None)
    if start is None:
        pytest.fail(f"{where_written()}: no {BLOCK_START!r} after the old log-probs' computation")
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
        end += 1
    return textwrap.dedent("\n".join(lines[start:end]))


def trl_ratio(mode: str, low: float | None, high: float | None, old: torch.Tensor, mu: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor:
    """TRL's own ``vllm_importance_sampling_ratio`` for ``mode`` with clip_min = low, clip_max = high."""
    stand_in = SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True,
                               vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=low,
                               vllm_importance_sampling_clip_max=high)
    namespace = dict(self=stand_in, old_per_token_logps=old, sampling_per_token_logps=mu, completion_mask=mask,
                     tool_mask=None, torch=torch, math=math)
    block = trl_ratio_block()
    try:
        exec(compile(block, "<TRL's vllm_importance_sampling_ratio block>", "exec"), namespace)
    except Exception as e:  # a name the block needs that the stand-in lacks, on another TRL version
        pytest.fail(f"{where_written()}: running TRL's importance-sampling block failed ({e!r}):\n{block}")
    if "vllm_importance_sampling_ratio" not in namespace:
        pytest.fail(f"{where_written()}: the block no longer defines vllm_importance_sampling_ratio:\n{block}")
    return namespace["vllm_importance_sampling_ratio"]


def inputs() -> dict[str, torch.Tensor]:
    """pi_k (TRL's old_per_token_logps), mu, pi_theta and pi_ref in float64, right padding holding garbage (NaN,
    -inf), one counted token the sampler could not score (NaN); token ratios pi_k / mu from ~0.2 to ~6 and
    sequence products on both sides of 3, so every bound bites somewhere and not everywhere."""
    gen = torch.Generator().manual_seed(11)
    lengths = torch.tensor([5, 3, 4, 1, 5, 2])
    mask = (torch.arange(T) < lengths.unsqueeze(1)).long()
    mu = -torch.rand(S, T, generator=gen, dtype=torch.float64) * 3.0 - 0.1
    offset = torch.tensor([0.35, -0.3, 0.05, 1.6, -0.02, 0.5], dtype=torch.float64).unsqueeze(1)
    old = mu + offset + 0.6 * torch.randn(S, T, generator=gen, dtype=torch.float64)
    pi = old + 0.2 * torch.randn(S, T, generator=gen, dtype=torch.float64)
    ref = pi + 0.3 * torch.randn(S, T, generator=gen, dtype=torch.float64)
    mu[2, 1] = math.nan  # counted, unscored by the sampler
    mu[1, 4] = -math.inf  # padding
    old[3, 2] = math.nan  # padding
    advantages = torch.tensor([1.3, -0.7, 0.4, -1.1, -0.2, 0.9], dtype=torch.float64)
    return dict(old=old, mu=mu, pi=pi, ref=ref, advantages=advantages, mask=mask)


def our_weight(mode: str, low: float | None, high: float | None, data: dict) -> torch.Tensor:
    options = CorrectionOptions(mode, low=low, high=high)
    return correction_weight(options, data["old"], data["mu"], data["pi"], data["advantages"], data["mask"]).weight


BOUNDS = {"default": (None, None), "band": (0.5, 2.0)}


def trl_bounds(mode: str, bounds: str) -> tuple[float | None, float | None]:
    # our None is the mode's default, TRL's defaults clip_min None and clip_max 3.0
    low, high = BOUNDS[bounds]
    return CorrectionOptions(mode, low=low, high=high).bounds()


@pytest.mark.parametrize("bounds", list(BOUNDS))
@pytest.mark.parametrize("mode", IS_MODES)
def test_is_weights_equal_trls(mode, bounds):
    data = inputs()
    low, high = trl_bounds(mode, bounds)
    theirs = trl_ratio(mode, low, high, data["old"], data["mu"], data["mask"]).expand(S, T)
    ours = our_weight(mode, *BOUNDS[bounds], data)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=WEIGHT_TOLERANCE)
    # the comparison means something: the weight is neither all ones nor constant, and the bounds act
    counted = data["mask"].bool()
    distinct = 2 if mode.startswith("token") else 1  # a sequence mode has one value per sequence, 0 on dropped ones
    assert (ours[counted] != 1).any() and ours[counted].unique().numel() > distinct
    changed = (ours[counted] == 0).any() or (ours[counted] == high).any() or (ours[counted] == low).any()
    assert changed, ours


def test_trl_defaults_are_ours():
    from trl import GRPOConfig

    fields = GRPOConfig.__dataclass_fields__
    for mode in IS_MODES:
        assert CorrectionOptions(mode).bounds() == (fields["vllm_importance_sampling_clip_min"].default,
                                                    fields["vllm_importance_sampling_clip_max"].default)


@pytest.mark.parametrize("advantages", ["mixed", "all_negative"])
def test_off_policy_mask_equals_trls(advantages):
    data = inputs()
    if advantages == "all_negative":
        data["advantages"] = -data["advantages"].abs()
    delta = OPSM_DELTA
    if not callable(getattr(GRPOTrainer, "get_off_policy_mask", None)):
        pytest.fail(f"{where_written()}: GRPOTrainer.get_off_policy_mask is gone")
    theirs = GRPOTrainer.get_off_policy_mask(advantages=data["advantages"].unsqueeze(1), per_token_logps=data["pi"],
                                             sampling_per_token_logps=data["mu"], mask=data["mask"],
                                             off_policy_threshold=delta)
    ours = our_weight("off_policy_mask", None, delta, data)
    torch.testing.assert_close(ours, theirs.to(ours.dtype).expand(S, T), rtol=0, atol=WEIGHT_TOLERANCE)
    kept = ours[:, 0]
    assert (kept == 0).any() and (kept == 1).any(), kept


# ---------------------------------------------------------------------------------------------------------
# End to end: TRL's _compute_loss with its ratio, our grpo loss with our weight


def trl_loss(data: dict, loss_type: str, beta: float, ratio: torch.Tensor | None, opsm_delta: float | None,
             vespo: dict | None = None):
    """TRL's ``_compute_loss`` on a stand-in trainer (the model's forward replaced by prepared log-probs): (loss,
    d loss / d log pi). ``ratio`` given: vLLM's importance-sampling correction on, with that ratio. ``vespo``:
    the ``vespo_*`` fields of ``GRPOConfig``."""
    logp = data["pi"].clone().requires_grad_(True)

    def per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        return logp, torch.zeros_like(logp), None

    args = SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1, **(vespo or {}))
    accelerator = SimpleNamespace(num_processes=1, sync_gradients=True, reduce=lambda t, reduction: t,
                                  gather=lambda t: t, gather_for_metrics=lambda t: t)
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=per_token_logps_and_entropies, aux_loss_enabled=False,
        top_entropy_quantile=1.0, off_policy_mask_threshold=opsm_delta, importance_sampling_level="token",
        beta=beta, args=args, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28, use_vllm=ratio is not None,
        vllm_importance_sampling_correction=ratio is not None, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=T, accelerator=accelerator,
        _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask, get_gamma_weights=GRPOTrainer.get_gamma_weights)
    mask = data["mask"]
    batch = {
        "prompt_ids": torch.zeros(S, 2, dtype=torch.long), "prompt_mask": torch.ones(S, 2, dtype=torch.long),
        "completion_ids": torch.zeros(S, T, dtype=torch.long), "completion_mask": mask,
        "advantages": data["advantages"], "old_per_token_logps": data["old"],
        "sampling_per_token_logps": data["mu"], "ref_per_token_logps": data["ref"],
        "num_items_in_batch": mask.sum().to(torch.float64),
    }
    if ratio is not None:
        batch["importance_sampling_ratio"] = ratio
    try:
        loss = GRPOTrainer._compute_loss(trainer, None, batch)
    except (AttributeError, KeyError) as e:
        pytest.fail(f"{where_written()}: GRPOTrainer._compute_loss reads something the stand-in lacks ({e!r})")
    loss.backward()
    return loss.detach(), logp.grad


def exact_weights(mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """TRL's normalisations as per-token weights in float64: grpo per sequence then over sequences, dapo over
    the batch's tokens."""
    m = mask.to(torch.float64)
    return m / m.sum(-1, keepdim=True) / m.shape[0] if loss_type == "grpo" else m / m.sum()


def our_loss(data: dict, loss_type: str, beta: float, correction: torch.Tensor):
    loss_fn = build_loss("grpo", {"grpo": {"eps_low": 0.2, "eps_high": 0.28}}, beta)
    logp = data["pi"].clone().requires_grad_(True)
    loss, _ = loss_fn.fn(logp=logp, alpha_logp=data["old"], advantages=data["advantages"],
                         weights=exact_weights(data["mask"], loss_type), mask=data["mask"], config=loss_fn.config,
                         pik_logp=data["old"], ref_logp=data["ref"], correction=correction)
    loss.backward()
    return loss.detach(), logp.grad


def finite_padding(data: dict) -> dict:
    """The inputs with finite garbage on padding: both losses multiply their per-token terms by zero weights there,
    and inf * 0 would be NaN on either side (a property of the losses, not of the corrections)."""
    data = dict(data)
    pad = data["mask"] == 0
    data["old"] = torch.where(pad, -1.0, data["old"])
    data["mu"] = torch.where(pad, -1.5, data["mu"])
    return data


@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["beta0", "kl"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize("mode", IS_MODES)
def test_loss_with_is_correction_equals_trls(mode, loss_type, beta):
    data = finite_padding(inputs())
    low, high = CorrectionOptions(mode).bounds()
    ratio = trl_ratio(mode, low, high, data["old"], data["mu"], data["mask"])
    trl_value, trl_grad = trl_loss(data, loss_type, beta, ratio, None)
    weight = our_weight(mode, None, None, data)
    assert (weight[data["mask"].bool()] != 1).any()  # the correction changes the loss
    value, grad = our_loss(data, loss_type, beta, weight)
    assert abs(float(trl_value)) > 1e-3 and trl_grad.abs().max() > 1e-3
    assert abs(float(value - trl_value)) <= LOSS_TOLERANCE, (value, trl_value)
    torch.testing.assert_close(grad, trl_grad, rtol=0, atol=LOSS_TOLERANCE)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_loss_with_off_policy_mask_equals_trls(loss_type):
    data = finite_padding(inputs())
    data["advantages"] = -data["advantages"].abs()  # negative advantages: OPSM has sequences to drop
    delta = OPSM_DELTA
    trl_value, trl_grad = trl_loss(data, loss_type, 0.0, None, delta)
    weight = our_weight("off_policy_mask", None, delta, data)
    assert (weight == 0).any() and (weight == 1).any()
    value, grad = our_loss(data, loss_type, 0.0, weight)
    assert abs(float(value - trl_value)) <= LOSS_TOLERANCE, (value, trl_value)
    torch.testing.assert_close(grad, trl_grad, rtol=0, atol=LOSS_TOLERANCE)


# ---------------------------------------------------------------------------------------------------------
# VESPO with each correction TRL runs it with: its vLLM IS modes token_truncate and token_mask (it refuses the
# sequence ones, as the module does) enter the sequence weight w in log space; the off-policy mask multiplies the
# per-token term after phi(w). k_neg = 0 tells the two apart: there phi(w) = e^(lambda (1 - w)) tends to e^lambda as
# w -> 0, so a mask folded into w would give a dropped sequence the largest weight instead of none.
VESPO_MODES = ("token_truncate", "token_mask", "off_policy_mask")
VESPO_SHAPES = {"defaults": {"vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0},
                "k_neg0": {"vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 0.0, "vespo_lambda_neg": 2.0}}


def our_vespo(data: dict, beta: float, mode: str, weight: torch.Tensor, shape: dict):
    """Our ``vespo`` with the correction's weight handed over as the module hands it (:func:`loss_inputs`)."""
    options = {key.removeprefix("vespo_"): value for key, value in shape.items()}
    loss_fn = build_loss("vespo", {"vespo": options}, beta)
    logp = data["pi"].clone().requires_grad_(True)
    inputs = loss_inputs(frozenset({"correction", "policy_mask"}), mode, weight, None)
    loss, _ = loss_fn.fn(logp=logp, alpha_logp=data["old"], advantages=data["advantages"],
                         weights=exact_weights(data["mask"], "dapo"), mask=data["mask"], config=loss_fn.config,
                         pik_logp=data["old"], ref_logp=data["ref"], **inputs)
    loss.backward()
    return loss.detach(), logp.grad


@pytest.mark.parametrize("shape", list(VESPO_SHAPES))
@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["beta0", "kl"])
@pytest.mark.parametrize("mode", VESPO_MODES)
def test_vespo_with_each_correction_trl_accepts_equals_trls(mode, beta, shape):
    data = finite_padding(inputs())
    if mode == "off_policy_mask":
        data["advantages"] = -data["advantages"].abs()  # negative advantages: OPSM has sequences to drop
        ratio, delta = None, OPSM_DELTA
        weight = our_weight(mode, None, delta, data)
        assert (weight == 0).any() and (weight == 1).any()
    else:
        low, high = CorrectionOptions(mode).bounds()
        ratio, delta = trl_ratio(mode, low, high, data["old"], data["mu"], data["mask"]), None
        weight = our_weight(mode, None, None, data)
        assert (weight[data["mask"].bool()] != 1).any()  # the correction changes the loss
    trl_value, trl_grad = trl_loss(data, "vespo", beta, ratio, delta, vespo=VESPO_SHAPES[shape])
    value, grad = our_vespo(data, beta, mode, weight, VESPO_SHAPES[shape])
    assert abs(float(trl_value)) > 1e-3 and trl_grad.abs().max() > 1e-3
    assert abs(float(value - trl_value)) <= LOSS_TOLERANCE, (value, trl_value)
    torch.testing.assert_close(grad, trl_grad, rtol=0, atol=LOSS_TOLERANCE)

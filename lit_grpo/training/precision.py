"""Which numeric precisions training accepts, checked before any model loads.

GRPO compares three distributions token by token (pi, pi_k, alpha) through ratios like ``exp(logp - logp_alpha)``.
The weights the optimizer updates must be float32: AdamW's per-step change at RL learning rates (1e-6 to 5e-6)
is below bfloat16's resolution for most weights (8 bits of mantissa: a weight of 0.02 moves in steps of ~1e-4),
so bf16 weights silently stop learning. Mixed precision (``bf16-mixed``, ``16-mixed``) keeps float32 weights
and runs the matrix products in 16 bits; it is the fast setting on a GPU.
"""

from __future__ import annotations

#: ``trainer.precision`` values that make the policy's own weights 16-bit, with the mixed precision to use instead
MIXED_FOR = {"bf16-true": "bf16-mixed", "16-true": "16-mixed"}


def check_weights_dtype(dtype: str, lr: float) -> None:
    """Refuse a policy loaded in 16 bits (``model.dtype``): AdamW's updates round away (see the module doc)."""
    if dtype != "float32":
        raise ValueError(
            f"dtype {dtype!r} makes the trained weights {dtype}, where AdamW updates at lr {lr:g} round away and "
            "the policy silently stops learning; keep dtype float32 and set trainer.precision: bf16-mixed "
            "(16-bit matrix products, float32 weights)"
        )


def check_trainer_precision(precision: str) -> None:
    """Refuse a trainer precision that casts the weights to 16 bits (``bf16-true``, ``16-true``)."""
    precision = str(precision)
    if precision in MIXED_FOR:
        raise ValueError(
            f"precision {precision!r} trains 16-bit weights, where AdamW updates at RL learning rates round away "
            f"and the policy silently stops learning; use precision {MIXED_FOR[precision]} (float32 weights)"
        )

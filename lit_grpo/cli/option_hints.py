"""What a parse error about an unknown option adds to its line: an option path of an earlier version gets its new
place (:data:`MOVED_OPTIONS`), an option of LightningCLI's that this CLI does not offer the reason and what sets the
same thing here (:data:`NOT_OFFERED`), a typo the closest known option path. Imports nothing heavy."""

from __future__ import annotations

import difflib
import re

#: option paths of earlier versions -> where the option lives now; an unknown option named here gets its new place
MOVED_OPTIONS: dict[str, str] = {
    "model.lr": "model.optimizer.lr", "model.weight_decay": "model.optimizer.weight_decay",
    "model.adam_betas": "model.optimizer.betas", "model.warmup_steps": "model.optimizer.warmup_steps",
    "model.lr_schedule": "model.optimizer.schedule", "model.eps_low": "model.loss_options.grpo.eps_low",
    "model.eps_high": "model.loss_options.grpo.eps_high",
    "model.exact_ref_ratio": "model.loss_options.grpo.exact_ref_ratio",
    "model.ratio_cap": "model.loss_options.grpo.ratio_cap",
    "model.loss_options.ring_eps_low": "model.loss_options.rec_ring.ring_eps_low",
    "model.loss_options.ring_eps_high": "model.loss_options.rec_ring.ring_eps_high",
    "model.loss_options.tau": "model.loss_options.opmd.tau",  # or asymre.tau: the section of model.loss
    "model.loss_options.temperature": "model.loss_options.red_weight.temperature",
    "eval.every_n_steps": "eval.every_n_optimizer_steps",
}
#: LightningCLI options this CLI does not offer -> why, and what sets the same thing here
NOT_OFFERED: dict[str, str] = {
    "optimizer": "GRPOModule builds its own AdamW from `model.optimizer` (model.optimizer.lr, "
                 "model.optimizer.weight_decay, model.optimizer.betas)",
    "lr_scheduler": "GRPOModule builds its own schedule from `model.optimizer` (model.optimizer.schedule: constant, "
                    "linear or cosine; model.optimizer.warmup_steps)",
}
_UNKNOWN_OPTION = re.compile(r"(?:^|\s)--([\w.]+)(?:[=+\s]|$)|accept option '([\w.]+)'")


def option_hint(message: str, known: list[str]) -> str | None:
    """What to say about the unknown options a parse error names: an option of an earlier version gets its new
    path (:data:`MOVED_OPTIONS`), one LightningCLI offers elsewhere what this CLI sets (:data:`NOT_OFFERED`), and
    a typo the closest known option path; None when nothing fits."""
    dash, hints = "--" if "--" in message else "", []
    for match in _UNKNOWN_OPTION.finditer(message):
        name = match.group(1) or match.group(2)
        old, top = next((k for k in MOVED_OPTIONS if name == k or name.startswith(k + ".")), None), name.split(".")[0]
        if old is not None:
            hints.append(f"`{dash}{old}` is now `{dash}{MOVED_OPTIONS[old]}`")
        elif top in NOT_OFFERED:
            hints.append(f"`{dash}{top}` is not offered: {NOT_OFFERED[top]}")
        elif close := difflib.get_close_matches(name, known, n=1, cutoff=0.8):
            hints.append(f"did you mean `{dash}{close[0]}`?")
    return "; ".join(dict.fromkeys(hints)) or None

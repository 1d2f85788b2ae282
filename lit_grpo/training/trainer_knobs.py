"""Lightning's automatic-optimization knobs against GRPOModule's manual optimization: which have an equivalent in
the module and which do not, in one place for the CLI (which maps or refuses them before a model loads) and for a
module that checks the Trainer it is given. No Lightning import: plain values in, a message out.

GRPOModule takes ``iterations_per_batch`` optimizer steps per rollout batch, each over all of that batch's
micro-batches (``data.micro_batch_size``), so a step already accumulates the gradients of the whole batch
(``data.prompts_per_step`` x ``data.num_generations`` completions); there is nothing left for
``accumulate_grad_batches`` to do. It clips the global gradient norm itself, with ``model.gradient_clip_val``.
"""

from __future__ import annotations


def trainer_knob_error(gradient_clip_val: float | None, accumulate_grad_batches: int | None,
                       gradient_clip_algorithm: str | None) -> tuple[str, str] | None:
    """``(trainer option, one-line message)`` for the first of the Trainer's values GRPOModule cannot honour, or
    None. ``gradient_clip_val`` is refused here (pass None where it is mapped to ``model.gradient_clip_val``)."""
    if accumulate_grad_batches not in (None, 1):
        return ("trainer.accumulate_grad_batches",
                f"trainer.accumulate_grad_batches={accumulate_grad_batches} has no equivalent in GRPOModule: each "
                "optimizer step already takes the gradient of the whole rollout batch over all its micro-batches; "
                "set the batch with data.prompts_per_step (x data.num_generations) and the memory per pass with "
                "data.micro_batch_size, and leave trainer.accumulate_grad_batches at 1")
    if gradient_clip_algorithm not in (None, "norm"):
        return ("trainer.gradient_clip_algorithm",
                f"trainer.gradient_clip_algorithm={gradient_clip_algorithm!r}: GRPOModule clips the global gradient "
                "norm only, with model.gradient_clip_val; expected 'norm' or null")
    if gradient_clip_val is not None and gradient_clip_val > 0:
        return ("trainer.gradient_clip_val",
                f"trainer.gradient_clip_val={gradient_clip_val}: GRPOModule optimizes manually and clips the "
                f"gradient norm itself; pass GRPOModule(gradient_clip_val={gradient_clip_val}) "
                "(model.gradient_clip_val) and leave the Trainer's unset")
    return None

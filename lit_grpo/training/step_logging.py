"""What the module logs after each update: the step's statistics reduced over ranks, the update's cost against the
device's peak, the measured-at-some-steps metrics and the sampled completions' table; and the TV monitor's pass
after the update (``monitor_tv_after_update``). One function of the module
(``module``: the :class:`~lit_grpo.training.module.GRPOModule`), kept here so that the module reads as its step."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lit_grpo.core.batch import MicroBatch, RolloutBatch, alpha_logprobs
from lit_grpo.core.distributed import rank_and_world
from lit_grpo.core.measured_metrics import log_measured
from lit_grpo.core.scoring import active_dropout, completion_logprobs, dropout_off
from lit_grpo.math.tv import tv_estimate
from lit_grpo.training.completion_table import log_sampled_completions
from lit_grpo.training.flops import device_peak_flops
from lit_grpo.training.stat_reduction import reduce_stats
from lit_grpo.training.step_metrics import MEASURED_AT_SOME_STEPS, UpdateCost, step_metrics, step_statistics

if TYPE_CHECKING:
    from lit_grpo.training.module import GRPOModule


def log_step(module: GRPOModule, batch: RolloutBatch, iteration_stats: list[dict], grad_norms: list[torch.Tensor],
             staleness: int, update_seconds: float) -> None:
    """Log the module's step metrics (``lit_grpo.training.step_metrics``), reduced over ranks so that they mean what
    they mean in one process, each as the one rule of ``lit_grpo.training.stat_reduction`` says. The device
    statistics reach the host here, in one transfer (``reduce_stats``)."""
    hp = module.hparams
    reduced = reduce_stats(step_statistics(iteration_stats, grad_norms, batch.stats, update_seconds))
    # pi_ref's pass counts where it ran: not here when the rollout server made it
    # LoRA dropout adds one dropout-free no-grad pass per iteration (lit_grpo.core.scoring.policy_logprobs)
    dropout_passes = hp.iterations_per_batch if active_dropout(module.policy) else 0
    cost = UpdateCost(parameters=module.policy_parameters, reference_pass=hp.beta > 0 and not module._reference_served,
                      extra_no_grad_passes=int(hp.monitor_tv_after_update) + dropout_passes,
                      devices=rank_and_world()[1],
                      peak_flops=device_peak_flops(module.device, hp.peak_flops))
    metrics = step_metrics(reduced, len(iteration_stats), len(grad_norms), staleness, module._reference_served,
                           float(module.lr_schedulers().get_last_lr()[0]), cost)
    if module.entropy_coef != 0.0 or module.entropy_options.adaptive:
        metrics["train/entropy_coef"] = module.entropy_coef
    batch_size = batch.num_sequences
    # Lightning would hand a value logged once to the loggers at every later step: these go at their step only
    log_measured(module, {key: metrics.pop(key) for key in MEASURED_AT_SOME_STEPS if key in metrics})
    module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=batch_size)
    module.log("reward", metrics.get("rollout/reward_mean", 0.0), prog_bar=True, on_step=True, batch_size=batch_size)
    module.log("staleness", float(staleness), prog_bar=True, on_step=True, batch_size=batch_size)
    every = hp.log_completions_every_n_steps
    if every and batch.batch_index % every == 0 and module.global_rank == 0:
        log_sampled_completions(module, batch, staleness)


@torch.no_grad()
def tv_after_update(module: GRPOModule, batch: RolloutBatch, micro_batches: list[MicroBatch],
                    pik_logps: list[torch.Tensor]) -> torch.Tensor:
    """Sum over tokens of the TV(pi, alpha) estimate with pi the policy after the batch's last optimizer step
    (one no-grad pass; every rank makes it, so sharded ranks stay in step). A device tensor: no host sync."""
    sums = []
    for j, mb in enumerate(micro_batches):
        with dropout_off(module.policy):  # the policy itself, as the sampler runs it (LoRA dropout off)
            logp, _ = completion_logprobs(module.policy, mb, module.hparams.temperature, **module.scoring)
        sums.append(tv_estimate(logp, alpha_logprobs(batch, mb, pik_logps[j]), mb.loss_mask).sum)
    return torch.stack(sums).sum()

"""`GRPOModule`: policy, frozen reference and the clipped off-policy GRPO loss, trained with manual optimization.

One rollout batch -> ``iterations_per_batch`` (the paper's i) optimizer steps; each step runs every
micro-batch forward and backward, clips gradients and steps AdamW. The math lives in ``lit_grpo.math``; what the
step logs in ``lit_grpo.training.step_metrics``, and how its statistics merge in ``lit_grpo.training.stat_reduction``.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import lightning as L
import torch

from lit_grpo.core.batch import MicroBatch, RolloutBatch, alpha_logprobs, padding_tokens
from lit_grpo.core.chunked_head import DEFAULT_HEAD_CHUNK_MB, chunked_head_unsupported
from lit_grpo.core.distributed import (
    all_reduce,
    clip_grad_norm,
    everyone,
    fsdp1_wrap_model,
    fully_shard_model,
    gradient_sync_paused,
    is_sharded,
    rank_and_world,
    sum_over_ranks,
)
from lit_grpo.core.option_groups import as_group, plain
from lit_grpo.core.packing import packed_layout_kind, packing_supported
from lit_grpo.core.quiet import quiet_lightning
from lit_grpo.core.scoring import completion_logprobs, dropout_off, policy_logprobs
from lit_grpo.math.aggregation import (
    token_weights,
    zero_variance_dropped_weights,
    zero_variance_masked_weights,
)
from lit_grpo.math.corrections import CorrectionOptions, correction_weight, mismatch_stats
from lit_grpo.math.entropy_terms import (
    EntropyOptions,
    adaptive_entropy_coefficient,
    applied_entropy_coefficient,
    entropy_bonus,
    high_entropy_mask,
)
from lit_grpo.math.tv import tv_estimate
from lit_grpo.models.checkpointing import Checkpointing, check_checkpointing, enable_checkpointing
from lit_grpo.models.copies import frozen_copy
from lit_grpo.models.loading import checkpointing_call, disable_dropout, load_model_and_tokenizer
from lit_grpo.models.lora import LoraArgs, apply_lora, is_lora, merge_log, peft_model_of
from lit_grpo.training.flops import fed_tokens, parameter_count
from lit_grpo.training.losses import LossOptions, build_loss, check_loss_inputs, check_loss_output, loss_inputs
from lit_grpo.training.memory_check import check_generation_memory, check_update_memory
from lit_grpo.training.optim import OptimizerArgs, build_optimizer
from lit_grpo.training.option_checks import check_head_chunk_mb, check_loss_aggregation, check_module_numbers
from lit_grpo.training.precision import check_trainer_precision, check_weights_dtype
from lit_grpo.training.rng_state import gathered_rng_states, restore_rng_states
from lit_grpo.training.stat_reduction import merge_stats
from lit_grpo.training.step_logging import log_step, tv_after_update
from lit_grpo.training.step_metrics import (
    first_iteration_stats,
    wait_for_device,
)
from lit_grpo.training.trainer_knobs import trainer_knob_error


class GRPOModule(L.LightningModule):
    """GRPO objective (7) of Mroueh et al., or (8) with ``mask_zero_variance``.

    Args:
        model_name: alias (``smollm2-135m-instruct``, ``tiny-random-llama``), local directory or Hub id.
        beta: KL weight, for every loss; 0 loads no reference model.
        mask_zero_variance: eq. 8 as the paper writes it: groups whose rewards are all equal contribute zero
            (surrogate and KL term) but keep their place in the aggregation's denominator.
        drop_zero_variance: the DAPO-style alternative: such groups leave the batch, denominators included, so
            every kept token weighs 1 / (1 - flat fraction) more (``token_mean``, ``seq_mean_token_mean``).
            Exclusive with ``mask_zero_variance``.
        loss_aggregation: ``token_mean``, ``seq_mean_token_mean``, ``seq_mean_token_sum`` (LUSPO's length scaling)
            or ``constant`` (Dr.GRPO).
        iterations_per_batch: i, optimizer steps on each rollout batch.
        temperature: sampling temperature (linked from the data module by the CLI).
        max_completion_length: normaliser of the ``constant`` aggregation (linked from ``max_new_tokens``).
        log_completions_every_n_steps: log a table of sampled completions (prompt, answer, rewards, advantage)
            to every logger that takes one, every N training steps (None: never; ``completion_table``).
        optimizer: AdamW and its schedule (``lr``, ``weight_decay``, ``betas``, ``warmup_steps``, ``schedule``).
        gradient_checkpointing: recompute activations in the backward: ``true`` each decoder layer's forward,
            ``selective`` only its elementwise operations (``lit_grpo.models.checkpointing``; docs/speed.md).
        lora: train LoRA adapters (``r``, ``alpha``, ``dropout``, ``target_modules``; ``lit_grpo.models.lora.LoraArgs``)
            instead of every weight; None: full fine-tuning. With LoRA no reference copy is made: pi_ref is the
            policy with its adapter switched off, and the optimizer holds the adapters only.
        loss: the policy loss, ``grpo`` (eq. 6/7, the default), ``gspo`` (sequence-level ratio), ``cispo``
            (clipped stop-gradient weight; both ``lit_grpo.math``), one of the REC / RED / REP family of
            group-relative REINFORCE (``rec_oneside_nois``, ``rec_oneside_is``, ``rec_twoside_is``, ``rec_ring``,
            ``red_drop``, ``red_weight``, ``opmd``, ``asymre``; see ``lit_grpo.math.rec``), ``sapo``, ``luspo``
            (with ``loss_aggregation: seq_mean_token_sum``), ``vespo``, ``gmpo``, ``dppo_tv``, ``dppo_kl``
            (docs/losses.md), or your own as ``package.module:function`` (the contract: ``lit_grpo.training.losses``).
        loss_options: the losses' options, one section per loss (``loss_options.grpo.eps_low``,
            ``loss_options.rec_ring.ring_eps_low``, ...; ``loss_options.custom`` for your own loss); only the
            section of ``loss`` may differ from its defaults.
        monitor_tv_after_update: measure TV(pi, alpha) after the batch's last optimizer step with one extra
            no-grad pass over the batch (Theorem 1 monitor, ``tv/pi_alpha``); off: no extra pass, and
            ``tv/pi_alpha`` is measured at the last iteration's forward, before its optimizer step.
        correction: the sampler correction, for every loss (``mode``: ``token_truncate``, ``token_mask``,
            ``sequence_truncate``, ``sequence_mask``, ``icepop``, ``geometric_mask``, ``off_policy_mask``,
            ``dppo_tv``, ``dppo_kl``; ``old_policy``: ``decoupled`` or ``proximal``; ``low`` / ``high``: its bounds;
            ``lit_grpo.math.corrections``, docs/corrections.md): a per-token weight on the policy term from the
            sampler's log-probs mu against pi_old, alpha recomputed by the trainer (``decoupled``, the default) or
            pi_k (``proximal``), and the loss's denominator becomes that pi_old. ``vespo`` refuses the
            ``sequence_*`` modes (their one weight per sequence would count once per token in its log-weight).
        entropy: the entropy terms (``lit_grpo.math.entropy_terms``): ``top_entropy_quantile`` (train on the
            highest-entropy tokens only), ``coef`` (an entropy bonus, ``- coef * mean entropy``), ``adaptive`` and
            its target and step (TRL's adaptive entropy control).
        kl_bias_correction: weight each token's k3 KL by the importance ratio pi / pi_old (TRL's
            ``use_bias_correction_kl``), so the KL is estimated under pi rather than under the sampler.
        mask_truncated_completions: leave the completions that hit ``max_new_tokens`` without an end token out of
            the loss, denominators included (TRL's ``mask_truncated_completions``, DAPO's overlong filtering).
        peak_flops: one device's peak FLOP/s, the denominator of ``train/mfu`` (model FLOP utilisation of the
            update, see ``lit_grpo.training.flops``). None: the bf16 dense peak of the CUDA device when
            ``lit_grpo.training.flops.PEAK_BF16_FLOPS`` knows it; on a CPU or an unknown device no MFU is logged.
        packing: run each micro-batch's log-prob passes (policy, pi_ref, the TV monitor) as one packed row without
            padding. Under sdpa, eager and flex attention the row is a prefix tree: each group's prompt once, its
            completions as branches, turns that trajectories share once, with a mask letting each token see its own
            path only (``lit_grpo.core.prefix_tree``); under flash attention the same tree runs each segment
            against its own root path through the variable-length kernel (``lit_grpo.core.tree_flash``). Where
            the tree cannot run (chunked layers) each completion carries its own copy of its prompt
            (``lit_grpo.core.packing``). Log-probs equal the padded path's within 1e-5 in float32. A model that
            cannot pack is refused when the module is made. Set ``data.micro_batch_tokens`` with it: the budget then
            bounds each packed row (its layout's tokens, no padding); without one a packed row
            is ``micro_batch_size`` whole sequences, which sdpa and eager attention mask densely at the square of
            its length (on a CPU the demo's update ran 20x slower), warned about when the fit starts.
        head_chunk_mb: past this many MiB of float32 logits in a micro-batch, the lm head runs on chunks of tokens
            that fit it and a chunk's logits are recomputed in the backward (``lit_grpo.core.chunked_head``, where
            the default of 256 is explained; docs/speed.md); null: the full logits, the reference it equals.
        attn_implementation: the policy's (and pi_ref's) attention kernel: ``sdpa``, ``eager``, ``flex_attention``,
            ``flash_attention_2`` (a GPU with flash-attn: packed rows without a T x T mask); null: transformers' own
            choice.
    """

    def __init__(
        self,
        model_name: str,
        dtype: str = "float32",
        beta: float = 0.0,
        mask_zero_variance: bool = False,
        drop_zero_variance: bool = False,
        loss_aggregation: str = "token_mean",
        iterations_per_batch: int = 1,
        temperature: float = 1.0,
        max_completion_length: int = 200,
        optimizer: OptimizerArgs = OptimizerArgs(),  # noqa: B008 (frozen: a shared default is safe)
        gradient_clip_val: float | None = 1.0,
        gradient_checkpointing: Checkpointing = False,
        log_entropy: bool = True,
        log_completions_every_n_steps: int | None = 50,
        loss: str = "grpo",
        loss_options: LossOptions = LossOptions(),  # noqa: B008 (frozen)
        monitor_tv_after_update: bool = True,
        correction: CorrectionOptions = CorrectionOptions(),  # noqa: B008 (frozen)
        entropy: EntropyOptions = EntropyOptions(),  # noqa: B008 (frozen)
        kl_bias_correction: bool = False,
        mask_truncated_completions: bool = False,
        peak_flops: float | None = None,
        lora: LoraArgs | None = None,
        packing: bool = False,
        head_chunk_mb: float | None = DEFAULT_HEAD_CHUNK_MB,
        attn_implementation: str | None = None,
    ) -> None:
        super().__init__()
        quiet_lightning()  # for a Trainer built after the module, outside the command line
        check_module_numbers(iterations_per_batch, temperature, max_completion_length, peak_flops)
        check_loss_aggregation(loss_aggregation)
        check_head_chunk_mb(head_chunk_mb)
        check_checkpointing(gradient_checkpointing)
        if loss == "luspo" and loss_aggregation != "seq_mean_token_sum":
            raise ValueError(f"model.loss 'luspo' scales each sequence's loss by its length, which is "
                             f"loss_aggregation 'seq_mean_token_sum'; got {loss_aggregation!r}: set "
                             "model.loss_aggregation: seq_mean_token_sum")
        if mask_zero_variance and drop_zero_variance:
            raise ValueError("mask_zero_variance (eq. 8) and drop_zero_variance (DAPO-style) are both true; expected "
                             "at most one: they are two ways of leaving zero-variance groups out of the loss")
        self.optimizer_args = as_group(OptimizerArgs, optimizer, "optimizer")
        self.lora_args = None if lora is None else as_group(LoraArgs, lora, "lora")
        # the loss is resolved and its options checked now, so a bad name, path or option fails before a model loads
        self.policy_loss = build_loss(loss, loss_options, beta, kl_bias_correction=kl_bias_correction)
        self.loss_fn, self.loss_config = self.policy_loss.fn, self.policy_loss.config
        self.correction = as_group(CorrectionOptions, correction, "correction")
        self.entropy_options = as_group(EntropyOptions, entropy, "entropy")
        # the correction's weight and the top-entropy mask reach the loss only through parameters it names, and the
        # loss must be able to take the chosen correction (VESPO refuses a per-sequence one)
        self.loss_keywords = check_loss_inputs(self.policy_loss, self.correction.mode,
                                             self.entropy_options.top_entropy_quantile)
        #: the entropy bonus's coefficient now (TRL's adaptive control moves it; a checkpoint keeps it)
        self.entropy_coef = float(self.entropy_options.coef)
        self._last_entropy: float | None = None
        check_weights_dtype(dtype, self.optimizer_args.lr)
        # a checkpoint keeps the groups as plain dicts (it is read with torch.load(weights_only=True));
        # save_hyperparameters reads the arguments from this frame, so they are rebound to those dicts first
        optimizer, loss_options = plain(self.optimizer_args), plain(as_group(LossOptions, loss_options, "loss_options"))
        correction, entropy = plain(self.correction), plain(self.entropy_options)
        lora = None if self.lora_args is None else plain(self.lora_args)
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.policy, self.tokenizer = load_model_and_tokenizer(model_name, dtype, attn_implementation)
        disable_dropout(self.policy)
        # counted now, before any sharding: the whole model's N, on every rank (the FLOPs behind train/mfu)
        self.policy_parameters = parameter_count(self.policy)
        if self.lora_args is not None:  # after disable_dropout, which would also zero the adapters' own dropout
            self.policy = apply_lora(self.policy, self.lora_args)
        # from_pretrained returns eval mode; with dropout off the two modes compute the same (LoRA's own dropout
        # stays on in train mode, for the gradient pass only: every scoring pass turns it off,
        # lit_grpo.core.scoring)
        self.policy.train()
        if packing and (why := packing_supported(self.policy)) is not None:
            raise ValueError(f"model.packing: {why}")
        if head_chunk_mb is not None and (why := chunked_head_unsupported(self.policy)) is not None:
            raise ValueError(f"model.head_chunk_mb: {why}; expected a model it handles, or head_chunk_mb: null")
        # pi_ref is made on first use (`configure_model` under a trainer, else the first access of `reference`),
        # so that on an accelerator it is copied straight there instead of doubling the policy on the host
        self._modules["reference"] = None  # the property below reads it; set directly, past the property
        # with LoRA pi_ref is the policy with its adapter off: no copy (`reference` stays None)
        self._reference_pending = beta > 0 and self.lora_args is None
        #: how many times pi_ref was replaced (``RefModelSwap``): the label of pi_ref's weights, so a copy of pi_ref
        #: on a rollout server (``data.reference_on_server``) is used only while it is the current one
        self.reference_version = 0
        self._reference_served = False
        self._grad_norms: list[torch.Tensor] = []
        self._micro_batches_per_step = 1  # the entropy bonus's share of a step (set by each training_step)
        # the reference copy is a plain copy: it never recomputes (no grad) and keeps its KV cache
        enable_checkpointing(self.policy, gradient_checkpointing)

    # ---- the frozen reference pi_ref ----------------------------------------------------------------
    @property
    def reference(self) -> torch.nn.Module | None:
        """pi_ref: a frozen copy of the policy (``None`` when beta = 0, and with LoRA: the policy with its adapter
        off is pi_ref), made on first access."""
        if self._reference_pending:
            self._build_reference(next(self.policy.parameters()).device)
        return self._modules["reference"]

    def _build_reference(self, device: torch.device) -> None:
        reference = frozen_copy(self.policy, device)
        if (disable := checkpointing_call(reference, "disable", required=False)) is not None:
            disable()  # a no-grad model has nothing to recompute
        # left in train mode like the policy (dropout is off), so Lightning's mode checks stay quiet
        self._reference_pending = False
        self._modules["reference"] = reference

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Make pi_ref before loading a state that holds it (``load_from_checkpoint``, a resume), so that its saved
        weights, which differ from the policy's after a stage swap, land in it instead of being skipped."""
        if self._reference_pending and any(k.startswith("reference.") for k in state_dict):
            self.reference  # noqa: B018 (builds it, on the policy's device)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def checkpoint_layout(self) -> dict[str, torch.Tensor]:
        """The state dict a checkpoint of this module holds, also before pi_ref exists (it mirrors the policy)."""
        state = self.state_dict()
        if self._reference_pending:
            state.update({"reference." + k.removeprefix("policy."): v for k, v in list(state.items())
                          if k.startswith("policy.")})
        return state

    def configure_callbacks(self) -> list:
        """None of its own: the hook Lightning calls before it checks the Trainer's automatic-optimization knobs,
        so that ``Trainer(gradient_clip_val=...)`` is refused naming this module's
        (``lit_grpo.training.trainer_knobs``)."""
        t = self.trainer
        if (refused := trainer_knob_error(t.gradient_clip_val, t.accumulate_grad_batches, t.gradient_clip_algorithm)):
            raise ValueError(refused[1])
        return []

    def setup(self, stage: str) -> None:
        precision = str(getattr(self.trainer, "precision", "32-true"))
        check_trainer_precision(precision)

    def on_train_start(self) -> None:
        check_update_memory(self, self.trainer)  # refuse a micro-batch this machine cannot hold, before step 1
        check_generation_memory(self, self.trainer)  # and a KV cache the in-process engine cannot hold

    # ---- parallelism --------------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Shard policy and reference alike: FSDP2 under ``ModelParallelStrategy`` (``fully_shard`` over the
        data-parallel mesh), FSDP1 under ``FSDPStrategy``; DDP and one process need nothing here. A LoRA policy is
        sharded the same way: each decoder layer is one unit holding its frozen base weights and its adapters."""
        strategy = self.trainer.strategy if self._trainer is not None else None
        if strategy is None or is_sharded(self.policy):
            return  # no trainer, or already sharded by an earlier fit
        from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

        if self._reference_pending:
            if isinstance(strategy, (ModelParallelStrategy, FSDPStrategy)):
                self._build_reference(torch.device("cpu"))  # sharded below, like the policy
            else:
                # one process or DDP: move the policy now and copy it there, so the host never holds two copies
                self.policy.to(strategy.root_device)
                self._build_reference(strategy.root_device)
        if isinstance(strategy, ModelParallelStrategy):
            mesh = strategy.device_mesh
            if mesh["tensor_parallel"].size() > 1:
                raise ValueError(
                    f"ModelParallelStrategy got tensor_parallel_size={mesh['tensor_parallel'].size()}; GRPOModule "
                    "shards with FSDP2 only: set data_parallel_size to the number of processes and "
                    "tensor_parallel_size: 1"
                )
            for name in ("policy", "reference"):
                model = getattr(self, name)
                if model is not None:
                    fully_shard_model(model, mesh["data_parallel"])
        elif isinstance(strategy, FSDPStrategy):
            self.policy = fsdp1_wrap_model(self.policy, strategy.root_device)
            if self.reference is not None:
                self.reference = fsdp1_wrap_model(self.reference, strategy.root_device)

    # ---- optimisation -------------------------------------------------------------------------------
    def configure_optimizers(self) -> dict[str, Any]:
        args = self.optimizer_args
        total = None
        if self._trainer is not None and args.schedule != "constant":
            total = self.trainer.max_steps if self.trainer.max_steps > 0 else None
        # the trainable parameters only: with LoRA the adapters (AdamW keeps no moments for frozen weights)
        optimizer, scheduler = build_optimizer([p for p in self.policy.parameters() if p.requires_grad], args, total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Clip the global gradient norm. Lightning's precision plugin calls this hook inside ``optimizer.step()``,
        after a 16-mixed loss scale has been divided out, so the norm is the true one (clipping in
        ``training_step`` would see gradients still multiplied by the scale, 65,536 at first). The norm before
        clipping (``inf`` on a step the scaler will skip) is the same number on every rank."""
        max_norm = self.hparams.gradient_clip_val or float("inf")  # None or 0: measure only
        self._grad_norms.append(clip_grad_norm(self.policy, max_norm).detach())

    def loss_weights(self, batch: RolloutBatch, keep: torch.Tensor | None = None) -> torch.Tensor:
        """``[S, C]`` per-token weights of the whole rollout batch (``lit_grpo.math.aggregation``): eq. 7, eq. 8
        as written with ``mask_zero_variance``, or DAPO-style with ``drop_zero_variance``. ``keep`` (RED-Drop's
        subset) removes rows from the batch, denominators included, and so does ``mask_truncated_completions`` for
        completions that hit the length cap (as TRL zeroes their completion mask)."""
        mask = batch.token_mask.float()  # the model's tokens: an environment's are context
        if keep is not None:
            mask = mask * keep.unsqueeze(-1)
        if self.hparams.get("mask_truncated_completions", False):
            mask = mask * (~batch.truncated).to(mask.dtype).unsqueeze(-1)
        hp = self.hparams
        # denominators over the global batch (all ranks), so the sum of the ranks' losses is the one-process loss
        args = (hp.loss_aggregation, hp.max_completion_length, sum_over_ranks)
        if hp.mask_zero_variance:
            return zero_variance_masked_weights(mask, batch.group_mask, *args)
        if hp.drop_zero_variance:
            return zero_variance_dropped_weights(mask, batch.group_mask, *args)
        return token_weights(mask, *args)

    @property
    def packing(self) -> bool:
        """Whether the log-prob passes run packed rows without padding (``packing``)."""
        return bool(self.hparams.get("packing", False))

    @property
    def scoring(self) -> dict[str, Any]:
        """The layout arguments of every log-prob pass: ``packed`` and the head's chunk budget (``head_chunk_mb``)."""
        return {"packed": self.packing, "head_chunk_mb": self.hparams.get("head_chunk_mb", DEFAULT_HEAD_CHUNK_MB)}

    @property
    def micro_batch_layout(self) -> str:
        """How each micro-batch is fed, and so what its token budget counts: ``"padded"``, or packed as a prefix
        tree or as prompt copies, whichever the policy's attention takes (``lit_grpo.core.packing``)."""
        return packed_layout_kind(self.policy) if self.packing else "padded"

    @property
    def uses_reference(self) -> bool:
        """Whether the objective has a KL term (beta > 0), hence pi_ref's log-probs."""
        return self.hparams.beta > 0

    @torch.no_grad()
    def reference_logprobs(self, batch: RolloutBatch, micro_batches: list[MicroBatch]) -> list[torch.Tensor | None]:
        """pi_ref's log-probs per micro-batch: the rollout server's (``batch.reference_logp``,
        ``data.reference_on_server``) when every rank's batch was scored with the current pi_ref, else this
        module's own no-grad pass (the first batches of a fit, batches scored before a ``RefModelSwap`` took effect
        there, batches restored from a checkpoint). The choice is the same on every rank: sharded ranks must make
        the pass together."""
        self._reference_served = False
        # with LoRA pi_ref is the policy with its adapter off (after a RefModelSwap: the merged base); a rollout
        # server scores it on its own base, labelled with the merges that base holds (= this module's swaps)
        lora_reference = self.lora_args is not None and self.uses_reference
        if self.reference is None and not lora_reference:
            return [None] * len(micro_batches)
        served = batch.reference_logp is not None and batch.reference_version == str(self.reference_version)
        if batch.reference_offloaded and rank_and_world()[1] > 1:  # no collective when nothing is offloaded
            served = everyone(served)
        if served:
            self._reference_served = True
            return [mb.take(batch.reference_logp) for mb in micro_batches]
        if lora_reference:
            with peft_model_of(self.policy).disable_adapter(), dropout_off(self.policy):
                return [completion_logprobs(self.policy, mb, self.hparams.temperature, **self.scoring)[0]
                        for mb in micro_batches]
        return [completion_logprobs(self.reference, mb, self.hparams.temperature, **self.scoring)[0]
                for mb in micro_batches]

    def training_step(self, batch: RolloutBatch, batch_idx: int) -> torch.Tensor:
        """i optimizer steps on one rollout batch, each over every micro-batch. The statistics stay on the device
        for the whole update (no host sync per micro-batch) and reach the host once
        (``lit_grpo.training.step_logging.log_step``)."""
        hp = self.hparams
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        staleness = self.global_step - batch.rollout_step
        start = time.perf_counter()
        # a loss that shapes the batch (RED-Drop's balanced subset) says so through its hook: it returns a shaped
        # copy (new advantages) to train on and a [S] keep mask, and leaves the collated batch as it is
        shape_batch = self.policy_loss.shape_batch
        batch, keep = shape_batch(batch, rank_and_world()[0]) if shape_batch is not None else (batch, None)
        weights = self.loss_weights(batch, keep)
        micro_batches = self.micro_batches(batch)
        self._micro_batches_per_step = len(micro_batches)
        ref_logps = self.reference_logprobs(batch, micro_batches)
        pik_logps: list[torch.Tensor | None] = [None] * len(micro_batches)
        iteration_stats, grad_norms = [], []
        for iteration in range(hp.iterations_per_batch):
            totals: dict[str, torch.Tensor] = {}
            for j, mb in enumerate(micro_batches):
                with self.gradient_sync(last=j == len(micro_batches) - 1):
                    stats, pik_logps[j] = self.micro_batch_step(batch, mb, weights, ref_logps[j], pik_logps[j],
                                                                iteration)
                merge_stats(totals, stats)
            # clipping happens in `on_before_optimizer_step`, which the precision plugin calls after unscaling
            self._grad_norms = []
            optimizer.step()
            grad_norms.extend(self._grad_norms)
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            if self.entropy_options.adaptive:
                self.update_entropy_coefficient(totals)
            iteration_stats.append(totals)
        if hp.monitor_tv_after_update:
            iteration_stats[-1]["tv_pi_alpha_sum"] = tv_after_update(self, batch, micro_batches, pik_logps)
        wait_for_device(self.device)  # the clock must hold the work still queued on an accelerator
        update_seconds = time.perf_counter() - start
        # the tokens fed, as laid out (a prefix tree's nodes: each shared prefix once, lit_grpo.training.flops),
        # counted off the clock: rebuilding a tree to count it is bookkeeping, not the update's work
        fed = iteration_stats[0]["processed_tokens"] = fed_tokens(micro_batches, self.micro_batch_layout)
        if self.packing:  # no padding: a prefix tree, or each completion after its own prompt copy
            iteration_stats[0]["padded_tokens"], iteration_stats[0]["computed_tokens"] = fed * 0, fed
        else:
            iteration_stats[0]["padded_tokens"], iteration_stats[0]["computed_tokens"] = padding_tokens(micro_batches)
        log_step(self, batch, iteration_stats, grad_norms, staleness, update_seconds)
        return torch.stack([stats["loss"] for stats in iteration_stats]).mean()

    def micro_batches(self, batch: RolloutBatch) -> list[MicroBatch]:
        """The batch's micro-batches. Token-budget ones (``data.micro_batch_tokens``) differ in number from rank to
        rank; every forward of a sharded (FSDP) model is a collective, so the ranks then agree on the largest number
        any of them needs and each cuts its rows into that many. Packed, the budget bounds the packed row."""
        micro_batches = list(batch.micro_batches(layout=self.micro_batch_layout))
        if batch.micro_batch_tokens is None or rank_and_world()[1] == 1:
            return micro_batches
        count = torch.tensor(len(micro_batches), dtype=torch.long, device=self.device)
        parts = int(all_reduce(count, "max"))
        return micro_batches if parts == len(micro_batches) else list(batch.micro_batches(parts,
                                                                                          self.micro_batch_layout))

    def update_entropy_coefficient(self, totals: dict[str, torch.Tensor]) -> None:
        """TRL's adaptive entropy control after an optimizer step: the step's mean entropy over every rank's
        counted tokens (one host sync per optimizer step, adaptive control only) moves the coefficient by
        ``coef_delta`` towards keeping the entropy at ``target`` (``lit_grpo.math.entropy_terms``)."""
        pair = torch.stack([totals["entropy_bonus_sum"], totals["entropy_bonus_tokens"]])
        total, count = sum_over_ranks(pair).tolist()
        measured = total / max(count, 1.0)
        options = self.entropy_options
        self.entropy_coef = adaptive_entropy_coefficient(self.entropy_coef, measured, options.target,
                                                         options.coef_delta, options.coef_min, options.coef_max)
        self._last_entropy = measured

    def gradient_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Gradients are reduced over ranks in the last micro-batch's backward only: the others run inside
        ``gradient_sync_paused`` (DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync(False)``, FSDP1's
        ``no_sync``), so an optimizer step makes one reduction, not one per micro-batch."""
        if last:
            return contextlib.nullcontext()
        wrapper = self.trainer.strategy.model if self._trainer is not None else None
        return gradient_sync_paused(wrapper, self.policy)

    def micro_batch_step(self, batch: RolloutBatch, mb: MicroBatch, weights: torch.Tensor,
                         ref_logp: torch.Tensor | None, pik_logp: torch.Tensor | None,
                         iteration: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Forward, loss and backward of one micro-batch. Returns its statistics (0-d device tensors: sums and
        extrema that merge over micro-batches and ranks) and pi_k's log-probs (this forward's at iteration 0)."""
        hp = self.hparams
        first = iteration == 0
        entropy_options = self.entropy_options
        bonus = self.entropy_coef != 0.0 or entropy_options.adaptive
        wants_entropy = (hp.log_entropy and first) or bonus or entropy_options.top_entropy_quantile < 1.0
        # with LoRA dropout: the values of the policy without dropout (pi_k at iteration 0, the ratio's numerator),
        # the gradient of the pass with dropout (lit_grpo.core.scoring.policy_logprobs)
        logp, entropy = policy_logprobs(self.policy, mb, hp.temperature, with_entropy=wants_entropy,
                                        entropy_grad=bonus, **self.scoring)
        pik_logp = logp.detach() if first else pik_logp
        alpha_logp = alpha_logprobs(batch, mb, pik_logp)
        mask, advantages = mb.loss_mask, mb.take(batch.advantages)
        extra: dict[str, torch.Tensor] = {}
        # the sampler correction: the loss's denominator becomes pi_old, and its weight comes with the call
        old_logp, correction = self.sampler_correction(batch, mb, logp, pik_logp, alpha_logp, extra)
        keep = None
        if entropy_options.top_entropy_quantile < 1.0:
            keep = high_entropy_mask(entropy.detach(), mask, entropy_options.top_entropy_quantile)
            extra["entropy_masked"] = (mask.bool() & ~keep.bool()).sum().to(torch.float64)
            keep = keep.to(logp.dtype)
        # apart, not folded together: the mask multiplies the policy term after the loss's own weighting (VESPO
        # would otherwise put it into its sequence weight), as TRL's entropy_mask
        optional = loss_inputs(self.loss_keywords, self.correction.mode, correction, keep)
        loss, stats = check_loss_output(self.policy_loss.name, self.loss_fn(
            logp=logp, alpha_logp=old_logp, advantages=advantages, weights=mb.take(weights), mask=mask,
            config=self.loss_config, pik_logp=pik_logp, ref_logp=ref_logp, **optional,
        ))
        stats.update(extra)
        if bonus:  # on the top-entropy tokens alone: the tokens the sampler correction masks keep their entropy
            loss = loss - self.entropy_bonus_term(entropy, mask, keep, stats)
        # Theorem 1 monitor: TV(pi_k, alpha) at the first iteration, TV(pi, alpha) at the last one
        if first:
            stats.update(first_iteration_stats(pik_logp, alpha_logp, mask, entropy.detach() if hp.log_entropy
                                               and entropy is not None else None))
            if batch.sampler_logp is not None:  # what the trainer computes against what the sampler reported
                stats.update(mismatch_stats(pik_logp, mb.take(batch.sampler_logp), mask))
        if iteration == hp.iterations_per_batch - 1 and not hp.monitor_tv_after_update:
            stats["tv_pi_alpha_sum"] = tv_estimate(logp, alpha_logp, mask).sum
        # DDP and FSDP average gradients over ranks; the weights already divide by global totals, so undo the mean
        _, world = rank_and_world()
        self.manual_backward(loss * world if world > 1 else loss)
        stats["loss"] = loss.detach().to(torch.float64)  # weights divide by global totals: the ranks' losses add up
        return stats, pik_logp

    def sampler_correction(self, batch: RolloutBatch, mb: MicroBatch, logp: torch.Tensor, pik_logp: torch.Tensor,
                           alpha_logp: torch.Tensor,
                           stats: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The loss's denominator and the correction's per-token weight (``model.correction``,
        ``lit_grpo.math.corrections``): with no correction, alpha and None. Otherwise pi_old is pi_k
        (``proximal``) or alpha as the batch carries it (``decoupled``: the trainer's recompute of the rollout
        weights; a batch whose alpha is the sampler's own report has nothing to correct, and is counted), and the
        weight compares pi_old (or pi_theta, for the masks defined on it) with the sampler's mu."""
        options = self.correction
        if options.mode == "none":
            return alpha_logp, None
        if batch.sampler_logp is None:
            raise ValueError(f"model.correction.mode={options.mode!r} needs the sampler's log-probs of the batch "
                             "(RolloutBatch.sampler_logp); this batch has none")
        mu = mb.take(batch.sampler_logp)
        if options.old_policy == "proximal":
            old_logp = pik_logp
        else:
            old_logp = alpha_logp
            no_recompute = mb.loss_mask.sum() if batch.alpha_source == "sampler" else torch.zeros(
                (), device=logp.device)
            stats["correction_no_recompute"] = no_recompute.to(torch.float64)
        weight = correction_weight(options, old_logp, mu, logp.detach(), mb.take(batch.advantages),
                                   mb.loss_mask)
        m = mb.loss_mask.bool()
        stats["correction_masked"] = (m & weight.masked).sum().to(torch.float64)
        stats["correction_truncated"] = (m & weight.truncated).sum().to(torch.float64)
        stats["correction_weight_sum"] = torch.where(m, weight.weight.to(torch.float64), 0.0).sum()
        return old_logp, weight.weight.to(logp.dtype)

    def entropy_bonus_term(self, entropy: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor | None,
                           stats: dict[str, torch.Tensor]) -> torch.Tensor:
        """``coef * mean entropy`` over this micro-batch's counted tokens (those the top-entropy mask ``keep``
        keeps; the sampler correction's weight plays no part, as in TRL's ``effective_mask``), a share of the
        batch's bonus: divided by the micro-batches and ranks, as TRL divides its per-micro-batch
        mean by the accumulation steps (the module's backward multiplies by the ranks, as for the loss). Under
        adaptive control the coefficient applies only while the last measured entropy is at or below the target
        (TRL's rule); its sums go into the statistics for the next update of the coefficient."""
        effective = mask.bool() if keep is None else mask.bool() & (keep > 0)
        stats["entropy_bonus_sum"] = torch.where(effective, entropy.detach().to(torch.float64), 0.0).sum()
        stats["entropy_bonus_tokens"] = effective.sum().to(torch.float64)
        options = self.entropy_options
        coef = applied_entropy_coefficient(self.entropy_coef, self._last_entropy, options.target, options.adaptive)
        shares = self._micro_batches_per_step * rank_and_world()[1]
        return coef * entropy_bonus(entropy, effective) / shares

    # ---- exact resume -------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["rng_states"] = gathered_rng_states()
        checkpoint["reference_version"] = self.reference_version
        checkpoint["entropy_control"] = {"coef": self.entropy_coef, "last_entropy": self._last_entropy}
        if is_lora(self.policy):  # the adapters merged so far (the base in the state dict already holds them)
            checkpoint["lora_merge_log"] = merge_log(self.policy).state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.reference_version = int(checkpoint.get("reference_version", 0))
        if "entropy_control" in checkpoint:  # TRL's adaptive control moves the coefficient: a resume continues it
            control = checkpoint["entropy_control"]
            self.entropy_coef = float(control["coef"])
            self._last_entropy = None if control["last_entropy"] is None else float(control["last_entropy"])
        if "lora_merge_log" in checkpoint and is_lora(self.policy):
            merge_log(self.policy).load_state_dict(checkpoint["lora_merge_log"])
        if checkpoint.get("rng_states"):
            restore_rng_states(checkpoint["rng_states"])

"""`RolloutDataModule`: GSM8K prompts in, rollout batches (completions, rewards, advantages) out.

The loader yields only prompt indices; completions are generated in ``on_after_batch_transfer``, which Lightning
calls right before ``training_step``. Lightning fetches one batch ahead of the step it trains on, so
generating inside the dataset's ``__iter__`` would sample batch k+1 before the weight sync that follows step k;
generating here guarantees that each batch comes from the engine weights of the step just finished. Every batch is
taken from ``AsyncRollouts`` (``lit_grpo.data.async_rollouts``), which with ``max_staleness`` >= 1 has a background
producer request it ahead of the trainer, and at ``max_staleness`` = 0 requests it on the training thread when it is
taken: one way for a batch, whatever K.

This module is the loop's plumbing; each concern it wires lives in a module of its own: which prompts make up a batch
(``prompt_order``), what the constructor refuses (``option_checks``), the rollout engine and where alpha comes from
(``engine_setup``), a batch's rewards (``batch_rewards``), multi-turn environment errors (``environment_errors``) and
what a checkpoint keeps (``checkpoint_state``).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from functools import partial
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader

from lit_grpo.core.batch import RolloutBatch
from lit_grpo.core.distributed import everyone
from lit_grpo.core.option_groups import as_group
from lit_grpo.data import engine_setup, fit_checks
from lit_grpo.data.async_rollouts import AsyncRollouts, Requested
from lit_grpo.data.batch_rewards import BatchScores, batch_reward_runner, overlong_penalties, score_completions
from lit_grpo.data.checkpoint_state import data_state, restore_data_state
from lit_grpo.data.columns import RowFormat, check_row_format, run_rows
from lit_grpo.data.dynamic_sampling import DynamicSampling, Formed, OverlongPenalty, Scored, form_batch
from lit_grpo.data.engine_setup import MIXED_AUTOCAST
from lit_grpo.data.environment_errors import EnvironmentFailure, new_environment_errors, trajectory_tasks
from lit_grpo.data.multi_turn import MultiTurnOptions, TrajectoryRunner, trajectory_stats
from lit_grpo.data.option_checks import (
    check_advantage_std,
    check_batch_numbers,
    check_overlong_penalty,
    check_sampler_check_options,
)
from lit_grpo.data.prompt_order import PromptBatch, PromptLoader, PromptStream, epoch_permutation, rank_share
from lit_grpo.data.prompts import DEFAULT_SYSTEM_PROMPT
from lit_grpo.data.rewards import RewardFn
from lit_grpo.data.rollout import BatchOrigin, PaddedRollouts, collate_rollouts, pad_rollouts, rollout_seed
from lit_grpo.data.sampler_check import DEFAULT_MAX_GAP, DEFAULT_SEQUENCES, SamplerCheck, rejoined_servers
from lit_grpo.data.server_reference import ServerReference
from lit_grpo.data.staleness import check_staleness_setup, mixes_versions, staleness_stats, weight_version_of
from lit_grpo.data.tasks import default_environment, system_prompt_for
from lit_grpo.data.thinking import prompt_ids_open_thought
from lit_grpo.engines.base import Completion, RemoteEngine, RolloutEngine, Rollouts, SamplingConfig
from lit_grpo.engines.options import ServerOptions, TransformersOptions, VLLMOptions
from lit_grpo.environments.protocol import resolve_environment
from lit_grpo.environments.rendering import ConversationRenderer
from lit_grpo.environments.tool_calls import resolve_tool_call_format
from lit_grpo.environments.tools import ToolBox
from lit_grpo.models.loading import pad_token_id

#: importable from here as before the split by concern, with the data module itself
__all__ = ["MIXED_AUTOCAST", "EnvironmentFailure", "PromptBatch", "PromptStream", "RolloutDataModule"]


class RolloutDataModule(L.LightningDataModule):
    """Prompts from GSM8K, G completions each from the rollout engine, rewards and group advantages.

    Args:
        dataset: ``"bundled"`` (the GSM8K copy in the package), a local jsonl/json/parquet path, a folder written by
            ``Dataset.save_to_disk``, or a Hub id such as ``openai/gsm8k``; GSM8K's format unless its columns are
            named (``problem_column``, ``answer_column``).
        prompts_per_step: prompts per rollout batch per process; a step trains on
            ``prompts_per_step * world_size`` prompts, each rank on its own share with its own sampling seed.
        num_generations: G, completions per prompt (>= 2: a group needs a spread to whiten).
        micro_batch_size: completions per forward/backward pass.
        micro_batch_tokens: cut the forward/backward passes by tokens instead (``micro_batch_size`` is then
            unused): the completions sorted by length, each pass at most this many tokens, padding included
            (rows x longest completion + distinct prompts x longest prompt; a longer single completion gets a pass
            of its own). On uneven lengths the update then pays for the tokens, not for each pass's longest row
            (``train/padded_fraction``). With ``model.packing`` a pass is one packed row and its tokens are that
            row's, no padding: a prefix tree's (each group's prompt once, sdpa, eager and flex attention) or each
            completion with its own prompt (flash attention). None (default): ``micro_batch_size`` rows per
            pass, in order.
        max_new_tokens, temperature, top_p: sampling (log-probs use ``logits / temperature``). The one source of
            the sampling settings: a LightningModule with a ``temperature`` of its own (``GRPOModule``'s, which the
            CLI links to this one) must have this one when the fit starts, else the fit is refused.
        rewards: reward functions by short name (``correctness``, ``format``; ``math_verify`` for LaTeX golds) or
            import path ``package.module:function`` (configs and the CLI), or in Python the functions themselves
            (``rewards=[my_reward, "format"]``); each is checked against the contract
            ``fn(completion: str, answer: str, **kwargs) -> float`` now, and one that scores no completion of the
            first batch stops the run (``lit_grpo.data.rewards.RewardRunner``, which also says which callables work
            in processes Lightning spawns); ``reward_weights`` weigh them (default 1 each).
        scale_rewards: divide by the group std (eq. 2); ``False`` centres only (Dr.GRPO).
        advantage_std: which std divides: ``population`` (eq. 2: divide by G, ``eps`` inside the square root) or
            ``bessel`` (TRL's ``GRPOTrainer``: divide by G - 1, ``eps`` added to the std), about sqrt(G / (G - 1))
            apart (:func:`lit_grpo.math.advantages.group_advantages`).
        system_prompt: the system message before each question (``None``: none). Left at its default, GSM8K's, a
            ``reasoning_gym:<task>`` dataset gets reasoning-gym's own prompt instead (``lit_grpo.data.tasks``).
        engine: ``"transformers"`` (in-process copy of the policy), ``"vllm"`` (colocated vLLM) or ``"server"``
            (rollout servers over HTTP, ``ServerEngine``: ``engine_options: {url: ...}``).
        engine_options: the engine's options: a mapping checked against the group of ``engine`` (or that group),
            ``TransformersOptions``, ``VLLMOptions`` or ``ServerOptions`` (``lit_grpo.engines.options``);
            ``--data.engine_options.help ServerOptions`` lists a group's options.
        max_prompts: use only the first N rows after a seeded shuffle (quick runs).
        reuse_policy_logprobs: when the engine holds exactly the policy's current weights (synced at this
            optimizer step), alpha = pi_k, so alpha's log-probs are the policy's own first-iteration log-probs
            and the engine's scoring pass is skipped (same losses to float rounding; tested).
        max_staleness: K. 0: each batch is generated when the trainer needs it (synchronous). K >= 1
            (``engine: server`` only): asynchronous off-policy GRPO: while the trainer updates on batch b, the
            server generates batches up to b + K on a background thread (``lit_grpo.data.producer``), so a
            batch is sampled with weights at most K rollout batches older than its synchronous schedule:
            staleness (optimizer step - weight version) <= (K + v - 1) i, which is K at v = i = 1. A batch never
            gets older than that: the producer waits for the trainer instead of running further ahead
            (``rollout/producer_waits``). Weight pushes wait for the batches already requested, so no completion
            mixes two versions and a run is reproducible; checkpoints keep the batches generated but not yet
            trained on, so a resumed run continues exactly.
        partial_rollouts: with ``max_staleness >= 1`` and ``engine: server``: a weight push does not wait for the
            batches already requested; it pauses the server's generations at a token boundary
            (``/pause?mode=keep``), swaps the weights, and they go on under the new ones (docs/async.md, "Partial
            rollouts"). Each token then carries the version that sampled it (``Completion.span_lengths``); a batch
            that mixes versions takes the sampler's per-token log-probs as alpha. The staleness bound still holds
            per token; which tokens a push cuts depends on timing, so a run is no longer reproducible (a resume from
            a checkpoint still is exact).
        reference_on_server: the project's rollout server (``engine: server``, kind ``lit_grpo``) also computes
            pi_ref's log-probs of each batch right after sampling it (``lit_grpo.serve.reference_routes``); the
            trainer then skips its reference pass, a quarter of the update's FLOPs. With ``max_staleness >= 1``
            that pass runs on the server while the trainer updates on the batch before. ``WeightSync`` pushes pi_ref
            to the server at the start and after each ``RefModelSwap``; a batch scored with an older pi_ref (or none)
            is scored by the trainer as before (``train/reference_served`` is 0 for it). The numbers are the
            trainer's own scoring function in the server's dtype: equal to the trainer's in float32 up to the
            matmuls' summation order.
        sampler_check_max_gap: with a vLLM or server engine, the first batch sampled right after the first weight
            push is teacher-forced on the trainer (``sampler_check_sequences`` completions per rank), and the run is
            refused in one line when the sampler's log-probs differ from the trainer's by more than this per token
            on average (``lit_grpo.data.sampler_check``: a server without processed log-probs, another model, a
            generation config that changes sampling). The default lies above the bfloat16 gaps measured; ``null``
            turns the check off. Logged as ``rollout/sampler_check_gap`` and ``rollout/sampler_check_seconds``.
        sampler_check_sequences: completions per rank the check teacher-forces.
        dynamic_sampling: DAPO's dynamic sampling (``enabled``, ``max_rounds``, ``oversample``, ``at_cap``;
            ``lit_grpo.data.dynamic_sampling.DynamicSampling``, docs/batch-shaping.md): each rank drops its groups
            whose rewards all equal and refills them from further prompts, drawn from the dataset by seeds of the
            data seed, the batch and the round (a resumed run draws the same). The rewards are then computed where
            the batch is formed (on the producer's thread with ``max_staleness >= 1``). Logged as
            ``rollout/dynamic_rounds``, ``rollout/dropped_groups``, ``rollout/dynamic_generated_per_kept``, ...
        overlong_penalty: DAPO's soft overlong punishment (eq. 13; ``buffer``: L_cache tokens, 0 = off, below
            ``max_new_tokens``; ``factor``): ``factor * R_length(|y|)`` with ``L_max = max_new_tokens`` is added to
            each completion's reward before the advantages (``lit_grpo.math.overlong``); its batch mean is logged as
            ``rollout/overlong_penalty``.
        environment: multi-turn rollouts with an environment (docs/environments.md): an import path
            ``package.module:factory`` (or in Python the factory itself) called with a dataset row (a dict) for each
            trajectory; the environment's ``reset()`` gives the first message(s), its ``step(completion)`` answers
            each model turn with ``(reply, reward, done)`` (``lit_grpo.environments.protocol``). Its rewards add up to
            the trajectory's reward; ``rewards`` (none by default here) are refused beside it unless
            ``add_rewards_to_environment``, which adds their score of the last model turn to it.
            Rows are then handed over as they are (any fields). ``reasoning_gym:<task>`` datasets bring their own.
        add_rewards_to_environment: asks for ``rewards`` to add to an environment's reward (else refused: a config's
            ``[correctness]`` would score a right reasoning-gym answer 2).
        tools: tools the model may call (``package.module:function``, or in Python the functions): type-hinted,
            documented functions whose schemas the chat template renders; calls are parsed from the model's output
            (``multi_turn.tool_call_format``) and their results go back as tool messages. Without an environment,
            the row's ``question`` starts the conversation and the first turn without a tool call ends it
            (``rewards`` score it: ``correctness`` by default).
        multi_turn: the limits and formats of multi-turn rollouts (``max_turns``, ``max_total_tokens``,
            ``tool_timeout_s``, ``tool_call_format``, ``tool_runner``; ``lit_grpo.data.multi_turn.MultiTurnOptions``).
        problem_column, answer_column: read ``dataset`` by its columns (docs/datasets.md): the problem's (default
            ``question``) and the gold answer's (default ``answer``, all its text: LaTeX for ``math_verify``); unset,
            the rows are GSM8K's, the gold after ``####``. A row without the column is refused in one line.
        prompt_template: the user message, the row's columns in braces (``"{problem}\n\nLet's think step by step
            and output the final answer within \\boxed{}."``); unset, the problem as it is.
        chat_template: format prompts with the tokenizer's chat template; ``false``: plain text (a base model).
        dataset_config: a Hub dataset's config (unset: the dataset's default; GSM8K's ``main`` for its own ids).
    """

    def __init__(
        self,
        dataset: str = "bundled",
        split: str = "train",
        prompts_per_step: int = 2,
        num_generations: int = 8,
        micro_batch_size: int = 8,
        micro_batch_tokens: int | None = None,
        max_new_tokens: int = 200,
        temperature: float = 1.0,
        top_p: float = 1.0,
        rewards: list[str | RewardFn] | None = None,
        reward_weights: list[float] | None = None,
        reward_timeout_s: float = 5.0,
        advantage_eps: float = 1e-4,
        scale_rewards: bool = True,
        advantage_std: Literal["population", "bessel"] = "population",
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        engine: str = "transformers",
        engine_options: dict[str, Any] | TransformersOptions | VLLMOptions | ServerOptions | None = None,
        max_prompts: int | None = None,
        reuse_policy_logprobs: bool = True,
        max_staleness: int = 0,
        reference_on_server: bool = False,
        partial_rollouts: bool = False,
        seed: int = 0,
        sampler_check_max_gap: float | None = DEFAULT_MAX_GAP,
        sampler_check_sequences: int = DEFAULT_SEQUENCES,
        dynamic_sampling: DynamicSampling = DynamicSampling(),  # noqa: B008 (frozen: a shared default is safe)
        overlong_penalty: OverlongPenalty = OverlongPenalty(),  # noqa: B008 (frozen)
        environment: str | Callable[[dict], Any] | None = None,
        add_rewards_to_environment: bool = False,
        tools: list[str | Callable[..., Any]] | None = None,
        multi_turn: MultiTurnOptions = MultiTurnOptions(),  # noqa: B008 (frozen)
        problem_column: str | None = None,
        answer_column: str | None = None,
        prompt_template: str | None = None,
        chat_template: bool = True,
        dataset_config: str | None = None,
    ) -> None:
        super().__init__()
        check_sampler_check_options(sampler_check_max_gap, sampler_check_sequences)
        options = engine_setup.checked_engine_options(engine, engine_options, max_staleness, reference_on_server,
                                                      partial_rollouts)
        self.partial_rollouts = partial_rollouts
        check_batch_numbers(num_generations, prompts_per_step, micro_batch_size, micro_batch_tokens, advantage_eps,
                            max_prompts)
        check_advantage_std(advantage_std)
        self.dynamic_sampling = as_group(DynamicSampling, dynamic_sampling, "dynamic_sampling")
        self.overlong_penalty = as_group(OverlongPenalty, overlong_penalty, "overlong_penalty")
        # the sampling first: a max_new_tokens of 0 is refused as itself, not as a length the penalty cannot fit in
        self.sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
        check_overlong_penalty(self.overlong_penalty, max_new_tokens, environment is not None or bool(tools))
        engine_setup.check_engine_sampling(engine, options, temperature, top_p)
        self.multi_turn = as_group(MultiTurnOptions, multi_turn, "multi_turn")
        environment = environment if environment is not None else default_environment(dataset)
        #: multi-turn rollouts (an environment, or tools): built once the tokenizer is known (setup)
        self.environment_factory = resolve_environment(environment) if environment is not None else None
        self.toolbox = ToolBox(tools or [], timeout_s=self.multi_turn.tool_timeout_s,
                               runner=self.multi_turn.tool_runner)
        self.parse_tool_calls = resolve_tool_call_format(self.multi_turn.tool_call_format)
        self.is_multi_turn = self.environment_factory is not None or bool(self.toolbox)
        self.trajectories: TrajectoryRunner | None = None
        self.env_errors = 0
        self.reward_runner = batch_reward_runner(rewards, reward_weights, reward_timeout_s, environment,
                                                 add_rewards_to_environment)
        #: how rows become prompts and golds (``lit_grpo.data.columns``), checked before any row is read
        self.row_format = RowFormat(problem_column, answer_column, prompt_template, chat_template, dataset_config)
        check_row_format(self.row_format, dataset, self.environment_factory is not None, bool(tools))
        self.rows = run_rows(dataset, split, self.row_format, self.reward_runner, self.environment_factory is not None,
                             max_prompts, seed, prompts_per_step)
        self.prompts_per_step = prompts_per_step
        self.num_generations = num_generations
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self.advantage_eps = advantage_eps
        self.scale_rewards = scale_rewards
        self.advantage_std = advantage_std
        #: a reasoning-gym task left with GSM8K's default prompt gets its own (``lit_grpo.data.tasks``)
        self.system_prompt = system_prompt_for(dataset, system_prompt)
        self.engine_kind = engine
        self.engine_options = options
        self.reuse_policy_logprobs = reuse_policy_logprobs
        self.seed = seed
        # engines whose log-probs come from code other than the trainer's: checked once after the first push
        checks = engine == "vllm" or engine == "server"
        self.sampler_check = SamplerCheck(sampler_check_max_gap, sampler_check_sequences) \
            if checks and sampler_check_max_gap is not None else None
        self.consumed = 0
        self.batch_scores: BatchScores | None = None  # the last batch's, for the sampled-completions table
        self.rollout_engine: RolloutEngine | None = None
        self.tokenizer = None
        self._opened_thought: tuple[Any, bool] | None = None  # (tokenizer, whether its prompts open a thought)
        self._prompt_cache: dict[int, list[int]] = {}
        self._epoch_orders: dict[int, list[int]] = {}
        #: the batches of this rank, requested ``max_staleness`` ahead of the trainer (none ahead at K = 0)
        self.async_rollouts = AsyncRollouts(max_staleness, self.rollout_job)
        self.reference_on_server = reference_on_server
        self.scores_reference = False  # set in setup: the server scores pi_ref and the module has a KL term
        #: how pi_ref's log-probs are asked of the server, when it scores them (set in setup)
        self.server_reference: ServerReference | None = None
        self.reward_errors = 0
        self.reward_timeouts = 0
        engine_setup.check_servers_answer(options)

    @property
    def max_staleness(self) -> int:
        """K: how many batches are requested ahead of the one the trainer takes."""
        return self.async_rollouts.max_staleness

    # ---- prompt order (``lit_grpo.data.prompt_order``) ---------------------------------------------
    def rank_and_world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        return trainer.global_rank, trainer.world_size

    @property
    def batches_per_epoch(self) -> int:
        _, world = self.rank_and_world()
        return len(self.rows) // (self.prompts_per_step * world)

    def epoch_order(self, epoch: int) -> list[int]:
        if epoch not in self._epoch_orders:
            self._epoch_orders = {epoch: epoch_permutation(self.seed, epoch, len(self.rows))}
        return self._epoch_orders[epoch]

    def prompt_batch(self, index: int) -> PromptBatch:
        """This rank's share of rollout batch ``index`` (counted over all epochs)."""
        rank, world = self.rank_and_world()
        epoch, b = divmod(index, self.batches_per_epoch)
        rows = rank_share(self.epoch_order(epoch), b, self.prompts_per_step, rank, world)
        return PromptBatch(rows=rows, batch_index=index, rank=rank)

    # ---- Lightning hooks ----------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if stage == "fit":
            self.check_fit(self.trainer.lightning_module)
        if self.rollout_engine is not None:
            return
        module = self.trainer.lightning_module
        for attr in ("policy", "tokenizer"):
            if not hasattr(module, attr):
                raise TypeError(f"RolloutDataModule needs the LightningModule to expose `{attr}`")
        self.tokenizer = module.tokenizer
        self.trajectories = self.trajectory_runner(self.tokenizer)
        self.opened_thought()  # read now, on this thread, before a producer scores a batch
        check_staleness_setup(self.max_staleness, self.engine_kind, self.trainer.callbacks)
        # the server scores pi_ref only when the module has a KL term to use it in
        self.scores_reference = self.reference_on_server and bool(getattr(module, "uses_reference", False))
        engine_setup.check_before_build(module, self.engine_kind, self.engine_options, self.max_staleness,
                                        self.trainer.callbacks, self.reuse_policy_logprobs)
        engine = self.rollout_engine = self.build_engine(module)
        engine_setup.check_after_build(module, engine, self.engine_description())
        if self.scores_reference:
            self.server_reference = engine_setup.server_reference_for(
                engine, module, self.tokenizer, self.trainer.precision, self.micro_batch_size,
                self.micro_batch_tokens, self.sampling)
        engine_setup.hold_batches_through_pushes(engine, self.max_staleness, self.partial_rollouts,
                                                 self.async_rollouts.drain)

    def trajectory_runner(self, tokenizer: Any) -> TrajectoryRunner | None:
        """What samples this data's multi-turn trajectories with ``tokenizer``'s chat template (``None``: single-turn);
        evaluation and ``predict`` run the same one."""
        if not self.is_multi_turn:
            return None
        renderer = ConversationRenderer(tokenizer, self.toolbox.schemas, self.system_prompt)
        return TrajectoryRunner(self.environment_factory, self.toolbox, self.parse_tool_calls, renderer,
                                self.multi_turn)

    def check_fit(self, module: L.LightningModule) -> None:
        """Before any rollout of a fit (``lit_grpo.data.fit_checks``): refuse a module whose loss uses another
        temperature than the rollouts are sampled at; warn when Dr.GRPO's constant normaliser is not
        ``max_new_tokens``, when no callback keeps the rollout engine's weights in step with the policy, and when
        the module packs rows without a token budget to bound them."""
        fit_checks.check_temperature_agrees(module, self.sampling)
        for message in (fit_checks.constant_normaliser_mismatch(module, self.sampling),
                        fit_checks.unsynced_engine_warning(self.trainer.callbacks, module),
                        fit_checks.packing_without_budget(module, self.micro_batch_tokens, self.micro_batch_size)):
            if message is not None:
                rank_zero_warn(message)

    def build_engine(self, module: L.LightningModule) -> RolloutEngine:
        """The rollout engine of ``data.engine`` for ``module``'s policy (``lit_grpo.data.engine_setup``)."""
        trainer = self.trainer
        share = engine_setup.shares_weights(self.engine_options, trainer.callbacks if trainer else [], module,
                                            self.max_staleness, trainer.strategy if trainer else None)
        return engine_setup.build_rollout_engine(self.engine_options, module, self.tokenizer, self.max_staleness,
                                                 self.scores_reference, share)

    def train_dataloader(self) -> DataLoader:
        # batch_size=None: the stream already yields whole batches; num_workers=0: generation needs the
        # trainer's process (weights, device), so Lightning's warning about __len__ with workers cannot apply.
        warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined")
        return PromptLoader(PromptStream(self), batch_size=None, num_workers=0)  # resumable: its docstring

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if isinstance(batch, PromptBatch):
            return self.rollout_batch(batch)
        return batch

    def teardown(self, stage: str) -> None:
        """At the end of a fit, the batches generated ahead are kept (a checkpoint saved after ``fit`` holds them,
        and a further ``fit`` trains on them), then the producer stops."""
        self.async_rollouts.keep_generated()

    def on_exception(self, exception: BaseException) -> None:
        self.async_rollouts.stop()  # no waiting: a request running now ends on its daemon thread, within its timeout

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the data module (``lit_grpo.data.checkpoint_state``)."""
        return data_state(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        restore_data_state(self, state_dict)

    # ---- rollouts -----------------------------------------------------------------------------------
    def precision_context(self) -> AbstractContextManager:
        """The trainer's forward precision for an in-process engine (``engine_setup.precision_context``)."""
        return engine_setup.precision_context(self.trainer, self.engine_kind)

    def prompt_ids(self, row: int) -> list[int]:
        """The prompt of dataset row ``row``: its question in the chat template, or an environment's first messages."""
        if row not in self._prompt_cache:
            self._prompt_cache[row] = self.trajectories.prompt(self.rows[row]) if self.trajectories is not None \
                else self.row_format.prompt_ids(self.tokenizer, self.rows[row]["question"], self.system_prompt)
        return self._prompt_cache[row]

    def opened_thought(self) -> bool:
        """Whether the generation prompt opens a reasoning model's thought (``lit_grpo.data.thinking``), read once per
        tokenizer from the first row's prompt (every prompt ends the same); multi-turn trajectories are judged as
        they are."""
        if self.is_multi_turn:
            return False
        if self._opened_thought is None or self._opened_thought[0] is not self.tokenizer:
            self._opened_thought = (self.tokenizer, prompt_ids_open_thought(self.tokenizer, self.prompt_ids(0)))
        return self._opened_thought[1]

    def module_device(self) -> torch.device:
        """The trainer's device (the CPU outside a trainer): where a batch is built."""
        return self.trainer.lightning_module.device if self.trainer is not None else torch.device("cpu")

    def alpha_logprobs(self, padded: PaddedRollouts, sampled_step: int,
                       mixed: bool = False) -> tuple[torch.Tensor | None, str]:
        """Alpha's log-probs of the batch sampled at version ``sampled_step`` and their source
        (``engine_setup.alpha_logprobs``)."""
        current_step = self.trainer.global_step if self.trainer is not None else None
        return engine_setup.alpha_logprobs(self.rollout_engine, padded, sampled_step, current_step,
                                           self.reuse_policy_logprobs, self.sampling.temperature, mixed)
    def rollout_job(self, index: int) -> Callable[[], Requested]:
        """The request for rollout batch ``index`` of this rank, as ``AsyncRollouts`` hands it over."""
        prompt_batch = self.prompt_batch(index)
        if self.dynamic_sampling.enabled:
            return partial(self.formed_request, prompt_batch)
        return partial(self.request, prompt_batch.rows, rollout_seed(self.seed, index, prompt_batch.rank))

    def request(self, rows: list[int], seed: int) -> Requested:
        """One rank's G completions per prompt with the engine's current weights, and pi_ref's log-probs of them when
        the server scores pi_ref; no collective (a remote engine's ranks agree later, in ``rollout_batch``), so it
        may run on the producer's thread."""
        start = time.perf_counter()
        rollouts = self.sample(rows, seed)
        seconds = time.perf_counter() - start
        if self.server_reference is not None:
            rollouts = self.server_reference([self.prompt_ids(r) for r in rows], rollouts)
        return rollouts, seconds

    def sample(self, rows: list[int], seed: int) -> Rollouts:
        """G completions (or multi-turn trajectories) per dataset row with the engine's current weights (no
        collective: a remote engine's ranks agree later)."""
        if self.trajectories is not None:  # whole trajectories, turn by turn, through the same requests
            # colocated vLLM in sleep mode stays awake across the turns: its KV cache holds the prefixes they reuse
            # a remote engine keeps each group's turns on one server (sticky sessions over several servers)
            release = self.rollout_engine.release_sessions if isinstance(self.rollout_engine, RemoteEngine) else None
            with getattr(self.rollout_engine, "awake", nullcontext)():
                return self.trajectories.run([self.rows[r] for r in rows], self.num_generations, self.engine_request,
                                             self.sampling, seed, release=release)
        return self.engine_request([self.prompt_ids(r) for r in rows], self.num_generations, self.sampling, seed)

    def engine_request(self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int,
                       sessions: list[Hashable] | None = None) -> Rollouts:
        """``n`` completions per tokenized prompt from the rollout engine, as ``Rollouts`` (no collective);
        ``sessions``: each prompt's multi-turn session, for a remote engine's routing."""
        engine = self.rollout_engine
        with self.precision_context():
            if isinstance(engine, RemoteEngine):
                if sessions is not None:
                    return engine.request_rollouts(prompts, n, sampling, seed=seed, sessions=sessions)
                return engine.request_rollouts(prompts, n, sampling, seed=seed)
            return Rollouts(engine.generate(prompts, n, sampling, seed=seed))

    def formed_request(self, prompt_batch: PromptBatch) -> Requested:
        """``request`` with dynamic sampling (``lit_grpo.data.dynamic_sampling.form_batch``): this rank's batch formed
        from groups with a reward spread, scored as they are generated, then pi_ref's log-probs of the kept ones when
        the server scores pi_ref. No collective: each rank forms its own batch, in as many rounds as it needs (every
        rank still yields one batch per step). Its seconds cover every round's generation and scoring."""
        start = time.perf_counter()
        rollouts, formed = form_batch(
            self.dynamic_sampling, self.prompts_per_step, prompt_batch.rows, len(self.rows), self.seed,
            prompt_batch.batch_index, prompt_batch.rank,
            sample=self.sample, score=self.score_groups)
        seconds = time.perf_counter() - start
        if formed is None:
            return rollouts, seconds  # a failed request: the ranks stop together in rollout_batch
        if self.server_reference is not None:
            rollouts = self.server_reference([self.prompt_ids(r) for r in formed.rows], rollouts)
        return rollouts, seconds, formed

    def score_groups(self, rows: list[int], groups: list[list[Completion]]) -> Scored:
        """The rewards of the groups sampled for dataset ``rows`` (flat, prompt-major), the overlong penalty added. A
        trajectory's reward is its environment's, plus the reward functions' score of its last model turn. A
        completion whose thought never ends is flagged truncated here (``batch_rewards.score_completions``)."""
        flat = [c for g in groups for c in g]
        answers = [str(self.rows[r].get("answer", "")) for r in rows for _ in range(self.num_generations)]
        scored = score_completions(self.reward_runner, flat, answers, self.tokenizer,
                                   partial(self.overlong_penalties, groups), self.opened_thought())
        self.count_env_errors(flat, [self.rows[r] for r, g in zip(rows, groups) for _ in g])
        return scored

    def count_env_errors(self, completions: list[Completion], rows: list[dict[str, Any]] | None = None) -> None:
        """Count the trajectories whose environment failed (``rollout/env_errors``;
        ``lit_grpo.data.environment_errors``): warned on the first, the run stopped in one line when every trajectory
        of the first batch failed. ``rows``: each completion's task row, which the line names."""
        tasks = trajectory_tasks(completions, rows)
        if not tasks:
            return
        first_batch, self._env_checked = not getattr(self, "_env_checked", False), True
        name = self.trajectories.environment_name if self.trajectories is not None else "of data.environment"
        self.env_errors += new_environment_errors(tasks, name, first_batch, self.env_errors)

    def overlong_penalties(self, groups: list[list[Completion]]) -> torch.Tensor | None:
        """DAPO eq. 13 per completion (``data.overlong_penalty``), ``None`` when it is off."""
        return overlong_penalties(groups, self.overlong_penalty, self.sampling.max_new_tokens)

    def rollout_batch(self, prompt_batch: PromptBatch) -> RolloutBatch:
        """Rollout batch ``prompt_batch``, the same way whatever K: taken from ``AsyncRollouts`` (requested K batches
        earlier, or now at K = 0), the ranks' agreement that every request succeeded (a remote engine's one
        collective, on this thread), then rewards, advantages and alpha."""
        step = self.trainer.global_step if self.trainer is not None else 0
        engine = self.rollout_engine.to(self.module_device())
        rollouts, generate_seconds, waited, formed = self.async_rollouts.take_formed(prompt_batch.batch_index)
        if formed is not None:  # formed by dynamic sampling: its groups are those of these rows
            prompt_batch = replace(prompt_batch, rows=list(formed.rows))
        if isinstance(engine, RemoteEngine):
            groups = engine.check_lockstep(rollouts)  # every rank raises when any rank's request failed
            sampled_step = min(weight_version_of(c) for g in groups for c in g)  # the versions the server reports
        else:
            groups, sampled_step = rollouts.groups, engine.synced_step
        stats = self.check_sampler(prompt_batch, groups, sampled_step == step)
        if self.max_staleness:
            stats = {**stats, **staleness_stats(groups, step), "trainer_wait_seconds": waited,
                     "producer_waits": float(self.async_rollouts.producer_waits)}
        return self.assemble(prompt_batch, groups, rollouts, sampled_step, generate_seconds, stats, formed)

    def check_sampler(self, prompt_batch: PromptBatch, groups: list[list[Completion]], synced: bool) -> dict:
        """The first-push check (``lit_grpo.data.sampler_check``) on the first batch that the engine sampled with
        the policy's current weights (the ranks agree on which batch that is); its gap and cost as statistics."""
        check = self.sampler_check
        if check is not None:  # a server that rejoined the fleet gets the check of a first push too
            check.rearm(rejoined_servers(self.rollout_engine))
        if check is None or check.done or not everyone(synced):
            return {}
        module = self.trainer.lightning_module
        prompts = [self.prompt_ids(r) for r in prompt_batch.rows]
        report = check(module.policy, prompts, groups, self.sampling.temperature, self.module_device(),
                       self.engine_description(), self.precision_context)
        return {"sampler_check_gap": report.mean_gap, "sampler_check_seconds": report.seconds}

    def engine_description(self) -> str:
        """The rollout engine in words, for messages: colocated vLLM, or the kind and URL of the servers."""
        return engine_setup.engine_description(self.engine_options, self.engine_kind)

    def assemble(self, prompt_batch: PromptBatch, groups: list[list[Completion]], rollouts: Rollouts,
                 sampled_step: int, generate_seconds: float, stats: dict[str, float],
                 formed: Formed | None = None) -> RolloutBatch:
        """The complete batch of one rank's completions: rewards, eq. 2 advantages, padding, alpha (their weight
        version is ``sampled_step``), pi_ref's log-probs from the server (``rollouts.reference``) and the
        statistics, ``stats`` last. ``formed``: the batch was formed by dynamic sampling, which scored it."""
        start = time.perf_counter() - generate_seconds - rollouts.reference_seconds
        prompts = [self.prompt_ids(r) for r in prompt_batch.rows]
        # a batch formed by dynamic sampling was scored where it was formed; its counts are added as it is taken
        scored = Scored(formed.rewards, formed.reward_errors, formed.reward_timeouts) if formed is not None \
            else self.score_groups(prompt_batch.rows, groups)
        self.reward_errors += scored.errors
        self.reward_timeouts += scored.timeouts
        self.batch_scores = BatchScores(prompt_batch.batch_index, [str(self.rows[r].get("answer", ""))
                                                                   for r in prompt_batch.rows], scored.per_function)
        penalties = self.overlong_penalties(groups)
        stats = {**(formed.stats if formed is not None else {}),
                 **({"overlong_penalty": float(penalties.mean())} if penalties is not None else {}),
                 **({**trajectory_stats(groups), "env_errors": float(self.env_errors)} if self.is_multi_turn else {}),
                 **stats}
        padded = pad_rollouts(prompts, groups, pad_token_id(self.tokenizer), self.micro_batch_size,
                              self.module_device(), self.micro_batch_tokens)
        kept = getattr(self.rollout_engine, "kept_weights", None) is not None  # its memory and times go with the batch
        with engine_setup.alpha_precision(self.rollout_engine, self.trainer, self.engine_kind):
            alpha, alpha_source = self.alpha_logprobs(padded, sampled_step, mixes_versions(groups))
        timings = {"rollout_seconds": time.perf_counter() - start, "generate_seconds": generate_seconds,
                   **({"reference_seconds": rollouts.reference_seconds} if self.scores_reference else {}),
                   **(self.rollout_engine.kept_weights_stats() if kept else {})}
        routing = getattr(self.rollout_engine, "routing_stats", None)  # per-server load, prefix-cache hits
        if routing is not None:
            stats = {**routing(), **stats}
        origin = BatchOrigin(
            batch_index=prompt_batch.batch_index, rollout_step=sampled_step, alpha_logp=alpha,
            alpha_source=alpha_source,
            reference=rollouts.reference, reference_offloaded=self.scores_reference,
            stats={**timings, "reward_errors": float(self.reward_errors),
                   "reward_timeouts": float(self.reward_timeouts), **stats})
        batch = collate_rollouts(padded, scored.rewards, self.advantage_eps, self.scale_rewards, origin,
                                 self.advantage_std)
        self.consumed = prompt_batch.batch_index + 1
        return batch

"""``python -m lit_grpo fit --config configs/X.yaml``: LightningCLI over GRPOModule and RolloutDataModule, with the
method's callbacks as config sections of their own and the links that keep one sampling config and one seed.

``validate`` and ``test`` report the ``eval`` section's Pass@k (``validate`` on ``eval.split``, ``test`` on the test
split; :mod:`lit_grpo.evaluation.pass_at_k`) and ``predict`` writes completions to a JSONL file (the ``predictions``
section; :mod:`lit_grpo.cli.predict`). ``--optimizer`` and ``--lr_scheduler`` are not offered (the module's
``model.optimizer`` group builds AdamW and its schedule); ``trainer.gradient_clip_val`` is applied as
``model.gradient_clip_val``; ``trainer.accumulate_grad_batches`` is refused in one line.

:mod:`lit_grpo.cli.commands` is the one entry (``python -m lit_grpo``, ``lit-grpo``, and this module's ``main`` and
``run``, which are its own): it runs ``export``, ``eval`` and ``serve`` without importing Lightning and reaches
:func:`train` for the training subcommands. A bad value ends with one line on stderr and exit status 2; how its key
and source are found is :mod:`lit_grpo.cli.errors`.
"""

from __future__ import annotations

import importlib
import os
import re
import time
import warnings
from typing import Any

from lit_grpo.callbacks import GSM8KPassAtK, HostMemory, RefModelSwap, WeightSync
from lit_grpo.cli.commands import DEBUG_ENV, PROG, TOOLS, UsageError, main, one_line, run
from lit_grpo.cli.errors import OneLineErrorsCLI, held_back, report_usage_errors
from lit_grpo.cli.hooks import build_model_last
from lit_grpo.cli.predict import PredictOptions, prediction_rows, predictions, write_jsonl
from lit_grpo.cli.progress import default_progress_bar, without_flops_summary
from lit_grpo.cli.resume import continue_version
from lit_grpo.cli.run_failures import last_checkpoint, served_models, server_error_in, server_failure_line
from lit_grpo.core.checkpoints import CheckpointError
from lit_grpo.core.quiet import one_line_warnings, quiet_lightning
from lit_grpo.data.datamodule import RolloutDataModule
from lit_grpo.data.fit_checks import decoupled_on_stale_server, stale_sampling
from lit_grpo.engines.vllm_install import TRAINER_SIDE_IMPORTS, alias_refusal, vllm_problem
from lit_grpo.evaluation.pass_at_k import (
    evaluate_pass_at_k_float32,
    evaluation_rows,
    log_pass_at_k,
    pass_at_k_table,
)
from lit_grpo.training.memory_check import UpdateMemoryError
from lit_grpo.training.module import GRPOModule
from lit_grpo.training.precision import check_trainer_precision
from lit_grpo.training.trainer_knobs import trainer_knob_error

# the entry points and the error convention are lit_grpo.cli.commands'; re-exported for callers of
# lit_grpo.cli.lightning_cli
__all__ = ["DEBUG_ENV", "GRPOCLI", "TOOLS", "UsageError", "main", "one_line", "run", "train"]


SEED_ENV = "PL_GLOBAL_SEED"
SEED_RANGE = (0, 2**32 - 1)  # numpy's seeds, the range lightning.seed_everything accepts
#: the section callbacks that Lightning allows once per trainer (one state key each) -> (section, its options)
SECTION_CALLBACKS: dict[type, tuple[str, str]] = {
    WeightSync: ("sync", "e.g. sync.every_n_batches, sync.max_tv"),
    RefModelSwap: ("ref_swap", "e.g. ref_swap.max_swaps, ref_swap.every_n_batches"),
}


def rollout_seed_of(seed_everything: object) -> int:
    """``data.seed`` from ``seed_everything``, the seed Lightning seeds with: an integer is itself; ``true`` (the
    default) is ``$PL_GLOBAL_SEED`` where it is set, as ``lightning.seed_everything()`` reads it, else 0; ``false``
    (no global seeding) leaves the rollouts at the fixed seed 0. A malformed variable also gives 0 here: the CLI
    refuses it in one line (``GRPOCLI.parse_arguments``)."""
    if isinstance(seed_everything, int) and not isinstance(seed_everything, bool):
        return seed_everything
    if seed_everything is True:
        try:
            return int(os.environ.get(SEED_ENV, "0"))
        except ValueError:
            return 0
    return 0


def seed_error(seed: object) -> str | None:
    """What is wrong with an integer ``seed_everything`` (None: nothing; ``true`` / ``false`` are not integers
    here): ``lightning.seed_everything`` takes numpy's seeds, the unsigned 32-bit integers."""
    if isinstance(seed, int) and not isinstance(seed, bool) and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        return f"is out of range; expected an integer seed from {SEED_RANGE[0]} to {SEED_RANGE[1]} (or true, false)"
    return None


def server_kind(engine_options: Any) -> Any:
    """``kind`` of a parsed ``data.engine_options`` (a mapping, or a group given by ``class_path`` and
    ``init_args``), or ``None``."""
    get = getattr(engine_options, "get", None)
    if get is None:
        return getattr(engine_options, "kind", None)
    init_args = get("init_args")
    return init_args.get("kind") if hasattr(init_args, "get") else get("kind")


class GRPOCLI(OneLineErrorsCLI):
    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001
        # The three callbacks of the method are always there, each configured in its own section, so that a
        # Table 1 row is a short file on top of a base config (a second `--config` overrides single keys;
        # a `trainer.callbacks` list could only be replaced whole). Other callbacks go in trainer.callbacks.
        parser.add_lightning_class_args(WeightSync, "sync")
        parser.add_lightning_class_args(RefModelSwap, "ref_swap")
        parser.add_lightning_class_args(GSM8KPassAtK, "eval")
        # process plumbing, opt-in: a long CPU update's freed activations leave the process (less memory, more
        # page faults: docs/speed.md); `host_memory.mmap_threshold_kb: 1024` switches it on
        parser.add_lightning_class_args(HostMemory, "host_memory")
        parser.set_defaults({"host_memory.mmap_threshold_kb": None})
        # evaluation is opt-in on the command line: the callback's own defaults are the paper's full test split x
        # 50 samples, hours on a CPU; a config switches it on with `eval.every_n_optimizer_steps` / `at_end`
        parser.set_defaults({"eval.every_n_optimizer_steps": None, "eval.at_end": False})
        # One sampling config, in `data`: the loss must use the temperature the rollouts were sampled with, and
        # Dr.GRPO's constant normaliser is the generation budget. Evaluation samples like training (the paper's
        # Pass@1) unless `eval.max_new_tokens` / `temperature` / `top_p` say otherwise (None: the training's, read
        # when the fit starts): a reasoning model is evaluated at a budget longer than its training context.
        parser.link_arguments("data.temperature", "model.temperature")
        parser.link_arguments("data.max_new_tokens", "model.max_completion_length")
        for key in ("system_prompt", "chat_template"):
            parser.link_arguments(f"data.{key}", f"eval.{key}")
        # One seed: `seed_everything` also seeds the rollouts (prompt order and sampling), which the data module
        # draws from its own seed so that they do not depend on the global RNG; `true` (a random seed) and
        # `false` leave the rollouts at seed 0.
        parser.link_arguments("seed_everything", "data.seed", compute_fn=rollout_seed_of)

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any):  # noqa: ANN202
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        # add_arguments_to_parser is called for every subcommand alike: predict alone gets its options here
        if subcommand == "predict":
            parser.add_class_arguments(PredictOptions, "predictions")
        return parser

    def parse_arguments(self, parser, args) -> None:  # noqa: ANN001
        super().parse_arguments(parser, args)
        # LightningCLI seeds before anything is built, with a traceback for a seed lightning.seed_everything refuses
        seed = self._subcommand_config().get("seed_everything")
        if (error := seed_error(seed)) is not None:
            raise UsageError(f"seed_everything={seed!r} {error}", self._where("seed_everything"))
        # with seed_everything true it seeds from PL_GLOBAL_SEED
        env = os.environ.get(SEED_ENV)
        if seed is True and env is not None:
            try:
                value = int(env)
            except ValueError:
                raise UsageError(f"{SEED_ENV}={env!r} is not an integer seed", "the environment") from None
            if (error := seed_error(value)) is not None:
                raise UsageError(f"{SEED_ENV}={env!r} {error}", "the environment")

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Any]) -> Any:
        # the default bar counts steps out of max_steps (lit_grpo.cli.progress), unless a bar is given or turned off
        if (bar := default_progress_bar(config, callbacks)) is not None:
            callbacks = [*callbacks, bar]
        trainer = super()._instantiate_trainer(config, callbacks)
        # Lightning's model summary reads FLOPs 0 for a module without an example input: the column is left out
        trainer.callbacks = without_flops_summary(trainer.callbacks)
        return trainer

    def instantiate_classes(self) -> None:
        # build the model last, so that a bad value of the data module or a callback group (cheap to build, and
        # checking their values) fails before a model is loaded
        build_model_last(self._parser(self.subcommand))
        super().instantiate_classes()

    def before_instantiate_classes(self) -> None:
        """Refuse, in one line, values that Lightning or a callback would refuse only after the model loaded."""
        self._check_no_second_section_callback()
        self._map_trainer_knobs()
        self._check_lora_sync()
        if self.subcommand in ("validate", "test", "predict"):
            self._check_one_process()
        if self.subcommand == "fit":
            self._check_vllm()
            self._check_decoupled_server()
        precision = self._subcommand_config().get("trainer.precision")
        if precision is not None:
            try:  # the trainer is built after the model: check its precision before the model loads
                check_trainer_precision(str(precision))
            except ValueError as err:
                raise UsageError(str(err), self._where("trainer.precision")) from err

    def _check_vllm(self) -> None:
        """What vLLM needs, refused before the model loads (vLLM's own errors come after it, as tracebacks): a model
        directory rather than an alias for the colocated engine, and, in this process, a vLLM that fits torch and
        imports (the colocated engine; a ``kind: vllm`` server, whose weight push runs vLLM's trainer side here)."""
        config = self._subcommand_config()
        engine = config.get("data.engine")
        if engine == "vllm":
            refusal = alias_refusal(config.get("model.model_name"))
            if refusal is not None:
                raise UsageError(refusal, self._where("model.model_name"))
            key, problem = "data.engine", vllm_problem("data.engine 'vllm'")
        elif engine == "server" and server_kind(config.get("data.engine_options")) == "vllm":
            key, problem = "data.engine_options", vllm_problem(
                "data.engine_options.kind 'vllm' (its weight push runs vLLM's trainer side in the trainer's process)",
                TRAINER_SIDE_IMPORTS)
        else:
            return
        if problem is not None:
            raise UsageError(problem, self._where(key))

    def _check_decoupled_server(self) -> None:
        """A ratio correction with ``old_policy: decoupled`` on the project's server where batches can be stale
        (``lit_grpo.data.fit_checks.decoupled_on_stale_server``): the data module refuses it once the fit starts,
        after the model loaded; refused here instead, before the data module asks the server anything."""
        config = self._subcommand_config()
        if config.get("data.engine") != "server":
            return
        keys = ("data.max_staleness", "sync.every_n_batches", "sync.delay_batches", "data.reuse_policy_logprobs")
        stale = stale_sampling(*(config.get(key) for key in keys))
        refused = decoupled_on_stale_server(config.get("model.correction"), config.get("data.engine_options"), stale)
        if refused is not None:
            key = next(k for k in keys if stale is not None and stale.startswith(f"{k}="))
            raise UsageError(refused, f"{self._where('model.correction.mode')}; {self._where(key)}")

    def _check_no_second_section_callback(self) -> None:
        # The `sync` and `ref_swap` sections always add a WeightSync and a RefModelSwap; a second one under
        # trainer.callbacks would make Lightning refuse two stateful callbacks of one type, with a message that
        # does not say what to do. (GSM8KPassAtK may appear twice: its state key holds its period.)
        for name in _callback_class_paths(self._subcommand_config().get("trainer.callbacks")):
            module, _, attr = name.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError, ValueError):
                continue  # jsonargparse has checked the path; nothing more to say here
            for section_class, (section, options) in SECTION_CALLBACKS.items():
                if isinstance(cls, type) and issubclass(cls, section_class):
                    raise UsageError(
                        f"a {cls.__name__} under trainer.callbacks would be a second one: the `{section}` section "
                        f"already adds the {section_class.__name__} callback; set its options there ({options}) "
                        f"and remove {cls.__name__} from trainer.callbacks",
                        self._where("trainer.callbacks", exact=True))

    def _map_trainer_knobs(self) -> None:
        """``trainer.gradient_clip_val`` becomes ``model.gradient_clip_val`` (the module clips in its manual
        optimization, where Lightning's own clipping is refused); the knobs with no equivalent are refused."""
        config = self._subcommand_config()
        clip = config.get("trainer.gradient_clip_val")
        refused = trainer_knob_error(None, config.get("trainer.accumulate_grad_batches"),
                                     config.get("trainer.gradient_clip_algorithm"))
        if refused is not None:
            key, message = refused
            raise UsageError(message, self._where(key))
        if clip is None:
            return
        model_clip = config.get("model.gradient_clip_val")
        model_where = self._where("model.gradient_clip_val")
        if model_where != "model.gradient_clip_val" and model_clip != clip:  # both set, to different values
            raise UsageError(f"trainer.gradient_clip_val {clip} and model.gradient_clip_val {model_clip} disagree: "
                             "the module clips with model.gradient_clip_val; set one of them",
                             f"{self._where('trainer.gradient_clip_val')}; {model_where}")
        config["model.gradient_clip_val"] = float(clip)
        config["trainer.gradient_clip_val"] = None

    def _check_lora_sync(self) -> None:
        """``WeightSync`` refuses ``delay_batches`` with a LoRA policy and an engine that takes adapters (every
        ``data.engine`` does) once the fit starts, after the model loaded: refused here instead, in one line."""
        config = self._subcommand_config()
        delay = config.get("sync.delay_batches")
        lora = config.get("model.lora")
        if self.subcommand == "fit" and lora is not None and isinstance(delay, int) and delay > 0:
            raise UsageError(f"sync.delay_batches={delay} with model.lora: a delayed push carries full weights, and "
                             "the rollout engines take a LoRA policy's adapter; expected sync.delay_batches 0 (use "
                             "data.max_staleness for asynchronous rollouts)",
                             f"{self._where('sync.delay_batches')}; {self._where('model.lora')}")

    def _check_one_process(self) -> None:
        config = self._subcommand_config()
        devices, nodes = config.get("trainer.devices"), config.get("trainer.num_nodes") or 1
        several = (isinstance(devices, int) and devices > 1) or (isinstance(devices, str) and devices.isdigit()
                                                                  and int(devices) > 1) or \
            (isinstance(devices, (list, tuple)) and len(devices) > 1) or devices == -1 or int(nodes) > 1
        if several:
            raise UsageError(f"{self.subcommand} runs in one process: set trainer.devices 1 (and trainer.num_nodes 1),"
                             f" got devices={devices!r}, num_nodes={nodes!r}", self._where("trainer.devices"))

    # ---- the --ckpt_path checkpoint, read while parsing (OneLineErrorsCLI) ---------------------------------
    def before_fit(self) -> None:
        """Refuse a checkpoint that this run cannot resume from before Lightning loads it, with a traceback."""
        if (checkpoint := self._checkpoint) is None:
            return
        from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

        strategy = self.trainer.strategy
        if checkpoint.sharded and not isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)):
            raise UsageError(
                f"checkpoint {checkpoint.path} is a sharded directory, which only trainer.strategy "
                f"ModelParallelStrategy or FSDPStrategy can resume from (this run uses {type(strategy).__name__}); "
                "`python -m lit_grpo export` reads it anywhere", self._where("ckpt_path"))
        try:  # the module's layout (pi_ref may not exist yet), against the file
            checkpoint.check_fits(self.model.checkpoint_layout(), strict=self.model.strict_loading)
        except CheckpointError as err:
            raise UsageError(str(err), self._where("ckpt_path")) from err
        if self._resumed_last is not None:  # `ckpt_path last`: log on in the version it resumes
            self._continue_version(self._resumed_last, checkpoint.meta)
        self._checkpoint = None  # Lightning reads the file itself; no need to keep it mapped during training
        held_back.stop()

    def run_failure(self, err: Exception) -> UsageError | None:
        """A rollout server's failure once ``fit`` runs: one line (:mod:`lit_grpo.cli.run_failures`) naming the
        server, the step and the checkpoint to resume from; a micro-batch that cannot fit the memory
        (:mod:`lit_grpo.training.memory_check`), before the first step."""
        if isinstance(err, UpdateMemoryError) and self.subcommand == "fit":
            return UsageError(str(err), self._where("data.micro_batch_tokens"))
        failure = server_error_in(err)
        trainer = getattr(self, "trainer", None)
        if failure is None or trainer is None or self.subcommand != "fit":
            return None
        engine = getattr(self.datamodule, "rollout_engine", None)
        line = server_failure_line(failure, trainer.global_step, str(self.model.hparams.get("model_name")),
                                   [s.url for s in getattr(engine, "servers", None) or []], served_models(engine),
                                   last_checkpoint(trainer, self._subcommand_config().get("ckpt_path")))
        return UsageError(line, self._where("data.engine_options"))

    def _continue_version(self, path: Any, meta: dict) -> None:
        why_not = continue_version(self.trainer.loggers, path, meta)
        if why_not is not None:
            warnings.warn(why_not, stacklevel=1)
            return
        # the folder holds the stopped run's checkpoints: that is what a resume expects, not a mistake to warn of
        warnings.filterwarnings("ignore", message=f"Checkpoint directory {re.escape(str(path.parent))} exists")

    def before_validate(self) -> None:
        """The checkpoint is read by the subcommand itself (its policy only, any layout): nothing to check."""

    before_test = before_predict = before_validate

    def _policy_from_checkpoint(self, policy: Any, prefix: str = "policy.") -> int:
        """Load the ``--ckpt_path`` checkpoint's policy tensors (``prefix``) into ``policy``, as ``validate``,
        ``test`` and ``predict`` read weights; returns the checkpoint's ``global_step`` (0 without a checkpoint).
        A keyword (``last``, ``best``) or a checkpoint that does not fit is a usage error."""
        ckpt_path, checkpoint, self._checkpoint = self._subcommand_config().get("ckpt_path"), self._checkpoint, None
        if ckpt_path and checkpoint is None:
            raise UsageError(f"ckpt_path {ckpt_path!r}: {self.subcommand} reads a checkpoint file or sharded "
                             f"directory; `last` and `best` are resolved by fit only: name the file",
                             self._where("ckpt_path"))
        if checkpoint is not None:
            from lit_grpo.cli.export import tied_aliases

            expected = policy.state_dict()
            try:
                checkpoint.check_fits(expected, prefix=prefix, optional=tied_aliases(policy))
                policy.load_state_dict(checkpoint.tensors(prefix, like=expected), strict=False)
            except CheckpointError as err:
                raise UsageError(str(err), self._where("ckpt_path")) from err
        held_back.stop()
        return int(checkpoint.meta.get("global_step", 0)) if checkpoint is not None else 0

    # ---- validate / test (lit_grpo.evaluation.pass_at_k) and predict (lit_grpo.cli.predict) -------------

    def validate(self, model: GRPOModule, datamodule: Any = None, ckpt_path: str | None = None,
                 verbose: bool = True, **_: Any) -> dict[int, float]:
        """Pass@k of the ``eval`` section on its split (``eval.split``, by default the test split)."""
        return self._pass_at_k(model, self._subcommand_config().get("eval.split"), verbose, datamodule)

    def test(self, model: GRPOModule, datamodule: Any = None, ckpt_path: str | None = None,
             verbose: bool = True, **_: Any) -> dict[int, float]:
        """Pass@k of the ``eval`` section on the test split."""
        return self._pass_at_k(model, "test", verbose, datamodule)

    def _pass_at_k(self, model: GRPOModule, split: str, verbose: bool, datamodule: Any = None) -> dict[int, float]:
        config = self._subcommand_config()
        callback = self.config_init[self.subcommand]["eval"]  # the `eval` section's GSM8KPassAtK
        # environment tasks: whole trajectories with the data section's environment, tools and chat template
        runner = datamodule.trajectory_runner(model.tokenizer) if hasattr(datamodule, "trajectory_runner") else None
        rows = evaluation_rows(config.get("eval.dataset"), split, config.get("eval.num_questions"),
                               environment=runner is not None, fmt=callback.settings.row_format, judge=callback.judge)
        callback.follow_training(getattr(datamodule, "sampling", None))
        device = self._device(model)
        step = self._policy_from_checkpoint(model.policy)
        start = time.perf_counter()
        self.results = evaluate_pass_at_k_float32(model.policy, model.tokenizer, rows, callback.settings,
                                                  callback.judge, device, trajectories=runner)
        seconds = time.perf_counter() - start
        log_pass_at_k(self.trainer.loggers, self.results, step)
        if verbose:
            title = f"{self.subcommand}: {config.get('eval.dataset')} {split} split, weights at step {step}"
            print(pass_at_k_table(self.results, len(rows), callback.settings.num_samples, seconds, title))
        return self.results

    def predict(self, model: GRPOModule, datamodule: RolloutDataModule, ckpt_path: str | None = None,
                **_: Any) -> int:
        """Completions of the ``predictions`` section's prompts, with their rewards, written as JSONL."""
        config = self._subcommand_config()
        options: PredictOptions = self.config_init[self.subcommand]["predictions"]
        runner = datamodule.trajectory_runner(model.tokenizer)  # environment tasks: whole trajectories
        try:  # a bad questions file fails before any sampling
            rows = prediction_rows(options, config.get("data.dataset"), environment=runner is not None)
        except ValueError as err:
            raise UsageError(str(err), self._where("predictions.questions" if options.questions else
                                                   "predictions.split")) from err
        device = self._device(model)
        self._policy_from_checkpoint(model.policy)
        records = predictions(model.policy, model.tokenizer, rows, datamodule.num_generations, datamodule.sampling,
                              datamodule.system_prompt, datamodule.reward_runner, datamodule.seed, device,
                              trajectories=runner)
        count = write_jsonl(records, options.output)
        print(f"predict: wrote {count} prompts x {datamodule.num_generations} completions to {options.output}")
        return count

    def _device(self, model: GRPOModule) -> Any:
        if self.trainer.world_size > 1:  # devices "auto" on a machine with several accelerators
            raise UsageError(f"{self.subcommand} runs in one process, this trainer has {self.trainer.world_size}: "
                             "set trainer.devices 1", self._where("trainer.devices"))
        device = self.trainer.strategy.root_device
        model.policy.to(device)
        return device


def _callback_class_paths(callbacks: Any) -> list[str]:
    """The ``class_path`` of each entry of a parsed ``trainer.callbacks`` value (a list, one entry, or None)."""
    entries = callbacks if isinstance(callbacks, (list, tuple)) else [] if callbacks is None else [callbacks]
    paths = []
    for entry in entries:
        path = entry.get("class_path") if hasattr(entry, "get") else None
        if isinstance(path, str):
            paths.append(path)
    return paths


def train(args: list[str] | None = None) -> GRPOCLI:
    """Run LightningCLI on ``args`` (default: ``sys.argv[1:]``), a training subcommand or none, and return its
    object; a usage error exits with status 2 after one line on stderr."""
    # A checkpoint taken after a training step holds the state after all of that step's optimizer steps,
    # together with the data position and counters of the same moment: exactly what an exact resume needs.
    warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
    quiet_lightning()
    one_line_warnings()  # a warning of the project is one line, and none is glued to the progress bar
    return report_usage_errors(
        # auto_configure_optimizers=False: no --optimizer / --lr_scheduler; the module's `model.optimizer` group
        # builds AdamW and its schedule (cli_errors.NOT_OFFERED says so to whoever asks for them)
        # prog: the usage lines say how the CLI is run, not `__main__.py`
        lambda: GRPOCLI(GRPOModule, RolloutDataModule, save_config_kwargs={"overwrite": True}, args=args,
                        auto_configure_optimizers=False, parser_kwargs={"prog": PROG}))

"""``python -m lit_grpo fit --help``: the options a user sets most, in the order of a config, printed without
LightningCLI (building its parser imports Lightning, torch and the training stack: seconds before a line shows).
``fit --help-all`` (and ``--help`` of ``validate``, ``test`` and ``predict``, or ``fit --help`` with other options)
is LightningCLI's full list. Imports nothing heavy; the defaults shown are checked against the parser's by a test.
"""

from __future__ import annotations

#: the flag that asks a training subcommand for LightningCLI's full help (passed on as ``--help``)
HELP_ALL = "--help-all"
#: (option, its default as YAML, what it sets), in the order of ``fit --print_config``
FIT_OPTIONS: list[tuple[str, str, str]] = [
    ("--config", "", "a YAML config (`python -m lit_grpo configs`); a later one overrides"),
    ("--seed_everything", "true", "the seed, also the rollouts'; true: $PL_GLOBAL_SEED or 0"),
    ("--trainer.accelerator", "auto", "cpu, gpu or auto"),
    ("--trainer.devices", "auto", "devices (processes) to train on"),
    ("--trainer.precision", "null", "32-true (null), bf16-mixed or 16-mixed"),
    ("--trainer.max_steps", "-1", "optimizer steps (-1: trainer.max_epochs decides)"),
    ("--trainer.default_root_dir", "null", "logs and checkpoints (null: the working directory)"),
    ("--model.model_name", "", "required: the policy, an alias, a model folder or a Hub id"),
    ("--model.dtype", "float32", "the policy's dtype"),
    ("--model.beta", "0.0", "the KL weight of eq. 7; 0 loads no reference model"),
    ("--model.iterations_per_batch", "1", "i: updates on each rollout batch"),
    ("--model.gradient_checkpointing", "false", "true or selective: recompute activations (long contexts)"),
    ("--model.loss", "grpo", "grpo, gspo, cispo, the REC / RED / REP family (docs/losses.md)"),
    ("--model.lora", "null", "LoRA adapters instead of every weight, {r: 8} (docs/lora.md)"),
    ("--model.packing", "false", "each micro-batch as one packed row, no padding (with micro_batch_tokens)"),
    ("--model.head_chunk_mb", "256.0", "the lm head's chunk of tokens, MiB of logits (null: all at once)"),
    ("--model.attn_implementation", "null", "sdpa, eager, flex_attention, flash_attention_2 (a GPU)"),
    ("--model.optimizer.lr", "1.0e-06", "AdamW's learning rate"),
    ("--data.dataset", "bundled", "bundled (GSM8K), a jsonl/parquet file, a Hub id, synthetic:TASK"),
    ("--data.prompts_per_step", "2", "prompts per rollout batch per process"),
    ("--data.num_generations", "8", "G: completions per prompt (>= 2)"),
    ("--data.micro_batch_size", "8", "completions per forward/backward pass"),
    ("--data.micro_batch_tokens", "null", "tokens per forward/backward pass instead (long completions)"),
    ("--data.max_new_tokens", "200", "the completion budget, in tokens"),
    ("--data.temperature", "1.0", "the sampling temperature (the loss uses it too)"),
    ("--data.rewards", "null", "correctness, format, or package.module:function"),
    ("--data.engine", "transformers", "who samples: transformers (in process), vllm, server"),
    ("--data.max_staleness", "0", "K: batches sampled ahead of the update (docs/async.md)"),
    ("--sync.every_n_batches", "1", "v: batches between weight syncs (1: on-policy)"),
    ("--ref_swap.max_swaps", "null", "S: the most times pi_ref is replaced by the policy"),
    ("--eval.every_n_optimizer_steps", "null", "Pass@k every N optimizer steps (null: never)"),
    ("--eval.num_samples", "50", "samples per question of Pass@k"),
    ("--eval.max_new_tokens", "null", "the evaluation's token budget (null: data.max_new_tokens)"),
    ("--host_memory.mmap_threshold_kb", "null", "on a CPU, 1024: freed activations leave the process"),
    ("--ckpt_path", "null", "resume from a checkpoint file or sharded directory"),
]


def fit_help(prog: str) -> str:
    """The text of ``fit --help``: usage, :data:`FIT_OPTIONS` with their defaults, and where the rest is."""
    width = max(len(option) for option, _, _ in FIT_OPTIONS)
    default_width = max(len(default) for _, default, _ in FIT_OPTIONS)
    lines = [f"usage: {prog} fit [--config CONFIG ...] [--KEY VALUE ...]", "",
             "train the policy with GRPO; the options set most often (a config sets the same keys, nested):", "",
             f"  {'option':<{width}}  {'default':<{default_width}}  what it sets"]
    lines += [f"  {option:<{width}}  {default:<{default_width}}  {what}" for option, default, what in FIT_OPTIONS]
    lines += ["", f"Every option, with its type and default: {prog} fit {HELP_ALL}",
              f"A config with every default: {prog} fit --print_config"]
    return "\n".join(lines)


def help_request(argv: list[str]) -> str | None:
    """Which help a command line asks for: ``"short"`` for exactly ``fit --help`` (or ``-h``), ``"all"`` for a
    training subcommand with :data:`HELP_ALL`, None otherwise (LightningCLI answers any other ``--help``)."""
    if argv[:1] == ["fit"] and argv[1:] in (["--help"], ["-h"]):
        return "short"
    if argv[:1] and argv[0] in ("fit", "validate", "test", "predict") and HELP_ALL in argv[1:]:
        return "all"
    return None

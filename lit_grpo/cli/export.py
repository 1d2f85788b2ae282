"""``python -m lit_grpo export CKPT OUT_DIR``: the trained policy of a checkpoint as a Hugging Face model directory;
``python -m lit_grpo export --model ALIAS OUT_DIR``: the same for a model alias (``smollm2-135m-instruct``, ...).

The directory holds the policy's weights (safetensors), ``config.json`` and the tokenizer files, so
``AutoModelForCausalLM.from_pretrained(OUT_DIR)``, ``vllm serve OUT_DIR`` or an evaluation harness take it as
is. The reference model and the optimizer state stay behind. A LoRA policy (``model.lora``) is written merged (base
plus adapter, a plain model) by default, or with ``--adapter-only`` as its adapter in peft's format
(``adapter_config.json``, ``adapter_model.safetensors``) with the base it applies to beside it, in ``OUT_DIR/base``
(:func:`lit_grpo.models.adapter_export.export_adapter`); after stage swaps that adapter stacks the merged ones
(``lit_grpo.models.lora.cumulative_adapter``), so it applies to the starting base, which is the one written.
``peft.AutoPeftModelForCausalLM.from_pretrained(OUT_DIR)`` loads it: the adapter's ``base_model_name_or_path`` is
the Hub id the policy started from, or else (an alias, a local directory) the absolute path of ``OUT_DIR/base``;
peft reads a relative path against the working directory, so after moving the directory load it as
``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(OUT_DIR / "base"), OUT_DIR)``.
``CKPT`` is a ``.ckpt`` file or a sharded checkpoint directory written by ``ModelParallelStrategy`` (see
:mod:`lit_grpo.core.checkpoints`).

vLLM (``data.engine: vllm``, ``vllm serve``) loads a Hub id or a model directory, not lit_grpo's aliases, which are
built in memory or converted on first use (:mod:`lit_grpo.models.loading`); ``--model ALIAS`` writes the alias's weights
as such a directory. Its ``generation_config.json`` holds the special token ids and no sampling values
(``temperature``, ``top_k``, ...), which vLLM would take as its default sampling settings.

torch, transformers and the checkpoint reader are imported by the functions that use them, after the arguments
are parsed, so that ``export --help`` and a bad argument answer without loading them.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lit_grpo.cli.commands import ToolParser

if TYPE_CHECKING:
    from torch import nn

POLICY_PREFIX = "policy."  # GRPOModule keeps the policy in `self.policy`


def tied_aliases(model: nn.Module) -> set[str]:
    """Names under which a tensor already listed under another name appears again (tied input and output
    embeddings): a checkpoint may store only one of them."""
    first = set(dict(model.named_parameters()))
    return {name for name, _ in model.named_parameters(remove_duplicate=False) if name not in first}


def load_policy_from_checkpoint(checkpoint: str | Path):  # noqa: ANN201 - (model, tokenizer)
    """The policy of a GRPOModule checkpoint as a Hugging Face model with its tokenizer (see
    :func:`load_policy_and_hparams`)."""
    model, tokenizer, _ = load_policy_and_hparams(checkpoint)
    return model, tokenizer


def load_policy_and_hparams(checkpoint: str | Path):  # noqa: ANN201 - (model, tokenizer, hyper_parameters)
    """The policy of a GRPOModule checkpoint as a Hugging Face model with its tokenizer, and the checkpoint's
    ``hyper_parameters``.

    The model and tokenizer are rebuilt from the checkpoint's ``hyper_parameters`` (``model_name``, ``dtype``)
    with :func:`lit_grpo.models.loading.load_model_and_tokenizer` (a peft model with its LoRA adapter and merge log when
    ``lora`` is set), then given the checkpoint's policy weights. Raises
    :class:`CheckpointError` (a ``ValueError``) naming the file when it cannot be read or does not fit.
    """
    from lit_grpo.core.checkpoints import Checkpoint, CheckpointError
    from lit_grpo.models.loading import load_model_and_tokenizer

    ckpt = Checkpoint(checkpoint)
    hp = ckpt.hyper_parameters
    model_name = hp.get("model_name")
    if not isinstance(model_name, str) or not model_name:
        raise CheckpointError(
            f"checkpoint {ckpt.path} has no hyper_parameters.model_name: expected a checkpoint of a GRPOModule"
        )
    if not ckpt.shapes(POLICY_PREFIX):
        raise CheckpointError(f"checkpoint {ckpt.path} holds no '{POLICY_PREFIX}*' tensors: no policy to export")
    model, tokenizer = load_model_and_tokenizer(model_name, hp.get("dtype", "float32"))
    if hp.get("lora") is not None:
        from lit_grpo.core.option_groups import as_group
        from lit_grpo.models.lora import LoraArgs, apply_lora, merge_log

        model = apply_lora(model, as_group(LoraArgs, hp["lora"], "lora"))
        merge_log(model).load_state_dict(ckpt.meta.get("lora_merge_log", {"entries": []}))
        model.peft_config["default"].base_model_name_or_path = model_name  # what an adapter export names as its base
    expected = model.state_dict()
    aliases = tied_aliases(model)
    ckpt.check_fits(expected, prefix=POLICY_PREFIX, optional=aliases)
    missing, unexpected = model.load_state_dict(ckpt.tensors(POLICY_PREFIX, like=expected), strict=False)
    if set(missing) - aliases or unexpected:  # check_fits rules this out; a silent partial load must not happen
        raise CheckpointError(f"checkpoint {ckpt.path}: loading left {missing or unexpected} unmatched")
    return model, tokenizer, hp


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, adapter_only: bool = False) -> Path:
    """Write the policy of a GRPOModule checkpoint to ``out_dir`` as a Hugging Face model directory (see
    :func:`load_policy_from_checkpoint`); a LoRA policy merged, or with ``adapter_only`` its adapter alone in
    peft's format (stacked with the merges of its stage swaps, so that it applies to the starting base)."""
    from lit_grpo.models.adapter_export import export_adapter
    from lit_grpo.models.lora import is_lora, merge_adapter_into_base

    model, tokenizer, hp = load_policy_and_hparams(checkpoint)
    lora = is_lora(model)
    if adapter_only and not lora:
        raise ValueError(f"--adapter-only: checkpoint {checkpoint} holds no LoRA adapter (it was trained without "
                         "model.lora); expected a LoRA checkpoint, or export without --adapter-only")
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    if adapter_only:
        return export_adapter(model, tokenizer, hp["model_name"], hp.get("dtype", "float32"), out)
    if lora:
        merge_adapter_into_base(model)  # base + scale * B @ A, as a push to an engine without adapters sends it
        model.unload().save_pretrained(out)
    else:
        model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def check_alias(name: str) -> None:
    """Refuse a ``--model`` that is not one of :data:`lit_grpo.models.loading.ALIASES` in one line."""
    from lit_grpo.models.loading import ALIASES

    if name not in ALIASES:
        raise ValueError(f"--model {name!r} is not a model alias; expected one of {', '.join(ALIASES)} (a Hub id or "
                         "a local model directory needs no export: vLLM and from_pretrained load it as is)")


def export_alias(name: str, out_dir: str | Path) -> Path:
    """Write the model alias ``name`` (float32 weights, its tokenizer, a generation config without sampling values:
    :func:`neutral_generation_config`) to ``out_dir`` as a Hugging Face model directory that
    ``from_pretrained``, ``vllm.LLM`` and ``vllm serve`` load. An alias built on first use (``arith-tiny-sft``) is
    built now."""
    check_alias(name)
    from lit_grpo.models.adapter_export import neutral_generation_config
    from lit_grpo.models.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(name, "float32")
    model.generation_config = neutral_generation_config(model, tokenizer)
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The ``export`` arguments (no heavy import: ``--help`` prints from here)."""
    parser = ToolParser(
        prog="python -m lit_grpo export",
        usage="python -m lit_grpo export [-h] [--adapter-only] checkpoint out_dir | --model ALIAS out_dir",
        description="Write the policy of a checkpoint, or a model alias, as a Hugging Face model directory "
        "(safetensors weights, config.json, generation_config.json, tokenizer files) that from_pretrained, "
        "vllm.LLM and vllm serve load.",
    )
    # `checkpoint` is optional to argparse only so that `--model ALIAS out_dir` parses; main() requires one of them
    parser.add_argument("checkpoint", nargs="?",
                        help="a .ckpt file, or a sharded checkpoint directory (ModelParallelStrategy)")
    parser.add_argument("out_dir", help="directory to write (created if needed; files of the same name are replaced)")
    parser.add_argument("--model", metavar="ALIAS",
                        help="instead of a checkpoint: a model alias (smollm2-135m-instruct, tiny-random-llama, "
                             "arith-tiny-sft), written as a directory for vLLM (data.engine vllm, vllm serve)")
    parser.add_argument("--adapter-only", action="store_true",
                        help="a LoRA checkpoint: write its adapter in peft's format instead of the merged model, with "
                             "the base it applies to in out_dir/base")
    return parser


def main(argv: Sequence[str]) -> Path:
    """The ``export`` subcommand; errors are raised for the CLI to print."""
    parser = build_parser()
    args = parser.parse_args(list(argv))
    if args.model is None and args.checkpoint is None:
        # argparse gave the one path to out_dir; without --model it is the checkpoint, and out_dir is missing
        parser.error("the following arguments are required: out_dir")
    if args.model is not None and args.checkpoint is not None:
        parser.error(f"--model {args.model} and checkpoint {args.checkpoint} exclude each other: export either a "
                     "checkpoint or a model alias")
    if args.model is not None and args.adapter_only:
        parser.error("--adapter-only needs a LoRA checkpoint; a model alias has no adapter")
    if args.model is not None:
        out = export_alias(args.model, args.out_dir)
    else:
        out = export_checkpoint(args.checkpoint, args.out_dir, adapter_only=args.adapter_only)
    print(f"wrote {out}")
    return out

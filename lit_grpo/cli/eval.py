"""``python -m lit_grpo eval (--model M | --ckpt CKPT)``: Pass@k of a model or a checkpoint's policy, without
training.

It runs :func:`lit_grpo.evaluation.pass_at_k.evaluate_pass_at_k`, the implementation behind the ``GSM8KPassAtK``
callback and the training CLI's ``validate`` and ``test``, with the callback's defaults (judge, prompts, chunking and
seeding), so all of them report the same numbers for the same weights and settings. Prints the table they print and
writes it as JSON.

The parser is built before anything heavy is imported (torch, the data and evaluation modules are imported once
the arguments parse), so that ``eval --help`` and a bad argument answer without loading them.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

from lit_grpo.cli.commands import ToolParser


def parse_ks(text: str) -> tuple[int, ...]:
    try:
        ks = tuple(int(k) for k in text.split(",") if k.strip())
    except ValueError:
        raise ValueError(f"--ks must be comma-separated integers such as 1,8, got {text!r}") from None
    if not ks:
        raise ValueError(f"--ks must name at least one k, got {text!r}")
    return ks


def build_parser() -> argparse.ArgumentParser:
    parser = ToolParser(prog="python -m lit_grpo eval",
                     description="Pass@k of a model or of a checkpoint's policy on GSM8K test (or another dataset).")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="model alias, local directory (e.g. an exported one) or Hub id")
    source.add_argument("--ckpt", help="a training checkpoint (.ckpt file or sharded directory)")
    parser.add_argument("--dataset", default="bundled", help="as data.dataset (default: the bundled GSM8K)")
    parser.add_argument("--split", default="test")
    parser.add_argument("--problem_column", default=None, help="the column holding the problem (e.g. problem)")
    parser.add_argument("--answer_column", default=None, help="the column holding the gold answer (e.g. answer)")
    parser.add_argument("--prompt_template", default=None,
                        help="the user message, the row's columns in braces, e.g. '{problem} Put the answer in "
                             "\\boxed{}.'")
    parser.add_argument("--dataset_config", default=None, help="a Hub dataset's config (default: its default)")
    parser.add_argument("--no_chat_template", action="store_true", help="plain-text prompts (a base model)")
    parser.add_argument("--num_questions", type=int, default=None, help="first N questions (default: all)")
    parser.add_argument("--num_samples", type=int, default=50, help="samples per question (the paper: 50)")
    parser.add_argument("--ks", default="1", help="comma-separated k values, e.g. 1,8")
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--questions_per_chunk", type=int, default=4)
    parser.add_argument("--no_system_prompt", action="store_true", help="no system message (the tiny model's way)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--judge", default="correctness",
                        help="reward that decides correctness (> 0.5): a name or module:function")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default=None, help="default: cuda where available, else cpu")
    parser.add_argument("--output", default="pass_at_k.json", help="JSON file to write")
    return parser


def load_policy(args: argparse.Namespace):  # noqa: ANN201 - (model, tokenizer)
    if args.model:
        from lit_grpo.models.loading import load_model_and_tokenizer

        return load_model_and_tokenizer(args.model, args.dtype)
    from lit_grpo.cli.export import load_policy_from_checkpoint

    return load_policy_from_checkpoint(args.ckpt)


def main(argv: Sequence[str]) -> dict:
    """The ``eval`` subcommand: every bad value raises ``ValueError`` before the model is loaded."""
    args = build_parser().parse_args(list(argv))
    if args.num_questions is not None and args.num_questions < 1:
        raise ValueError(f"--num_questions must be >= 1, got {args.num_questions}")
    ks = parse_ks(args.ks)
    from lit_grpo.data.tasks import default_environment

    if default_environment(args.dataset) is not None:  # its prompt and scorer are its environment's, not GSM8K's
        raise ValueError(f"--dataset {args.dataset!r} is an environment's task; this command samples GSM8K-style "
                         f"questions with GSM8K's prompt and judge. Expected: python -m lit_grpo validate "
                         f"--data.dataset {args.dataset} --eval.dataset {args.dataset} (with --model.model_name or "
                         f"--ckpt_path), which samples through the task's environment as training does")
    import torch

    from lit_grpo.core.checkpoints import CheckpointError
    from lit_grpo.data.columns import RowFormat
    from lit_grpo.data.prompts import DEFAULT_SYSTEM_PROMPT
    from lit_grpo.data.rewards import RewardRunner
    from lit_grpo.engines.base import SamplingConfig
    from lit_grpo.evaluation.pass_at_k import PassAtKSettings, evaluate_pass_at_k, evaluation_rows, pass_at_k_table

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    fmt = RowFormat(args.problem_column, args.answer_column, args.prompt_template, not args.no_chat_template,
                    args.dataset_config)
    settings = PassAtKSettings(
        num_samples=args.num_samples, ks=ks,
        sampling=SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p),
        questions_per_chunk=args.questions_per_chunk,
        system_prompt=None if args.no_system_prompt else DEFAULT_SYSTEM_PROMPT, seed=args.seed, row_format=fmt,
    )
    judge = RewardRunner([(args.judge, 1.0)])  # an unknown reward fails here, before the model loads
    # read as the training's rows are (columns, template, golds the judge checks), in one line if not
    rows = evaluation_rows(args.dataset, args.split, args.num_questions, fmt=fmt, judge=judge, section="--")
    if args.ckpt and not Path(args.ckpt).exists():
        raise CheckpointError(f"checkpoint {args.ckpt} does not exist")
    model, tokenizer = load_policy(args)
    model.to(device)
    start = time.perf_counter()
    results = evaluate_pass_at_k(model, tokenizer, rows, settings, judge=judge, device=device)
    seconds = time.perf_counter() - start
    report = {"source": args.model or args.ckpt, "dataset": args.dataset, "split": args.split, "judge": args.judge,
              "questions": len(rows), "num_samples": args.num_samples, "temperature": args.temperature,
              "max_new_tokens": args.max_new_tokens, "seed": args.seed, "seconds": seconds,
              "pass_at_k": {str(k): v for k, v in results.items()}}
    print(pass_at_k_table(results, len(rows), args.num_samples, seconds))
    Path(args.output).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.output}")
    return report

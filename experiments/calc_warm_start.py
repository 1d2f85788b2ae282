"""Where GRPO starts on the calculator demo: the ``calc-tiny-sft`` warm start, sampled at temperature 1 through the
whole two-turn procedure on held-out ``synthetic:mul_2digit`` questions.

For each of ``--questions`` test questions, ``--samples`` first turns are sampled. A first turn that calls the
``calculator`` tool (Hermes ``<tool_call>``) gets the tool's answer as a tool message, rendered as the multi-turn
driver renders it (``ConversationRenderer.continuation``), and one second turn is sampled after it; a first turn
without a call is the answer. Reported: the share of first turns that call the tool, the accuracy of the calls
(the expression is the question's product) and of the trajectories that call it, the accuracy of direct answers,
and Pass@1 of the whole procedure (the final turn judged by the ``correctness`` reward).

    OMP_NUM_THREADS=1 python experiments/calc_warm_start.py                  # the calc-tiny-sft alias
    OMP_NUM_THREADS=1 python experiments/calc_warm_start.py --tool-fraction 0.3 --steps 600   # another warm start

A config other than the alias's is trained on first use and cached like it (its own key).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from lit_grpo.data.rewards import correctness_reward
from lit_grpo.data.synthetic import generate_problems
from lit_grpo.engines.base import SamplingConfig
from lit_grpo.engines.transformers_engine import TransformersEngine
from lit_grpo.environments.calculator import calculator
from lit_grpo.environments.rendering import ConversationRenderer
from lit_grpo.environments.tool_calls import ToolCallError, parse_hermes
from lit_grpo.environments.tools import ToolBox
from lit_grpo.training.warm_start import CALC_TINY_SFT, load_warm_started


def measure(model: torch.nn.Module, tokenizer, task: str, questions: int, samples: int, seed: int,  # noqa: ANN001
            max_new_tokens: int = 96) -> dict[str, float]:
    """The starting point's numbers (see the module docstring) for ``questions`` test problems x ``samples``."""
    problems = generate_problems(task)["test"][:questions]
    renderer = ConversationRenderer(tokenizer)
    tools = ToolBox([calculator])
    eos = tokenizer.eos_token_id
    engine = TransformersEngine(model, [eos], tokenizer.pad_token_id, copy_weights=False, decode="dynamic")
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=1.0)
    prompts = [renderer.prompt([{"role": "user", "content": p.question}]) for p in problems]
    first = engine.generate([ids for ids, _ in prompts], samples, sampling, seed)
    direct, direct_right, calls, calls_right, second_prompts, pending = 0, 0, 0, 0, [], []
    for problem, (prompt, prompt_text), group in zip(problems, prompts, first):
        for completion in group:
            turn_text = renderer.decode(completion.token_ids)
            content = turn_text.removesuffix(tokenizer.eos_token)
            try:
                parsed = parse_hermes(content)
            except ToolCallError:
                parsed = None  # a broken call: the model gets an error and answers on, as in a rollout
            if parsed == []:
                direct += 1
                direct_right += correctness_reward(content, str(problem.result)) == 1.0
                continue
            calls += 1
            if parsed and parsed[0].arguments.get("expression") == problem.expression:
                calls_right += 1
            result = tools.call(parsed[0]).text if parsed else "Error: the tool call is not valid JSON"
            conversation = [{"role": "user", "content": problem.question}, {"role": "assistant", "content": content}]
            reply = renderer.continuation(conversation, [{"role": "tool", "content": result}],
                                          prompt_text + turn_text, turn_text)
            second_prompts.append(prompt + completion.token_ids + reply.token_ids)
            pending.append(problem)
    tool_right = 0
    if second_prompts:
        second = engine.generate(second_prompts, 1, sampling, seed + 1)
        for problem, (completion,) in zip(pending, second):
            text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            tool_right += correctness_reward(text, str(problem.result)) == 1.0
    total = questions * samples
    return {"tool_call_rate": calls / total, "call_expression_accuracy": calls_right / max(calls, 1),
            "accuracy_with_tool": tool_right / max(calls, 1), "accuracy_direct": direct_right / max(direct, 1),
            "pass_at_1": (tool_right + direct_right) / total, "calls": calls, "direct": direct}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tool-fraction", type=float, default=CALC_TINY_SFT.tool_fraction)
    parser.add_argument("--copy-fraction", type=float, default=CALC_TINY_SFT.copy_fraction)
    parser.add_argument("--label-smoothing", type=float, default=CALC_TINY_SFT.label_smoothing)
    parser.add_argument("--steps", type=int, default=CALC_TINY_SFT.steps)
    parser.add_argument("--task", default=CALC_TINY_SFT.task)
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed")
    args = parser.parse_args()
    config = dataclasses.replace(CALC_TINY_SFT, tool_fraction=args.tool_fraction, copy_fraction=args.copy_fraction,
                                 task=args.task,
                                 label_smoothing=args.label_smoothing, steps=args.steps)
    start = time.perf_counter()
    model, tokenizer = load_warm_started(config)
    loaded = time.perf_counter() - start
    torch.manual_seed(args.seed)
    numbers = measure(model, tokenizer, config.task, args.questions, args.samples, args.seed)
    print(json.dumps({"config": dataclasses.asdict(config), "key": config.key(), "load_or_build_s": round(loaded, 1),
                      **{k: round(v, 4) if isinstance(v, float) else v for k, v in numbers.items()}}, indent=1))


if __name__ == "__main__":
    main()

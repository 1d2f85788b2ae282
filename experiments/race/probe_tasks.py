"""Find reasoning-gym tasks a real pretrained model answers some of the time: a held-out score at step 0 between
0.05 and 0.5, the range where GRPO's groups have a spread to learn from (docs/race.md).

For each candidate (task spec, system prompt) it samples ``--samples`` completions of ``--questions`` test questions
at ``--temperature`` (1 by default) with ``--max-new-tokens`` new tokens, scores them with the task's own
``score_answer`` (``lit_grpo.environments.reasoning_gym.score_completion``) and prints the mean score and the
fraction of completions that wrote ``<answer>`` tags at all (the score is the task's own, partial credit included;
``accuracy`` the share of completions scored above 0.5). Results go to ``experiments/results/race/probe.json``; the
race's document lists what was tried.

    python experiments/race/probe_tasks.py                           # every candidate below
    python experiments/race/probe_tasks.py --only spell_backward     # candidates whose spec contains this
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from race_config import PROMPTS, system_prompt_of, user_message

from lit_grpo.data.prompts import prompt_ids
from lit_grpo.engines.base import SamplingConfig
from lit_grpo.engines.transformers_engine import TransformersEngine
from lit_grpo.environments.reasoning_gym import extract_answer, load_rows, score_completion
from lit_grpo.models.loading import eos_token_ids, load_model_and_tokenizer, pad_token_id

CANDIDATES = [
    "reasoning_gym:spell_backward:min_word_len=3:max_word_len=4",
    "reasoning_gym:spell_backward:min_word_len=3:max_word_len=5",
    "reasoning_gym:basic_arithmetic:min_terms=2:max_terms=2:min_digits=1:max_digits=1",
    "reasoning_gym:basic_arithmetic:min_terms=2:max_terms=2:min_digits=1:max_digits=1:operators=+",
    "reasoning_gym:basic_arithmetic:min_terms=2:max_terms=3:min_digits=1:max_digits=2",
    "reasoning_gym:chain_sum:min_terms=2:max_terms=2:min_digits=1:max_digits=1",
    "reasoning_gym:letter_counting:min_words=3:max_words=5",
    "reasoning_gym:leg_counting:min_animals=1:max_animals=2:min_instances=1:max_instances=2",
    "reasoning_gym:number_sorting:min_numbers=3:max_numbers=3:min_decimals=0:max_decimals=0:min_value=0:max_value=99",
    "reasoning_gym:gcd:min_numbers=2:max_numbers=2:min_value=1:max_value=20",
    "reasoning_gym:count_bits:min_n=1:max_n=15",
    "reasoning_gym:word_sorting:min_words=3:max_words=3",
    "reasoning_gym:letter_jumble:min_word_len=3:max_word_len=4:min_words=1:max_words=1",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--questions", type=int, default=24)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--prompts", nargs="+", default=["oneshot"], choices=[*sorted(PROMPTS), "oneshot"])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--only", default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", default="experiments/results/race/probe.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(args.model)
    model.eval()
    engine = TransformersEngine(model, eos_token_ids(tokenizer, model), pad_token_id(tokenizer), copy_weights=False)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    path = Path(args.output)
    results = json.loads(path.read_text()) if path.exists() else []
    for spec in CANDIDATES:
        if args.only and args.only not in spec:
            continue
        spec = spec + ":size=1000:test_size=200"
        rows = load_rows(spec, "test")[: args.questions]
        for prompt in args.prompts:
            start = time.perf_counter()
            ids = [prompt_ids(tokenizer, user_message(row), system_prompt_of(prompt, spec)) for row in rows]
            groups = engine.generate(ids, args.samples, sampling, seed=1234)
            texts = [[tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in g] for g in groups]
            scores = [score_completion(t, row) for row, g in zip(rows, texts) for t in g]
            tagged = [extract_answer(t) is not None for g in texts for t in g]
            record = {"spec": spec, "prompt": prompt, "model": args.model, "questions": len(rows),
                      "samples": args.samples, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                      "mean_score": sum(scores) / len(scores),
                      "accuracy": sum(s > 0.5 for s in scores) / len(scores), "tagged": sum(tagged) / len(tagged),
                      "seconds": round(time.perf_counter() - start, 1), "example": texts[0][0][:200]}
            key = (spec, prompt, args.model, args.temperature)
            results = [r for r in results if (r["spec"], r["prompt"], r["model"], r["temperature"]) != key]
            results.append(record)
            print(f"{record['mean_score']:.3f} (exact {record['accuracy']:.3f})  tagged {record['tagged']:.2f}  "
                  f"{record['seconds']:6.1f}s  {prompt:7s} "
                  f"{spec}", flush=True)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""The one evaluator of the race: held-out accuracy of saved weights, the same for every side and step.

It loads the race's model once, then for each saved file loads its weights into it and samples
``eval_samples`` completions of each of the first ``eval_questions`` test questions of the task (never a train
question) at the training temperature and completion budget, with the same seed for every file. Accuracy is the
share of completions the task's own scorer gives more than 0.5 (reasoning-gym gives 1.0 for a right answer).
Step 0, the model before training, is the same for every row: it is evaluated once per task and settings and
kept in ``base_eval.json`` beside the runs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from race_config import RaceConfig, reward, system_prompt_of, test_rows, user_message
from safetensors.torch import load_file

EVAL_KEYS = ("task", "prompt", "model", "max_new_tokens", "temperature", "eval_questions", "eval_samples",
             "eval_seed")


def eval_settings(config: RaceConfig) -> dict[str, Any]:
    return {key: getattr(config, key) for key in EVAL_KEYS}


class Evaluator:
    def __init__(self, config: RaceConfig) -> None:
        from lit_grpo.data.prompts import prompt_ids
        from lit_grpo.engines.base import SamplingConfig
        from lit_grpo.engines.transformers_engine import TransformersEngine
        from lit_grpo.models.loading import eos_token_ids, load_model_and_tokenizer, pad_token_id

        self.config = config
        self.model, self.tokenizer = load_model_and_tokenizer(config.model, "float32")
        self.model.eval()
        self.base = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.engine = TransformersEngine(self.model, eos_token_ids(self.tokenizer, self.model),
                                         pad_token_id(self.tokenizer), copy_weights=False)
        self.sampling = SamplingConfig(max_new_tokens=config.max_new_tokens, temperature=config.temperature)
        self.rows = test_rows(config)
        system = system_prompt_of(config.prompt, config.task)
        self.prompts = [prompt_ids(self.tokenizer, user_message(row), system) for row in self.rows]

    def load(self, path: Path | None) -> None:
        """The weights of ``path`` (None: the model before training)."""
        state = self.base if path is None else load_file(str(path))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        if unexpected or set(missing) - tied:
            raise ValueError(f"{path}: missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")

    @torch.no_grad()
    def accuracy(self, path: Path | None) -> dict[str, float]:
        self.load(path)
        began = time.perf_counter()
        groups = self.engine.generate(self.prompts, self.config.eval_samples, self.sampling,
                                      seed=self.config.eval_seed)
        scores, lengths = [], []
        for row, group in zip(self.rows, groups):
            for completion in group:
                text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
                scores.append(reward(text, row))
                lengths.append(len(completion.token_ids))
        return {"accuracy": sum(s > 0.5 for s in scores) / len(scores), "mean_score": sum(scores) / len(scores),
                "completion_length": sum(lengths) / len(lengths), "eval_seconds": time.perf_counter() - began}


def base_accuracy(evaluator: Evaluator, cache: Path) -> dict[str, float]:
    """Step 0's numbers, from ``cache`` when it holds these settings."""
    settings = eval_settings(evaluator.config)
    entries = json.loads(cache.read_text()) if cache.exists() else []
    for entry in entries:
        if entry["settings"] == settings:
            return entry["result"]
    result = evaluator.accuracy(None)
    entries.append({"settings": settings, "result": result})
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
    return result

"""A rollout engine whose completions depend only on the prompt: the same prompt gets the same G completions
on any rank, in any batch. Multi-process tests use it to compare a 2-rank step with a 1-rank step on exactly the
same rollouts; everything else (policy, reference, loss, optimizer, gradient reduction) is the real code."""

from __future__ import annotations

import torch

from lit_grpo.data.datamodule import RolloutDataModule
from lit_grpo.engines.base import Completion, RolloutEngine, SamplingConfig

DIGIT, LETTER, EOS = 20, 40, 2  # tiny tokenizer: '0' and 'D' characters, <|im_end|>


class ScriptedEngine(RolloutEngine):
    """Prompts with an even token sum get G identical completions (a zero-variance group under any reward);
    the others get completions with a different share of digits each (a group with spread)."""

    rescore = True  # "alpha = pi_k when synced", as for the in-process engine

    def __init__(self) -> None:
        self.synced_step = 0
        self.loads = 0

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int,
                 all_finished=None) -> list[list[Completion]]:  # noqa: ANN001
        groups = []
        for prompt in prompts:
            h = sum(prompt)
            group = []
            for j in range(n):
                k = 0 if h % 2 == 0 else j
                length = 2 + (h + k) % 5
                tokens = [DIGIT + (h + t) % 10 if (t + k) % 3 else LETTER + t for t in range(length)]
                ended = k % 2 == 0
                tokens = tokens[:-1] + [EOS] if ended else tokens
                group.append(Completion(tokens, [-1.0] * len(tokens), truncated=not ended))
            groups.append(group)
        return groups

    def load_weights(self, named_tensors, step: int) -> None:  # noqa: ANN001
        for _ in named_tensors:  # consume: sharded sources gather while iterated
            pass
        self.synced_step = int(step)
        self.loads += 1

    def score(self, batch, temperature: float) -> torch.Tensor | None:  # noqa: ANN001
        return None


class ScriptedDataModule(RolloutDataModule):
    def build_engine(self, module) -> RolloutEngine:  # noqa: ANN001
        return ScriptedEngine()

"""What the multi-turn layout tests share: a tiny model whose turns end early, a task file for ``TwoTurns``, and a
launch of ``dist_worker`` jobs that also returns the multi-turn metrics.

A random tiny model almost never samples its EOS, so every turn would run into ``max_new_tokens``, and a truncated
turn ends its trajectory before the environment answers. The model saved here stops at any letter as well (the
``eos_token_id`` list of its generation config, which every engine reads: the in-process engine and the servers'
requests through ``eos_token_ids``, vLLM from the config): about half of its tokens are letters, so nearly every
turn ends within a few tokens and the environment gets to answer it.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from unittest import mock

#: the multi-turn statistics the data module logs, returned by the worker beside dist_worker's own keys
MULTI_TURN_KEYS = ("rollout/turns", "rollout/model_tokens", "rollout/env_tokens", "rollout/env_errors",
                   "rollout/truncated", "rollout/template_mismatch", "rollout/completion_length")
ENVIRONMENT = "toy_environments:TwoTurns"


def stop_ids(tokenizer) -> list[int]:  # noqa: ANN001
    """The tokenizer's EOS and the id of every ASCII letter (one token each in the character tokenizer)."""
    letters = [tokenizer.convert_tokens_to_ids(c) for c in string.ascii_letters]
    return sorted({int(tokenizer.eos_token_id), *letters})


def save_stopping(model, tokenizer, path: Path) -> Path:  # noqa: ANN001
    """Save ``model`` and ``tokenizer`` to ``path`` with a generation config that stops at :func:`stop_ids`."""
    model.generation_config.eos_token_id = stop_ids(tokenizer)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def stopping_tiny_llama(path: Path) -> Path:
    """``tiny-random-llama``'s weights and tokenizer in ``path``, stopping early (see the module's docstring)."""
    import torch

    from lit_grpo.models.loading import load_tiny_random_llama

    model, tokenizer = load_tiny_random_llama(torch.float32)
    return save_stopping(model, tokenizer, path)


def task_file(path: Path, rows: int = 16) -> Path:
    """A JSON-lines task of ``rows`` rows ``{"target": t}`` (the rows ``TwoTurns`` takes)."""
    path.write_text("\n".join(json.dumps({"target": i % 10}) for i in range(rows)) + "\n")
    return path


def multi_turn_data(task: Path, **overrides) -> dict:
    """``RolloutDataModule`` arguments of a small multi-turn run on ``task`` (the environment's reward only)."""
    data = dict(dataset=str(task), environment=ENVIRONMENT, rewards=[], multi_turn=dict(max_turns=2),
                prompts_per_step=2, num_generations=4, micro_batch_size=4, max_new_tokens=8)
    data.update(overrides)
    return data


def launch_multi_turn(jobs: list[dict], world: int, workdir: Path, timeout_s: float = 300.0) -> list[list[dict]]:
    """``distributed_launch.launch`` of ``jobs`` through ``multi_turn_worker.py`` (dist_worker's jobs, whose results
    also carry :data:`MULTI_TURN_KEYS`)."""
    import distributed_launch

    with mock.patch.object(distributed_launch, "WORKER", Path(__file__).with_name("multi_turn_worker.py")):
        return distributed_launch.launch(jobs, world=world, workdir=workdir, timeout_s=timeout_s)

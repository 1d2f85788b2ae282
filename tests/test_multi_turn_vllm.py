"""Multi-turn rollouts with vLLM (the vLLM tier): colocated vLLM and ``vllm serve`` each run a multi-turn fit through
``python -m lit_grpo fit``, and the colocated engine samples whole trajectories whose model tokens carry its own
log-probs, with prefix caching on and hit.

Prefix caching: vLLM 0.32 turns it on by default for generative models (on an x86 CPU too), and neither
``VLLMEngine`` nor the ``vllm serve`` command of the docs turns it off. A trajectory's turn k + 1 is sent as its
whole prefix (prompt, model tokens, environment tokens), whose full KV blocks turn k computed, and a group's G first
turns share their prompt; a weight push clears the cache (``reset_prefix_cache`` colocated, ``/pause`` for
``vllm serve``). Hits land on whole blocks: 128 tokens on the CPU build by default, more than this tier's tiny
conversations hold, so these tests use 32-token blocks to see them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from multi_turn_helpers import save_stopping, task_file
from vllm_helpers import ENGINE_OPTIONS, VLLMServe, requires_vllm, teacher_forced, tiny_vllm_llama

from lit_grpo.cli.plots import read_scalars

pytestmark = [pytest.mark.vllm, requires_vllm]

ROOT = Path(__file__).resolve().parents[1]
#: vLLM's KV block here (a multiple of 32, which its CPU attention prefers): small enough for the tiny
#: conversations' prefixes to fill whole blocks
BLOCK = 32
MAX_MEAN_GAP = 1e-4
RENDEZVOUS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("multi_turn_vllm")
    model, tokenizer = tiny_vllm_llama()
    return save_stopping(model, tokenizer, root / "tiny"), task_file(root / "task.jsonl")


def fit(model_dir: Path, task: Path, workdir: Path, engine: str, options: dict, env: dict, *extra: str) -> dict:
    """A 3-step multi-turn fit through the command line (``TwoTurns``, G = 4, two turns of up to 8 tokens);
    its TensorBoard scalars."""
    proc = subprocess.run(
        [sys.executable, "-m", "lit_grpo", "fit", "--config", str(ROOT / "configs" / "demo_cpu.yaml"),
         "--model.model_name", str(model_dir), "--trainer.max_steps", "3", "--data.dataset", str(task),
         "--data.environment", "toy_environments:TwoTurns", "--data.rewards", "[]",
         "--data.multi_turn", json.dumps({"max_turns": 2}), "--data.prompts_per_step", "2",
         "--data.num_generations", "4", "--data.max_new_tokens", "8", "--data.micro_batch_size", "8",
         "--data.engine", engine, "--data.engine_options", json.dumps(options), *extra,
         # the Pass@k callback builds a prompt from its rows at the start, even when it never evaluates
         "--eval.dataset", str(task), "--eval.at_start", "false", "--eval.at_end", "false",
         "--eval.every_n_optimizer_steps", "null"],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return read_scalars(workdir / "runs" / "demo_cpu")


def assert_multi_turn_fit(scalars: dict) -> None:
    assert len(scalars["train/loss"]) == 3
    assert all(torch.isfinite(torch.tensor(v)) for _, v in scalars["train/loss"])
    assert all(v > 1.0 for _, v in scalars["rollout/turns"])  # the environment answered: a second model turn
    assert all(v > 0 for _, v in scalars["rollout/env_tokens"])
    assert all(v == 0 for _, v in scalars["rollout/env_errors"])
    # the first-push check teacher-forced the model's tokens of trajectories (environment tokens between them)
    assert scalars["rollout/sampler_check_gap"][0][1] <= MAX_MEAN_GAP


def prefix_cache_counts(metrics_text: str) -> tuple[float, float]:
    """``(queries, hits)`` in tokens from ``vllm serve``'s Prometheus ``/metrics``."""
    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^vllm:{name}_total(?:{{[^}}]*}})? (\S+)$", metrics_text, re.M))
    return total("prefix_cache_queries"), total("prefix_cache_hits")


def test_colocated_vllm_samples_token_exact_trajectories_with_prefix_caching(files):
    from toy_environments import TwoTurns

    from lit_grpo.data.multi_turn import MultiTurnOptions, TrajectoryRunner
    from lit_grpo.engines.base import Rollouts, SamplingConfig
    from lit_grpo.engines.vllm_engine import VLLMEngine
    from lit_grpo.environments.rendering import ConversationRenderer
    from lit_grpo.environments.tool_calls import resolve_tool_call_format
    from lit_grpo.environments.tools import ToolBox

    model_dir, _ = files
    model, tokenizer = tiny_vllm_llama()
    engine = VLLMEngine(str(model_dir), tokenizer=tokenizer, seed=0, block_size=BLOCK, disable_log_stats=False,
                        **ENGINE_OPTIONS)
    try:
        assert engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
        runner = TrajectoryRunner(TwoTurns, ToolBox([]), resolve_tool_call_format("hermes"),
                                  ConversationRenderer(tokenizer, [], None), MultiTurnOptions(max_turns=2))
        rollouts = runner.run([{"target": 3}, {"target": 7}], 4,
                              lambda p, n, s, seed: Rollouts(engine.generate(p, n, s, seed)),
                              SamplingConfig(max_new_tokens=8, temperature=1.0), seed=1)
        counts = {m.name: m.value for m in engine.llm.get_metrics() if "prefix_cache" in m.name}
    finally:
        engine.close()
    trajectories = [c for g in rollouts.groups for c in g]
    assert all(c.trajectory["turns"] == 2 and c.trajectory["env_tokens"] > 0 for c in trajectories)
    # the model's tokens carry vLLM's log-probs of them after everything before (the environment's tokens too)
    gaps = []
    for group, prompt in zip(rollouts.groups, [runner.prompt({"target": 3}), runner.prompt({"target": 7})]):
        for c in group:
            expected = teacher_forced(model, prompt, list(c.token_ids))
            mask = torch.tensor(c.mask, dtype=torch.bool)
            assert torch.equal(torch.tensor(c.logprobs, dtype=torch.float64)[~mask], torch.zeros(int((~mask).sum()),
                                                                                          dtype=torch.float64))
            gaps.append((torch.tensor(c.logprobs, dtype=torch.float64) - expected)[mask].abs())
    assert float(torch.cat(gaps).mean()) <= MAX_MEAN_GAP
    queries, hits = counts["vllm:prefix_cache_queries"], counts["vllm:prefix_cache_hits"]
    print(f"colocated vLLM prefix cache over one multi-turn batch: {hits:.0f} of {queries:.0f} prompt tokens hit "
          f"({hits / queries:.1%})")
    assert hits > 0


def test_multi_turn_fit_with_colocated_vllm(files, tmp_path):
    model_dir, task = files
    # without the rendezvous variables another test's colocated vLLM exported in this process (its port is taken)
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    scalars = fit(model_dir, task, tmp_path, "vllm", dict(ENGINE_OPTIONS, block_size=BLOCK), env)
    assert_multi_turn_fit(scalars)
    assert all(v == 0.0 for _, v in scalars["train/staleness"])


def test_asynchronous_multi_turn_fit_against_vllm_serve(files, tmp_path):
    model_dir, task = files
    server = VLLMServe(model_dir, tmp_path / "serve.log", extra=("--block-size", str(BLOCK)))
    try:
        print(f"vllm serve answered after {server.wait_ready():.1f} s")
        before = prefix_cache_counts(metrics(server))
        options = dict(url=server.url, kind="vllm", backend="gloo", dtype="float32", timeout_s=120)
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", LIT_GRPO_SERVER_TOKEN=server.token)
        scalars = fit(model_dir, task, tmp_path, "server", options, env, "--data.max_staleness", "1")
        after = prefix_cache_counts(metrics(server))
        assert server.get("/weight_info")["weight_version"] == "3"
    finally:
        server.stop()
    assert_multi_turn_fit(scalars)
    # K = 1: the trajectories of step 1 ran while step 0 trained, on the weights pushed before step 0
    assert [v for _, v in scalars["train/staleness"]] == [0.0, 1.0, 1.0]
    queries, hits = after[0] - before[0], after[1] - before[1]
    print(f"vllm serve prefix cache over the fit: {hits:.0f} of {queries:.0f} prompt tokens hit ({hits / queries:.1%})")
    assert hits > 0


def metrics(server: VLLMServe) -> str:
    """``vllm serve``'s Prometheus metrics (text)."""
    request = urllib.request.Request(server.url + "/metrics", headers={"Authorization": f"Bearer {server.token}"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=30) as response:
        return response.read().decode()

"""``keep_pushed_weights`` (``ServerOptions``) against a real rollout server process: the trainer keeps a frozen copy
of each push, so a batch sampled with the last pushed version and trained on after the policy moved gets alpha as
that copy's recompute (``alpha_source`` ``recompute``), equal to the in-process engine's recompute of the pushed
weights; the data module logs the copy's bytes and times; a checkpoint of a lagging run holds the copy and restores
it (server and alpha alike); with LoRA the copy is the adapter only, scored on the policy's base, which is left
bitwise as it was, and a merge since the push turns the recompute off; in a bf16-mixed fit the lagging batches'
alpha is recomputed under the trainer's autocast."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from server_process import ServerProcess, running_server
from test_server_engine_vllm import fake_server, fake_vllm  # noqa: F401 (fixtures: a fake vllm serve, no vLLM)

from lit_grpo.core.batch import RolloutBatch
from lit_grpo.data.datamodule import PromptBatch, RolloutDataModule
from lit_grpo.data.rollout import pad_rollouts
from lit_grpo.engines.base import Rollouts, SamplingConfig
from lit_grpo.engines.options import ServerOptions, engine_options
from lit_grpo.engines.remote.client import ServerEngine
from lit_grpo.engines.transformers_engine import TransformersEngine
from lit_grpo.models.loading import eos_token_ids, load_model_and_tokenizer, tiny_llama
from lit_grpo.models.lora import (
    LoraArgs,
    adapter_parameters,
    adapter_update,
    apply_lora,
    parameter_bytes,
    swap_reference_by_merge,
)
from lit_grpo.wire.weight_transfer import checksum

SAMPLING = SamplingConfig(max_new_tokens=8, temperature=0.9)
G = 3  # completions per prompt


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("kept_weights")) as process:
        yield process


def options(server: ServerProcess, **extra) -> dict:
    return dict(url=server.url, token=server.token, timeout_s=60, bucket_mb=0.05, **extra)


def move(policy: torch.nn.Module, seed: int, params=None) -> None:  # noqa: ANN001
    """Stand-in for optimizer steps after the push: the policy moves on, the server keeps the pushed weights."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params if params is not None else policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))


def data_module(server: ServerProcess, engine: ServerEngine, tokenizer) -> RolloutDataModule:  # noqa: ANN001
    dm = RolloutDataModule(prompts_per_step=2, num_generations=G, micro_batch_size=4,
                           max_new_tokens=SAMPLING.max_new_tokens, temperature=SAMPLING.temperature,
                           engine="server", engine_options=options(server, keep_pushed_weights=True),
                           sampler_check_max_gap=None)
    dm.rollout_engine, dm.tokenizer = engine, tokenizer
    return dm


def sampled_batch(dm: RolloutDataModule, engine: ServerEngine, seed: int) -> RolloutBatch:
    """One rollout batch as the data module assembles it, sampled by the server with the version it holds."""
    rows = [0, 1]
    groups = engine.generate([dm.prompt_ids(r) for r in rows], G, dm.sampling, seed)
    return dm.assemble(PromptBatch(rows=rows, batch_index=0), groups, Rollouts(groups), engine.synced_step, 0.0, {})


def in_process_copy(policy, tokenizer) -> TransformersEngine:  # noqa: ANN001
    """The in-process engine's private copy of the policy as it is now (the weights about to be pushed)."""
    local = TransformersEngine(policy, eos_token_ids(tokenizer, policy), tokenizer.pad_token_id)
    local.model  # noqa: B018 (the copy is made here, from the policy's current values)
    return local


def test_bad_values_are_refused_in_one_line():
    with pytest.raises(ValueError, match="kept_weights_device must be one of .*got 'gpu'") as refused:
        ServerOptions(url="http://127.0.0.1:1", kept_weights_device="gpu")
    assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="keep_pushed_weights: true .* rescore: false"):
        ServerOptions(url="http://127.0.0.1:1", keep_pushed_weights=True, rescore=False)
    with pytest.raises(ValueError, match="keep_pushed_weights must be bool, got 'yes'"):
        engine_options("server", {"url": "http://127.0.0.1:1", "keep_pushed_weights": "yes"})


def test_a_lagging_batch_gets_the_kept_copys_recompute_and_its_stats(server, one_thread):
    policy, tokenizer = load_model_and_tokenizer("tiny-random-llama")
    engine = ServerEngine(policy=policy, **options(server, keep_pushed_weights=True))
    assert engine.rescore  # alpha = pi_k when synced, the kept copy's recompute when lagging
    local = in_process_copy(policy, tokenizer)
    engine.load_weights(policy.named_parameters(), step=3)
    pushed = {name: p.detach().clone() for name, p in policy.named_parameters()}
    local.load_weights(pushed.items(), step=3)
    # (the server keeps the unmoved tiny model as its base: the LoRA test below pushes adapters onto it)
    move(policy, seed=1)  # the trainer takes optimizer steps; the server still holds version 3

    dm = data_module(server, engine, tokenizer)
    batch = sampled_batch(dm, engine, seed=7)
    assert batch.rollout_step == 3 and batch.alpha_source == "recompute"
    expected = local.score(batch, SAMPLING.temperature)
    assert torch.equal(batch.alpha_logp, expected)  # the in-process recompute of the pushed weights, bitwise
    # ... and not the moved policy's: the copy is the pushed weights, not a view of the policy
    with torch.no_grad():
        moved = TransformersEngine(policy, [0], tokenizer.pad_token_id, copy_weights=False).score(batch, 0.9)
    assert (moved - expected).abs().max() > 1e-3
    # the server sampled with the same fp32 weights: its report agrees to rounding
    torch.testing.assert_close(batch.sampler_logp * batch.completion_mask, expected * batch.completion_mask,
                               rtol=0, atol=1e-4)
    full_bytes = sum(p.numel() * p.element_size() for p in policy.parameters())
    assert batch.stats["kept_weights_bytes"] == full_bytes
    assert batch.stats["kept_weights_copy_seconds"] > 0 and batch.stats["alpha_recompute_seconds"] > 0
    assert engine.kept_weights.version == 3
    assert engine.score(batch, SAMPLING.temperature) is not None
    assert engine.kept_weights.score(batch, SAMPLING.temperature, version=2) is None  # another version: no copy

    # without the option the engine cannot recompute: alpha stays the server's report
    plain = ServerEngine(policy=policy, **options(server))
    assert plain.score(batch, SAMPLING.temperature) is None and plain.kept_weights is None
    assert "kept_weights_bytes" not in plain.kept_weights_stats()

    # exact resume while lagging: the checkpoint holds the kept copy; a fresh engine pushes it back and keeps it
    state = engine.state_dict()
    assert state is not None and set(state) == set(pushed)
    engine.close()
    resumed = ServerEngine(policy=policy, **options(server, keep_pushed_weights=True, kept_weights_device="cpu"))
    resumed.load_state_dict(state, step=3)
    assert resumed.synced_step == 3
    assert resumed.weight_checksums()[server.url] == {n: checksum(t) for n, t in pushed.items()}
    assert torch.equal(resumed.score(batch, SAMPLING.temperature), expected)
    assert next(resumed.kept_weights.model.parameters()).device.type == "cpu"
    resumed.close()
    plain.close()


def test_with_lora_the_copy_is_the_adapter_only_and_the_policy_is_left_as_it_was(server, one_thread):
    model, tokenizer = load_model_and_tokenizer("tiny-random-llama")  # the server's base
    torch.manual_seed(0)
    policy = apply_lora(model, LoraArgs(r=1, alpha=2.0))
    move(policy, seed=2, params=adapter_parameters(policy))  # an adapter that changes the outputs
    engine = ServerEngine(policy=policy, **options(server, keep_pushed_weights=True))
    local = in_process_copy(policy, tokenizer)  # base and adapter as pushed
    engine.load_adapter(adapter_update(policy, engine.merges_applied, with_hash=True, step=4), step=4)
    kept = engine.kept_weights
    adapter_bytes = sum(p.numel() * p.element_size() for p in adapter_parameters(policy))
    assert kept.model is None and kept.nbytes == adapter_bytes
    assert kept.nbytes < 0.05 * parameter_bytes(policy)  # r = 1: a few percent of the model
    move(policy, seed=3, params=adapter_parameters(policy))  # the adapter trains on

    dm = data_module(server, engine, tokenizer)
    policy.train()
    before = {name: p.detach().clone() for name, p in policy.named_parameters()}
    batch = sampled_batch(dm, engine, seed=9)
    assert batch.alpha_source == "recompute"
    assert torch.equal(batch.alpha_logp, local.score(batch, SAMPLING.temperature))
    assert batch.stats["kept_weights_bytes"] == adapter_bytes
    # the policy's adapter and mode are restored bitwise after the recompute
    assert policy.training
    assert all(torch.equal(p, before[name]) for name, p in policy.named_parameters())

    # exact resume of a lagging LoRA run: the adapter pushed back (the base hash checked), the same alpha
    state = engine.state_dict()
    resumed = ServerEngine(policy=policy, **options(server, keep_pushed_weights=True))
    resumed.load_state_dict(state, step=4)
    assert torch.equal(resumed.score(batch, SAMPLING.temperature), batch.alpha_logp)
    resumed.close()

    # a RefModelSwap merges the adapter into the policy's base: base + kept adapter is no longer what was pushed
    swap_reference_by_merge(policy, [])
    assert engine.score(batch, SAMPLING.temperature) is None
    engine.close()


class Seen(Callback):
    """Each batch's alpha source and statistics, and whether the kept copy's recomputes ran under the trainer's
    autocast (bf16-mixed: the context ``training_step`` runs in)."""

    def __init__(self) -> None:
        self.sources: list[str] = []
        self.stats: list[dict[str, float]] = []
        self.autocast: list[bool] = []

    def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        kept = trainer.datamodule.rollout_engine.kept_weights
        score = kept.score

        def recorded(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.autocast.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16)
            return score(*args, **kwargs)

        kept.score = recorded

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self.sources.append(batch.alpha_source)
        self.stats.append(dict(batch.stats))


def test_a_fit_recomputes_alpha_of_the_lagging_batches_in_the_trainers_precision(server, tmp_path):
    from conftest import tiny_data, tiny_module, tiny_trainer
    from lit_grpo.callbacks import WeightSync

    seen = Seen()
    data = tiny_data(engine="server", engine_options=options(server, keep_pushed_weights=True),
                     sampler_check_max_gap=None)
    trainer = tiny_trainer(tmp_path, max_steps=4, callbacks=[WeightSync(every_n_batches=2), seen],
                           precision="bf16-mixed")
    trainer.fit(tiny_module(lr=1e-2), datamodule=data)
    # pushes at steps 0 and 2: the batches of steps 1 and 3 lag the policy by one step
    assert seen.sources == ["policy", "recompute", "policy", "recompute"]
    assert seen.autocast == [True, True]  # the recomputes only, each in the trainer's bf16 autocast
    assert [s["alpha_recompute_seconds"] > 0 for s in seen.stats] == [False, True, False, True]
    assert all(s["kept_weights_bytes"] > 0 for s in seen.stats)
    assert trainer.callback_metrics["rollout/kept_weights_bytes"] == seen.stats[-1]["kept_weights_bytes"]


def test_with_vllm_serve_the_kept_copy_is_the_trainers_fp32_and_lora_keeps_the_adapter_only(fake_vllm, fake_server,  # noqa: F811
                                                                                              tmp_path):
    """``kind: vllm`` (the case the option is for: the server cannot rescore), against a fake ``vllm serve``: the
    wire carries bf16, the copy keeps the trainer's fp32 and recomputes alpha; with LoRA, the base reload that goes
    with the first adapter push is not kept, the adapter is."""
    model = tiny_llama(vocab_size=100)
    engine = ServerEngine(url=fake_server.url, kind="vllm", policy=lambda: model, dtype="bfloat16", timeout_s=10,
                          keep_pushed_weights=True)
    assert engine.rescore  # kind vllm alone would leave alpha to the sampler's report
    local = TransformersEngine(model, [2], 0)
    local.model  # noqa: B018 (a copy of the weights about to be pushed)
    engine.load_weights(model.named_parameters(), step=3)
    kept = dict(engine.kept_weights.model.named_parameters())
    assert all(torch.equal(kept[n], p) and kept[n].dtype == torch.float32 for n, p in model.named_parameters())
    move(model, seed=4)
    prompts = [[5, 6, 7], [8, 9]]
    padded = pad_rollouts(prompts, engine.generate(prompts, 2, SAMPLING, seed=11), 0, 4)
    assert torch.equal(engine.score(padded, 0.9), local.score(padded, 0.9))

    torch.manual_seed(0)
    policy = apply_lora(tiny_llama(vocab_size=100), LoraArgs(r=4, alpha=8.0))
    move(policy, seed=5, params=adapter_parameters(policy))
    engine = ServerEngine(url=fake_server.url, kind="vllm", policy=lambda: policy, timeout_s=10, lora_keep=2,
                          lora_dir=str(tmp_path / "shared"), keep_pushed_weights=True, kept_weights_device="cpu")
    local = TransformersEngine(policy, [2], 0)
    local.model  # noqa: B018
    engine.load_adapter(adapter_update(policy, engine.merges_applied, with_hash=False, step=1), step=1)
    kept = engine.kept_weights
    assert kept.model is None and kept.version == 1
    assert kept.nbytes == sum(p.numel() * p.element_size() for p in adapter_parameters(policy))
    assert all(t.device.type == "cpu" for t in kept.adapter.values())
    move(policy, seed=6, params=adapter_parameters(policy))
    padded = pad_rollouts(prompts, engine.generate(prompts, 2, SAMPLING, seed=12), 0, 4)
    assert torch.equal(engine.score(padded, 0.9), local.score(padded, 0.9))
    engine.close()

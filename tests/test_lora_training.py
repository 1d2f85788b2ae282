"""LoRA in training (``model.lora``): pi_ref is the policy with its adapter off (no copy), a stage swap merges the
adapter so that pi_ref equals the policy, pushes carry the adapter (or the merged weights to an engine that takes
no adapters) and log their bytes, a resume is exact, and both exports give the policy back."""

import json

import pytest
import torch
from conftest import MetricsRecorder, tiny_data, tiny_module, tiny_trainer
from handmade import handmade_batch
from lit_grpo.callbacks import HFExport, RefModelSwap, WeightSync

from lit_grpo.cli.export import export_checkpoint
from lit_grpo.core.scoring import completion_logprobs
from lit_grpo.engines.base import RolloutEngine
from lit_grpo.models.loading import load_model_and_tokenizer
from lit_grpo.models.lora import LoraArgs, adapter_parameters, adapter_state, base_hash, is_lora, merge_log

KEYS = ("train/loss", "train/kl", "rollout/reward_mean", "train/staleness")


def lora_module(**overrides):
    torch.manual_seed(0)
    return tiny_module(beta=0.1, lr=1e-2, lora=LoraArgs(r=4), **overrides)


def batch_of(module):
    return handmade_batch([[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0, 0.0]], module.tokenizer.vocab_size)


def policy_logprobs(module, batch) -> list[torch.Tensor]:
    with torch.no_grad():
        return [completion_logprobs(module.policy, mb, 1.0)[0] for mb in batch.micro_batches()]


def perturb_adapter(module, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in adapter_parameters(module.policy):
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([[5, 9, 13, 7, 21, 4]])).logits


def test_pi_ref_is_the_policy_with_its_adapter_off_and_no_copy_is_made():
    module = lora_module()
    assert module.reference is None and is_lora(module.policy)
    perturb_adapter(module)
    batch = batch_of(module)
    micro_batches = list(batch.micro_batches())
    ref = module.reference_logprobs(batch, micro_batches)
    plain = load_model_and_tokenizer("tiny-random-llama")[0]  # the base the adapter sits on, computed apart
    with torch.no_grad():
        expected = [completion_logprobs(plain, mb, 1.0)[0] for mb in micro_batches]
    for got, want, pol in zip(ref, expected, policy_logprobs(module, batch)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        assert (pol - want).abs().max() > 1e-4  # the adapter does change the policy
    # the optimizer holds the adapters only
    optimizer = module.configure_optimizers()["optimizer"]
    held = [p for group in optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in held} == {id(p) for p in adapter_parameters(module.policy)}


def test_gradient_checkpointing_still_trains_the_adapters():
    """Full and selective checkpointing give the adapters the gradients they get without checkpointing."""
    grads = {}
    for mode in (False, True, "selective"):
        module = lora_module(gradient_checkpointing=mode)
        perturb_adapter(module)
        batch = batch_of(module)
        mb = next(iter(batch.micro_batches()))
        logp, _ = completion_logprobs(module.policy, mb, 1.0)
        (logp * mb.completion_mask).sum().backward()
        grads[mode] = [p.grad for p in adapter_parameters(module.policy)]
        assert all(g is not None for g in grads[mode]) and any(g.abs().sum() > 0 for g in grads[mode]), mode
    for mode in (True, "selective"):
        # without checkpointing the prompt's KV cache is shared, so float32 rounding differs (~1e-7)
        for got, want in zip(grads[mode], grads[False], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_full_fine_tuning_is_unchanged_by_the_option():
    module = tiny_module(beta=0.1)
    assert module.lora_args is None and not is_lora(module.policy) and module.reference is not None
    assert module.hparams.lora is None


def test_lora_option_is_stored_as_a_plain_dict_and_bad_values_fail_before_loading():
    module = tiny_module(lora={"r": 2, "alpha": 4.0})
    assert module.hparams.lora == {"r": 2, "alpha": 4.0, "dropout": 0.0, "target_modules": None}
    with pytest.raises(ValueError, match="lora.r must be an integer >= 1, got 0"):
        tiny_module(lora={"r": 0})
    with pytest.raises(ValueError, match=r"lora \(LoraArgs\) has no option\(s\) \['rank'\]"):
        tiny_module(lora={"rank": 8})


def test_swap_merges_so_pi_ref_equals_the_policy_in_fp32():
    module = lora_module()
    perturb_adapter(module)
    batch = batch_of(module)
    before = policy_logprobs(module, batch)
    optimizer = module.configure_optimizers()["optimizer"]
    trainer = type("T", (), {"optimizers": [optimizer], "global_step": 3})()
    RefModelSwap(every_n_batches=1).swap(trainer, module)
    assert module.reference_version == 1 and len(merge_log(module.policy)) == 1
    ref = module.reference_logprobs(batch, list(batch.micro_batches()))
    for got_ref, got_policy, want in zip(ref, policy_logprobs(module, batch), before):
        torch.testing.assert_close(got_ref, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(got_policy, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(got_ref, got_policy, rtol=0, atol=1e-5)


class FullWeightsEngine(RolloutEngine):
    """An engine that takes no adapters: it records the full weights it is given."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def generate(self, prompts, n, sampling, seed):
        raise NotImplementedError

    def load_weights(self, named_tensors, step):
        self.weights = {name: t.detach().clone() for name, t in named_tensors}
        self.synced_step = step


def test_an_engine_without_adapters_gets_the_merged_weights_under_plain_names():
    module = lora_module()
    perturb_adapter(module)
    engine = FullWeightsEngine()
    sync = WeightSync(engine=engine)
    sync.push(engine, module, step=0, first=True)
    plain = load_model_and_tokenizer("tiny-random-llama")[0]
    assert set(engine.weights) == set(dict(plain.named_parameters()))
    plain.load_state_dict(engine.weights, strict=False)
    torch.testing.assert_close(logits(plain), logits(module.policy), rtol=0, atol=1e-5)
    assert sync.last_push_bytes == sum(p.numel() * 4 for p in plain.parameters())
    full = tiny_module()  # a full fine-tuning push counts its bytes too
    sync.push(engine, full, step=0, first=True)
    assert sync.last_push_bytes == sum(p.numel() * 4 for p in plain.parameters())


def fit(workdir, max_steps, callbacks=(), ckpt_in=None, ckpt_out=None, **data):
    torch.set_num_threads(1)
    recorder = MetricsRecorder()
    trainer = tiny_trainer(workdir, max_steps=max_steps, callbacks=[
        WeightSync(every_n_batches=2), RefModelSwap(every_n_optimizer_steps=2), recorder, *callbacks])
    module = lora_module()
    trainer.fit(module, datamodule=tiny_data(**data), ckpt_path=ckpt_in)
    if ckpt_out:
        trainer.save_checkpoint(ckpt_out)
    return module, trainer, recorder.steps


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Six LoRA steps with v = 2 and a swap every 2 steps, a checkpoint at the end, an HFExport of each kind."""
    root = tmp_path_factory.mktemp("lora_straight")
    module, trainer, steps = fit(root / "run", 6, ckpt_out=str(root / "end.ckpt"),
                                 callbacks=[HFExport(root / "merged"), HFExport(root / "adapter", adapter_only=True)])
    return root, module, trainer, steps


def test_a_fit_swaps_by_merge_keeps_kl_zero_after_each_swap_and_pushes_adapter_bytes(straight):
    _, module, trainer, steps = straight
    assert module.reference is None
    assert [s["ref/swaps"] for s in steps] == [0, 1, 1, 2, 2, 3]
    assert len(merge_log(module.policy)) == 3 and module.reference_version == 3
    # the step after a swap starts from pi = pi_ref: KL exactly 0 at its forward (before its update)
    for after_swap in (2, 4):
        assert steps[after_swap]["train/kl"] == pytest.approx(0.0, abs=1e-6)
    assert any(s["train/kl"] > 0 for s in steps)
    adapter_bytes = sum(p.numel() * 4 for p in adapter_parameters(module.policy))
    # v = 2: pushes after steps 2, 4, 6, each carrying the adapter and the merges the engine lacks (swaps run after
    # the push of the same step, so each push carries the one merge made since the previous push, if any)
    assert steps[1]["sync/bytes"] == adapter_bytes
    assert steps[3]["sync/bytes"] == 2 * adapter_bytes
    assert steps[5]["sync/bytes"] == 2 * adapter_bytes
    plain = sum(p.numel() * 4 for p in load_model_and_tokenizer("tiny-random-llama")[0].parameters())
    assert adapter_bytes < 0.5 * plain


def test_resume_is_exact_with_lora(straight, tmp_path):
    root, module, _, steps = straight
    fit(tmp_path / "a", 3, ckpt_out=str(tmp_path / "half.ckpt"))
    resumed, _, second = fit(tmp_path / "b", 6, ckpt_in=str(tmp_path / "half.ckpt"))
    assert len(second) == 3
    for expected, got in zip(steps[3:], second):
        for key in KEYS:
            assert got[key] == pytest.approx(expected[key], abs=1e-6), key
    assert base_hash(resumed.policy) == base_hash(module.policy)
    for key, tensor in adapter_state(module.policy).items():
        torch.testing.assert_close(adapter_state(resumed.policy)[key], tensor, rtol=0, atol=1e-6)
    assert len(merge_log(resumed.policy)) == len(merge_log(module.policy))


def test_exports_merged_by_default_and_adapter_alone_on_request(straight, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, module, _, _ = straight
    expected = logits(module.policy)
    for merged_dir in (export_checkpoint(root / "end.ckpt", tmp_path / "merged"), root / "merged"):
        merged = AutoModelForCausalLM.from_pretrained(merged_dir)
        torch.testing.assert_close(logits(merged), expected, rtol=0, atol=1e-5)
    exported = export_checkpoint(root / "end.ckpt", tmp_path / "adapter", adapter_only=True)
    # the command and the callback write the starting base beside the adapter and name it (an alias loads nowhere
    # else)
    for adapter_dir, base_name in ((exported, str((exported / "base").resolve())),
                                   (root / "adapter", str((root / "adapter" / "base").resolve()))):
        config = json.loads((adapter_dir / "adapter_config.json").read_text())
        assert config["r"] == 4 * 4 and config["base_model_name_or_path"] == base_name  # 3 merges + 1
        base = load_model_and_tokenizer("tiny-random-llama")[0]
        loaded = PeftModel.from_pretrained(base, str(adapter_dir))
        torch.testing.assert_close(logits(loaded), expected, rtol=0, atol=1e-5)
    full = tmp_path / "full.ckpt"
    trainer = tiny_trainer(tmp_path / "f", max_steps=1, callbacks=[WeightSync()])
    trainer.fit(tiny_module(), datamodule=tiny_data())
    trainer.save_checkpoint(full)
    with pytest.raises(ValueError, match="--adapter-only: checkpoint .* holds no LoRA adapter"):
        export_checkpoint(full, tmp_path / "none", adapter_only=True)


def test_lora_invariants_hold_in_bf16_mixed(tmp_path, recorder):
    """bf16-mixed, v = 1, i = 1: the first-iteration ratio is exactly 1 at every step (the engine's base and adapter
    are the policy's), and after each swap (merge + fresh adapter) KL(pi || pi_ref = adapter off) is exactly 0.
    The swap comes before the push here, so the push after a swap carries its merge. In the other order the batch
    after a swap is sampled by the unmerged pre-swap weights: the same function, rounded differently (in bf16 the
    ratio then lies within 0.3 % of 1 at that step)."""
    from conftest import tiny_data, tiny_trainer
    from lit_grpo.callbacks import RefModelSwap, WeightSync

    module, data = lora_module(), tiny_data(reuse_policy_logprobs=False)
    trainer = tiny_trainer(tmp_path, max_steps=5, precision="bf16-mixed",
                           callbacks=[RefModelSwap(every_n_batches=2), WeightSync(every_n_batches=1), recorder])
    trainer.fit(module, datamodule=data)
    steps = recorder.steps
    assert len(steps) == 5
    assert all(s["train/ratio_first_iteration_min"] == 1.0 == s["train/ratio_first_iteration_max"] for s in steps)
    assert [s["train/kl"] == 0.0 for s in steps] == [True, False, True, False, True]  # swaps after steps 2 and 4
    assert steps[-1]["ref/swaps"] == 2.0


def dropout_module():
    torch.manual_seed(0)
    return tiny_module(beta=0.1, lr=1e-2, lora=LoraArgs(r=4, dropout=0.5))


def adapter_grads(module, batch, make_logprobs, seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)  # the same dropout masks for every pass made with this seed
    module.policy.zero_grad(set_to_none=True)
    total = sum((make_logprobs(module.policy, mb, 1.0)[0] * mb.completion_mask).sum() for mb in batch.micro_batches())
    total.backward()
    return [p.grad.clone() for p in adapter_parameters(module.policy)]


def test_lora_dropout_acts_on_the_gradient_only_and_the_values_are_the_policys():
    """lora.dropout: the gradient pass's log-probs have the dropout-free policy's values (what the sampler and pi_k
    compute) and the gradient of a forward with dropout; the dropout layers are back in train mode after."""
    from lit_grpo.core import scoring

    module = dropout_module()
    perturb_adapter(module)  # B != 0: dropout on the adapter's input changes the output
    batch = batch_of(module)
    assert scoring.active_dropout(module.policy)
    with scoring.dropout_off(module.policy):
        clean = policy_logprobs(module, batch)
        assert not scoring.active_dropout(module.policy) and module.policy.training  # the dropout layers only
    assert scoring.active_dropout(module.policy)
    noisy = policy_logprobs(module, batch)  # no grad, dropout on: a random mask's values
    for mb, want, rough in zip(batch.micro_batches(), clean, noisy):
        got, _ = scoring.policy_logprobs(module.policy, mb, 1.0)
        assert got.requires_grad and torch.equal(got.detach(), want)  # bit for bit the dropout-free policy
        assert (rough - want).abs().max() > 1e-4  # dropout does change a forward
    dropout_grads = adapter_grads(module, batch, completion_logprobs, seed=7)
    substituted = adapter_grads(module, batch, scoring.policy_logprobs, seed=7)
    with scoring.dropout_off(module.policy):
        clean_grads = adapter_grads(module, batch, completion_logprobs, seed=7)
    for got, want in zip(substituted, dropout_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert any((got - clean).abs().max() > 1e-6 for got, clean in zip(substituted, clean_grads))

def test_lora_dropout_keeps_the_first_iteration_ratio_exactly_one_at_v1_i1(tmp_path, recorder):
    """lora.dropout 0.5, v = 1, i = 1, the engine scoring alpha itself: pi_k, the ratio's numerator and the TV
    monitors are the dropout-free policy, as the engine's synced copy is, so the first-iteration ratio is exactly 1
    and both TV terms 0 at every step (with dropout in those passes the ratio ranged over [0.78, 1.32])."""
    module, data = dropout_module(), tiny_data(reuse_policy_logprobs=False)
    trainer = tiny_trainer(tmp_path, max_steps=3, callbacks=[WeightSync(every_n_batches=1), recorder])
    trainer.fit(module, datamodule=data)
    steps = recorder.steps
    assert len(steps) == 3 and steps[-1]["sync/count"] == 3.0
    assert all(s["train/ratio_first_iteration_min"] == 1.0 == s["train/ratio_first_iteration_max"] for s in steps)
    assert all(s["tv/pik_alpha"] == 0.0 for s in steps)
    assert steps[-1]["train/kl"] > 0  # the adapter moved: a dropout mask would have shown in the ratio


class RankOf:
    """What ``HFExport.write_lora`` reads of a trainer, for one rank of a run."""

    def __init__(self, rank: int) -> None:
        self.is_global_zero = rank == 0
        self.barriers = 0
        self.strategy = self

    def barrier(self, name=None) -> None:
        self.barriers += 1


@pytest.mark.parametrize("rank", [0, 1])
def test_merged_lora_export_is_built_on_rank_zero_only(rank, tmp_path, monkeypatch):
    """HFExport of a LoRA policy, merged: every rank walks the merged tensors to the end (each is a gather under
    FSDP), but only rank 0 keeps them; another rank holds one merged tensor at a time, not the whole model."""
    import gc
    import weakref

    import lit_grpo.callbacks.hf_export as hf_export
    import numpy as np

    module = lora_module()
    perturb_adapter(module)
    merged = [(name, tensor.detach().clone()) for name, tensor in hf_export.merged_named_tensors(module.policy)]
    alive: list[weakref.ref] = []
    most_alive: list[int] = []

    def tracked(policy):
        assert policy is module.policy
        for name, tensor in merged:
            array = np.array(tensor.numpy())  # a fresh buffer per tensor, observed through its weak reference
            alive.append(weakref.ref(array))
            yield name, torch.from_numpy(array)
            del array
            gc.collect()
            most_alive.append(sum(ref() is not None for ref in alive))

    monkeypatch.setattr(hf_export, "merged_named_tensors", tracked)
    trainer = RankOf(rank)
    HFExport(tmp_path / "merged").write_lora(trainer, module, module.policy)
    assert len(most_alive) == len(merged) > 2 and trainer.barriers == 1  # walked to the end, then waited
    if rank == 0:
        assert max(most_alive) == len(merged)  # rank 0 builds the state dict it writes
        assert (tmp_path / "merged" / "model.safetensors").is_file()
    else:
        assert max(most_alive) <= 1  # the tensor in hand only
        assert not (tmp_path / "merged").exists()

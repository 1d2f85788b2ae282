"""What a user does after training: the policy of a checkpoint (one file, or a sharded DCP directory) and the
HFExport callback's directory load with plain transformers and compute what the trained policy computes."""

import pytest
import torch
from conftest import tiny_data, tiny_module, tiny_trainer
from lit_grpo.callbacks import HFExport, WeightSync
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_grpo.cli.commands import main
from lit_grpo.models.loading import tiny_llama, tiny_tokenizer

TEXT = ["<|im_start|>user\nWhat is 12 * 7?<|im_end|>\n", "#### 84"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two steps of a tiny fit with a reference (beta > 0), its checkpoint, and HFExport's directory."""
    root = tmp_path_factory.mktemp("export")
    module = tiny_module(beta=0.1, lr=1e-2)
    trainer = tiny_trainer(root, max_steps=2, callbacks=[WeightSync(), HFExport(dirpath=root / "hf_callback")])
    trainer.fit(module, datamodule=tiny_data())
    trainer.save_checkpoint(root / "last.ckpt")
    return root, module


def checkpoint_policy(path) -> torch.nn.Module:
    """The checkpoint's policy, read with plain torch.load (independently of lit_grpo.core.checkpoints)."""
    state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    model = tiny_llama(len(tiny_tokenizer()))
    model.load_state_dict({k.removeprefix("policy."): v for k, v in state.items() if k.startswith("policy.")})
    return model.eval()


def logits(model: torch.nn.Module, tokenizer) -> torch.Tensor:
    tokenizer.padding_side = "left"
    enc = tokenizer(TEXT, return_tensors="pt", padding=True)
    with torch.no_grad():
        return model.eval()(**enc).logits


def assert_same_model(out_dir, expected: torch.nn.Module) -> None:
    model = AutoModelForCausalLM.from_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    # the tokenizer round-trips: same ids, same chat template
    assert tokenizer(TEXT)["input_ids"] == tiny_tokenizer()(TEXT)["input_ids"]
    assert tokenizer.chat_template == tiny_tokenizer().chat_template
    got, want = logits(model, tokenizer), logits(expected, tiny_tokenizer())
    assert torch.allclose(got, want, rtol=0, atol=1e-6), float((got - want).abs().max())
    # the policy only: no reference, no optimizer state
    with safe_open(str(out_dir / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(expected.state_dict())


def test_export_single_file_checkpoint(trained, capsys):
    root, _ = trained
    policy = checkpoint_policy(root / "last.ckpt")
    # training moved the policy away from the model the export starts from, so a no-op load would show
    initial = logits(tiny_llama(len(tiny_tokenizer())), tiny_tokenizer())
    assert (logits(policy, tiny_tokenizer()) - initial).abs().max() > 1e-3
    main(["export", str(root / "last.ckpt"), str(root / "hf_file")])
    assert f"wrote {root / 'hf_file'}" in capsys.readouterr().out
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (root / "hf_file" / name).is_file(), name
    assert_same_model(root / "hf_file", policy)


def write_sharded_checkpoint(ckpt_file, directory, root: str = "state_dict") -> None:
    """The layout of ModelParallelStrategy.save_checkpoint: `state_dict` and `optimizer_<i>` as DCP shards
    (through the function Lightning uses), the rest in meta.pt. DCP needs no process group to write.
    FSDPStrategy's sharded checkpoints are the same with the model's entry named `model`."""
    from lightning.fabric.strategies.fsdp import _distributed_checkpoint_save

    checkpoint = torch.load(ckpt_file, map_location="cpu", weights_only=True)
    converted = {root: checkpoint.pop("state_dict")}
    converted.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    directory.mkdir()
    with pytest.warns(UserWarning, match="torch.distributed"):  # no process group: one writer
        _distributed_checkpoint_save(converted, directory)
    torch.save(checkpoint, directory / "meta.pt")


@pytest.mark.parametrize("entry", ["state_dict", "model"])  # ModelParallelStrategy, FSDPStrategy("sharded")
def test_export_sharded_checkpoint_directory(trained, entry):
    root, _ = trained
    write_sharded_checkpoint(root / "last.ckpt", root / f"sharded_{entry}", root=entry)
    assert (root / f"sharded_{entry}" / ".metadata").is_file()
    main(["export", str(root / f"sharded_{entry}"), str(root / f"hf_sharded_{entry}")])
    assert_same_model(root / f"hf_sharded_{entry}", checkpoint_policy(root / "last.ckpt"))


def test_hf_export_callback_writes_the_trained_policy(trained):
    root, module = trained
    assert_same_model(root / "hf_callback", module.policy)
    with pytest.raises(ValueError, match="dirpath"):
        HFExport(dirpath="")


def bad_checkpoints(root):
    torch.save({"state_dict": {"policy.lm_head.weight": torch.zeros(3)}}, root / "no_hparams.ckpt")
    data = (root / "no_hparams.ckpt").read_bytes()
    (root / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    torch.save({"weights": torch.zeros(3)}, root / "not_lightning.ckpt")
    torch.save({"state_dict": {"policy.lm_head.weight": torch.zeros(3, 3)},
                "hyper_parameters": {"model_name": "tiny-random-llama"}}, root / "other_model.ckpt")
    (root / "plain_dir").mkdir()


@pytest.mark.parametrize("name, reason", [
    ("missing.ckpt", "does not exist"),
    ("truncated.ckpt", "not a torch.save archive"),
    ("not_lightning.ckpt", "not a Lightning checkpoint"),
    ("no_hparams.ckpt", "model_name"),
    ("other_model.ckpt", "policy.lm_head.weight has shape [3, 3] in the checkpoint"),
    ("plain_dir", "without meta.pt"),
])
def test_export_names_the_bad_checkpoint_in_one_line(tmp_path, capsys, monkeypatch, name, reason):
    monkeypatch.delenv("LIT_GRPO_DEBUG", raising=False)
    bad_checkpoints(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(tmp_path / name), str(tmp_path / "out")])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert str(tmp_path / name) in lines[0] and reason in lines[0]
    assert not (tmp_path / "out").exists()


def test_export_a_model_alias_for_vllm(tmp_path, capsys):
    """``export --model ALIAS DIR``: the directory vLLM is given instead of an alias loads with plain transformers
    and computes the alias's logits; its generation config carries token ids and no sampling values."""
    import json

    main(["export", "--model", "tiny-random-llama", str(tmp_path / "tiny")])
    assert f"wrote {tmp_path / 'tiny'}" in capsys.readouterr().out
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (tmp_path / "tiny" / name).is_file(), name
    assert_same_model(tmp_path / "tiny", tiny_llama(len(tiny_tokenizer())))  # the alias: seed 0, float32
    generation = json.loads((tmp_path / "tiny" / "generation_config.json").read_text())
    tokenizer = tiny_tokenizer()
    assert set(generation) <= {"bos_token_id", "eos_token_id", "pad_token_id", "transformers_version"}, generation
    assert generation["eos_token_id"] == [tokenizer.eos_token_id]
    assert generation["pad_token_id"] == tokenizer.pad_token_id


@pytest.mark.parametrize("args, expected", [
    (["--model", "no-such-alias", "{out}"], ["--model 'no-such-alias' is not a model alias", "tiny-random-llama"]),
    (["--model", "tiny-random-llama", "x.ckpt", "{out}"], ["exclude each other"]),
    (["--model", "tiny-random-llama", "--adapter-only", "{out}"], ["--adapter-only needs a LoRA checkpoint"]),
])
def test_export_of_a_bad_alias_is_one_line(args, expected, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LIT_GRPO_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["export", *(a.format(out=tmp_path / "out") for a in args)])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert all(text in lines[0] for text in expected), lines[0]
    assert not (tmp_path / "out").exists()


def lora_checkpoint(path, tamper: bool = False) -> torch.nn.Module:
    """A LoRA policy of the tiny alias after one stage swap (a merged adapter, then a fresh one, both random), saved
    as a GRPOModule checkpoint is (``policy.*`` tensors, the hyper-parameters, the merge log), without a fit.
    ``tamper``: its base no longer the alias's (a model that changed since training)."""
    from lit_grpo.models.lora import (
        LoraArgs,
        adapter_state,
        apply_lora,
        load_adapter_state,
        merge_log,
        swap_reference_by_merge,
    )

    torch.manual_seed(0)
    policy = apply_lora(tiny_llama(len(tiny_tokenizer())), LoraArgs(r=2, alpha=4.0))
    for _ in range(2):  # the first adapter is merged by the swap, the second stays the adapter
        load_adapter_state(policy, {k: torch.randn_like(v) * 0.2 for k, v in adapter_state(policy).items()})
        if not merge_log(policy).entries:
            swap_reference_by_merge(policy, [])
    state = {f"policy.{k}": v for k, v in policy.state_dict().items()}
    if tamper:
        name = next(k for k in state if k.endswith("q_proj.base_layer.weight"))
        state[name] = state[name] + 1e-3
    torch.save({"state_dict": state, "lora_merge_log": merge_log(policy).state_dict(),
                "hyper_parameters": {"model_name": "tiny-random-llama", "dtype": "float32",
                                     "lora": {"r": 2, "alpha": 4.0}}}, path)
    return policy.eval()


def test_an_adapter_only_export_names_a_base_peft_loads(tmp_path, monkeypatch):
    """``export --adapter-only`` of a LoRA checkpoint of an alias: the adapter names the base written beside it, so
    ``AutoPeftModelForCausalLM.from_pretrained(OUT)`` loads it from any working directory and computes the merged
    export's logits (the trained policy's)."""
    import json

    from peft import AutoPeftModelForCausalLM

    policy = lora_checkpoint(tmp_path / "lora.ckpt")
    main(["export", str(tmp_path / "lora.ckpt"), str(tmp_path / "merged")])
    main(["export", "--adapter-only", str(tmp_path / "lora.ckpt"), str(tmp_path / "adapter")])
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "adapter" / "base").resolve())
    assert config["r"] == 2 * 2  # one merge and the current adapter, stacked onto the starting base
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (tmp_path / "adapter" / "base" / name).is_file(), name
    monkeypatch.chdir(tmp_path / "merged")  # the path is absolute: another working directory loads it too
    loaded = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "adapter")
    want = logits(merged, tiny_tokenizer())
    assert (want - logits(tiny_llama(len(tiny_tokenizer())), tiny_tokenizer())).abs().max() > 1e-3  # trained
    torch.testing.assert_close(logits(loaded, tokenizer), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits(policy, tiny_tokenizer()), want, rtol=0, atol=1e-5)


def test_an_adapter_only_export_refuses_a_base_that_changed_since_training(tmp_path):
    from lit_grpo.cli.export import export_checkpoint

    lora_checkpoint(tmp_path / "lora.ckpt", tamper=True)
    with pytest.raises(ValueError, match=r"'tiny-random-llama' \(float32\) loads now as a base whose hash after the "
                                         r"policy's 1 merge\(s\) is .*the model changed since training"):
        export_checkpoint(tmp_path / "lora.ckpt", tmp_path / "adapter", adapter_only=True)
    assert not (tmp_path / "adapter" / "base").exists() and not (tmp_path / "adapter" / "adapter_config.json").exists()


def test_an_adapter_names_a_hub_base_by_its_id_and_other_bases_by_the_written_path(tmp_path):
    from lit_grpo.models.adapter_export import adapter_base_name

    written = tmp_path / "out" / "base"
    assert adapter_base_name("HuggingFaceTB/SmolLM2-135M-Instruct", written) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert adapter_base_name("tiny-random-llama", written) == str(written.resolve())  # an alias loads nowhere else
    (tmp_path / "local").mkdir()
    assert adapter_base_name(str(tmp_path / "local"), written) == str(written.resolve())

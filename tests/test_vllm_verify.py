"""The check of each push to ``vllm serve`` (``lit_grpo.engines.remote.vllm_verify``) against a server model built
here the way vLLM lays one out: q, k, v fused, gate and up fused, the embedding padded, the norms as sent. The real
server's side is ``tests/test_vllm_push_check.py`` (vLLM tier)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from lit_grpo.engines.remote.vllm_verify import (
    PushNotApplied,
    SentRecord,
    check_push,
    served_digests,
    sha256,
)

URL = "http://127.0.0.1:8000"


def policy(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (100, 16), "model.layers.0.input_layernorm.weight": (16,),
              "model.layers.0.self_attn.q_proj.weight": (16, 16), "model.layers.0.self_attn.k_proj.weight": (8, 16),
              "model.layers.0.self_attn.v_proj.weight": (8, 16), "model.layers.0.self_attn.o_proj.weight": (16, 16),
              "model.layers.0.mlp.gate_proj.weight": (32, 16), "model.layers.0.mlp.up_proj.weight": (32, 16),
              "model.layers.0.mlp.down_proj.weight": (16, 32), "model.norm.weight": (16,)}
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def served(weights: dict[str, torch.Tensor], skip: tuple[str, ...] = ()) -> dict[str, str]:
    """``/weight_checker``'s answer for a server that loaded ``weights`` in vLLM's layout, with every parameter whose
    name contains one of ``skip`` left as zeros (a load that dropped them); hashed with hashlib directly."""
    layer = "model.layers.0."
    fused = {
        "model.embed_tokens.weight": torch.cat([weights["model.embed_tokens.weight"], torch.zeros(28, 16)]),
        layer + "self_attn.qkv_proj.weight": torch.cat([weights[layer + f"self_attn.{p}_proj.weight"] for p in "qkv"]),
        layer + "mlp.gate_up_proj.weight": torch.cat([weights[layer + "mlp.gate_proj.weight"],
                                                      weights[layer + "mlp.up_proj.weight"]]),
        **{name: weights[name] for name in (layer + "input_layernorm.weight", layer + "self_attn.o_proj.weight",
                                            layer + "mlp.down_proj.weight", "model.norm.weight")},
    }
    out = {}
    for name, tensor in fused.items():
        kept = torch.zeros_like(tensor) if any(s in name for s in skip) else tensor
        out["dp0:pp0:pcp0:tp0:" + name] = hashlib.sha256(kept.contiguous().numpy().tobytes()).hexdigest()
    return out


def sent(weights: dict[str, torch.Tensor]) -> SentRecord:
    record = SentRecord()
    for name, tensor in weights.items():
        record.add(name, tensor)
    return record


def test_sha256_is_the_servers_digest_of_the_bytes():
    tensor = torch.randn(3, 5)
    assert sha256(tensor) == hashlib.sha256(tensor.numpy().tobytes()).hexdigest()
    assert sha256(tensor.t()) == hashlib.sha256(tensor.t().contiguous().numpy().tobytes()).hexdigest()


def test_served_digests_strip_vllms_rank_prefix_keep_each_shards_digest_and_leave_out_emptied_parameters():
    checksums = {"dp0:pp0:pcp0:tp0:model.norm.weight": "a", "dp0:pp0:pcp0:tp1:model.norm.weight": "a",
                 "dp0:pp0:pcp0:tp0:o.weight": "b", "dp0:pp0:pcp0:tp1:o.weight": "c",
                 "dp0:pp0:pcp0:tp0:packed.weight": sha256(torch.empty(0))}  # a CPU-packed linear layer
    assert served_digests(checksums) == {"model.norm.weight": frozenset({"a"}), "o.weight": frozenset({"b", "c"})}


def test_pushes_that_took_effect_pass_and_the_norms_are_learnt_as_held_as_sent():
    first = policy(0)
    state = check_push(URL, 1, sent(first), served_digests(served(first)), None)
    # what this server keeps as sent: the norms, and (as on a GPU, whose linear layers are not repacked) o_proj
    # and down_proj; not the fused projections nor the padded embedding
    held = {"model.layers.0.input_layernorm.weight", "model.norm.weight", "model.layers.0.self_attn.o_proj.weight",
            "model.layers.0.mlp.down_proj.weight"}
    assert state.held_as_sent == held
    assert state.moves is None  # learnt at the next push, which moves every tensor
    weights = policy(2)
    state = check_push(URL, 2, sent(weights), served_digests(served(weights)), state)
    assert len(state.moves) == 7 and state.stale == ()
    weights = policy(3)
    state = check_push(URL, 3, sent(weights), served_digests(served(weights)), state)
    assert state.held_as_sent == held and len(state.moves) == 7 and state.stale == ()


def test_a_push_that_did_not_take_effect_stops_naming_the_server_and_the_parameters():
    first, second = policy(0), policy(1)
    state = check_push(URL, 1, sent(first), served_digests(served(first)), None)
    with pytest.raises(PushNotApplied, match=rf"rollout server {URL}: the push of step 2 did not take effect: 4 of 4 "
                                             r"parameters .*\(model.layers.0.input_layernorm.weight, "
                                             r"model.layers.0.mlp.down_proj.weight, "
                                             r"model.layers.0.self_attn.o_proj.weight and 1 more\)"):
        check_push(URL, 2, sent(second), served_digests(served(first)), state)  # the server kept the first weights


def test_a_load_that_left_some_parameters_out_stops_when_every_pushed_tensor_moved():
    first, second, third = policy(0), policy(1), policy(2)
    state = check_push(URL, 1, sent(first), served_digests(served(first)), None)
    state = check_push(URL, 2, sent(second), served_digests(served(second)), state)  # learns what moves
    # every pushed tensor moved, but the server kept the old qkv: its digest is the previous push's
    stale = served(third)
    qkv = "dp0:pp0:pcp0:tp0:model.layers.0.self_attn.qkv_proj.weight"
    stale[qkv] = served(second)[qkv]
    with pytest.raises(PushNotApplied, match=r"did not take effect in full: 1 of 7 served parameters that moved with "
                                             r"the policy kept .*\(model.layers.0.self_attn.qkv_proj.weight\)"):
        check_push(URL, 3, sent(third), served_digests(stale), state)


def test_a_parameter_that_never_moves_is_reported_once_and_left_out_of_later_checks():
    first, second, third = policy(0), policy(1), policy(2)
    state = check_push(URL, 1, sent(first), served_digests(served(first, skip=("gate_up",))), None)
    state = check_push(URL, 2, sent(second), served_digests(served(second, skip=("gate_up",))), state)
    assert state.stale == ("model.layers.0.mlp.gate_up_proj.weight",) and len(state.moves) == 6
    state = check_push(URL, 3, sent(third), served_digests(served(third, skip=("gate_up",))), state)
    assert state.stale == ()


def test_frozen_parameters_skip_the_moved_check_but_not_the_held_check():
    first = policy(0)
    second = {**policy(1), "model.layers.0.self_attn.q_proj.weight": first["model.layers.0.self_attn.q_proj.weight"],
              "model.layers.0.self_attn.k_proj.weight": first["model.layers.0.self_attn.k_proj.weight"],
              "model.layers.0.self_attn.v_proj.weight": first["model.layers.0.self_attn.v_proj.weight"]}
    state = check_push(URL, 1, sent(first), served_digests(served(first)), None)
    # attention frozen: the served qkv keeps its bytes, rightly; with a tensor unmoved the moved check is skipped
    state = check_push(URL, 2, sent(second), served_digests(served(second)), state)
    third = policy(2)
    with pytest.raises(PushNotApplied, match=r"did not take effect: 1 of 4 .*\(model.norm.weight\)"):
        check_push(URL, 3, sent(third), served_digests(served(third, skip=("model.norm",))), state)


def test_the_first_push_must_leave_at_least_one_tensor_as_sent():
    weights = policy(0)
    with pytest.raises(PushNotApplied, match=rf"rollout server {URL}: after the push of step 1 it holds none of the 10 "
                                             r"small pushed tensors .*verify_pushes: false"):
        check_push(URL, 1, sent(weights), served_digests(served(policy(5))), None)  # another model entirely

"""The one weight-push round format (``lit_grpo.wire.push_format``): its packer and validator against expectations
computed by hand, and a malformed round sent to each receiver -- the project's server and the gloo vLLM plugin's
worker, over a real gloo group in this process -- refused with the bad entries named and nothing loaded (weights,
version and layers as they were), while the sender's broadcast fails at once instead of waiting out the timeout.
A well-formed round through the same code loads, so the refusals are the manifest's doing."""

from __future__ import annotations

import datetime
import sys
import threading
import time
import types

import pytest
import torch
import torch.distributed as dist

from lit_grpo.wire.push_format import (
    Expected,
    PushFormatError,
    PushManifest,
    bucket_manifest,
    check_round,
    pack_bucket,
    round_manifest,
    validate,
)
from lit_grpo.wire.weight_transfer import bucket_spans, open_group, open_store, unpack

F32, BF16, I64, U8 = torch.float32, torch.bfloat16, torch.int64, torch.uint8
#: 24, 8, 40 and 3 bytes
ENTRIES = [("a", F32, [2, 3]), ("b", BF16, [4]), ("c", I64, [5]), ("d", U8, [3])]
HELD = {"a": Expected(F32, (2, 3)), "b": Expected(BF16, (4,)), "c": Expected(I64, (5,)), "d": Expected(U8, (3,))}
GOOD = {"names": ["a", "b", "c", "d"], "dtype_names": ["float32", "bfloat16", "int64", "uint8"],
        "shapes": [[2, 3], [4], [5], [3]], "spans": [[0, 2, 32], [2, 3, 40], [3, 4, 3]]}


def with_entry(index: int, **changes: object) -> dict:
    """GOOD with entry ``index`` changed (``name``, ``dtype``, ``shape``) or its ``spans`` replaced."""
    info = {key: [list(v) if isinstance(v, list) else v for v in values] for key, values in GOOD.items()}
    for key, field in (("name", "names"), ("dtype", "dtype_names"), ("shape", "shapes")):
        if key in changes:
            info[field][index] = changes[key]
    if "spans" in changes:
        info["spans"] = changes["spans"]
    return info


#: a malformed round of each kind, and what its refusal must say
MALFORMED = {
    "wrong name": (with_entry(1, name="bogus"), "'bogus': unknown parameter"),
    "wrong shape": (with_entry(0, shape=[3, 2]), "'a': shape [3, 2], expected [2, 3]"),
    "wrong dtype": (with_entry(1, dtype="float16"), "'b': dtype float16, expected bfloat16 (cast before sending)"),
    "spans that do not add up": (with_entry(0, spans=[[0, 2, 32], [2, 3, 41], [3, 4, 3]]),
                                 "span 1 [2, 3) announces 41 bytes, its tensors hold 40"),
}


# ---- the packer ---------------------------------------------------------------------------------------------------
def test_round_manifest_is_the_json_of_the_round_with_its_spans():
    manifest = round_manifest(ENTRIES, 32)
    assert manifest.to_json() == GOOD  # 24 + 8 = 32 fit; 40 alone; 3 alone (40 + 3 > 32)
    assert PushManifest.from_json(GOOD) == manifest
    assert validate(manifest, HELD) == [F32, BF16, I64, U8]
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1, got 0"):
        round_manifest(ENTRIES, 0)


def test_a_bucket_is_packed_once_and_unpacks_to_the_same_tensors():
    bucket = [("a", torch.arange(6, dtype=F32).reshape(2, 3)), ("b", torch.tensor([1.5, -2, 3, 4], dtype=BF16)),
              ("c", torch.arange(5, dtype=I64))]
    manifest, packed = pack_bucket(bucket, torch.device("cpu"))
    assert manifest.to_json() == {"names": ["a", "b", "c"], "dtype_names": ["float32", "bfloat16", "int64"],
                                  "shapes": [[2, 3], [4], [5]], "spans": [[0, 3, 72]]}
    assert packed.dtype == U8 and packed.numel() == 72
    assert bytes(packed.numpy()) == b"".join(bytes(t.view(U8).numpy()) for _, t in bucket)
    for (_, sent), got in zip(bucket, unpack(packed, [F32, BF16, I64], manifest.shapes)):
        assert got.dtype == sent.dtype and torch.equal(got, sent)
    assert bucket_manifest(bucket[:1]).spans == [[0, 1, 24]]


def test_an_announcement_without_spans_is_one_bucket():
    info = {key: GOOD[key] for key in ("names", "dtype_names", "shapes")}
    assert PushManifest.from_json(info).spans == [[0, 4, 75]]


@pytest.mark.parametrize(("info", "message"), [
    ([1, 2], "expected an object"),
    ({**GOOD, "packed": True}, r"unknown fields \['packed'\]"),
    ({**GOOD, "names": ["a", "b"]}, "names, dtype_names and shapes differ in length: 2, 4, 4"),
    ({**GOOD, "shapes": [[2, 3], [4], [5], [-1]]}, r"entry 3 \('d', 'uint8', \[-1\]\)"),
    ({**GOOD, "shapes": [[2, 3], [4], [5], "3"]}, "entry 3"),
    ({**GOOD, "names": "abcd"}, "names must be a list, got str"),
    ({"names": [], "dtype_names": [], "shapes": []}, "no tensors announced"),
    ({**GOOD, "spans": [[0, 4]]}, r"spans must be a list of \[start, stop, nbytes\]"),
])
def test_what_is_not_a_manifest_is_refused_in_one_line(info, message):
    with pytest.raises(PushFormatError, match=message) as err:
        PushManifest.from_json(info)
    assert "\n" not in str(err.value) and str(err.value).startswith("malformed weight-push round")


# ---- the validator ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_the_validator_names_the_bad_entry(case):
    info, message = MALFORMED[case]
    with pytest.raises(PushFormatError, match=r"malformed weight-push round refused by R, nothing loaded: ") as err:
        validate(PushManifest.from_json(info), HELD, receiver="R")
    assert message in str(err.value)


@pytest.mark.parametrize(("spans", "message"), [
    ([[0, 2, 32], [3, 4, 3]], "span 1 [3, 4) does not follow on from tensor 2 (of 4)"),  # a gap
    ([[0, 2, 32], [1, 3, 48]], "span 1 [1, 3) does not follow on from tensor 2"),  # an overlap
    ([[0, 2, 32], [2, 2, 0], [2, 4, 43]], "span 1 [2, 2) does not follow on from tensor 2"),  # empty
    ([[0, 2, 32], [2, 3, 40]], "the spans cover tensors 0..2 of 4"),  # short
    ([[0, 2, 32], [2, 5, 43]], "span 1 [2, 5) does not follow on from tensor 2 (of 4)"),  # past the end
])
def test_spans_must_cover_the_tensors_in_order(spans, message):
    with pytest.raises(PushFormatError) as err:
        validate(PushManifest.from_json({**GOOD, "spans": spans}), HELD)
    assert message in str(err.value)


def test_every_bad_entry_counts_and_the_first_ones_are_listed():
    info = {"names": [f"x{i}" for i in range(7)] + ["a", "a"], "dtype_names": ["float32"] * 6 + ["nope"] * 3,
            "shapes": [[1]] * 7 + [[2, 3]] * 2}
    with pytest.raises(PushFormatError) as err:
        validate(PushManifest.from_json(info), HELD, seen={"b"})
    message = str(err.value)
    assert "'x0': unknown parameter; 'x1': unknown parameter" in message and "(and 4 more)" in message
    # a known name: sent twice in one round, or already sent earlier in the push, is refused too
    with pytest.raises(PushFormatError, match="'a': sent twice in this round"):
        validate(PushManifest.from_json({"names": ["a", "a"], "dtype_names": ["float32"] * 2,
                                         "shapes": [[2, 3]] * 2}), HELD)
    with pytest.raises(PushFormatError, match="'b': sent twice in this round"):
        validate(round_manifest(ENTRIES[1:2], 8), HELD, seen={"b"})
    with pytest.raises(PushFormatError, match="'a': unknown dtype 'nope'"):
        validate(PushManifest.from_json({"names": ["a"], "dtype_names": ["nope"], "shapes": [[2, 3]]}), HELD)


def test_a_bucket_above_the_receivers_limit_is_refused_unless_it_is_one_tensor():
    with pytest.raises(PushFormatError, match=r"span 0 \[0, 2\) holds 32 bytes, above the bucket limit 31"):
        validate(round_manifest(ENTRIES, 32), HELD, max_bucket_bytes=31)
    validate(round_manifest(ENTRIES, 31), HELD, max_bucket_bytes=31)  # c (40 bytes) travels alone


def test_loose_dims_take_a_packed_shard_or_a_split_up_to_the_scale():
    packed = Expected(F32, (12, 4), loose_dims=(0,))
    assert packed.shape_error([8, 4]) is None and packed.shape_error([12, 4]) is None
    assert packed.shape_error([13, 4]) == "shape [13, 4], expected [12, 4] (dims [0] up to x1)"
    assert packed.shape_error([8, 5]) is not None and packed.shape_error([8]) is not None
    split = Expected(F32, (6, 4), loose_dims=(0,), scale=2)
    assert split.shape_error([12, 4]) is None and split.shape_error([13, 4]) is not None
    assert Expected(F32, (2, 3)).shape_error([3, 2]) == "shape [3, 2], expected [2, 3]"


def test_the_trainer_checks_a_round_no_receiver_will():
    assert check_round(ENTRIES).spans == [[0, 4, 75]]
    assert check_round(ENTRIES, 32).to_json() == GOOD
    with pytest.raises(PushFormatError, match="refused by the trainer.*'a': sent twice in this round"):
        check_round([*ENTRIES, ("a", F32, [2, 3])])
    with pytest.raises(PushFormatError, match="'e': dtype float8_e4m3fn cannot travel"):
        check_round([*ENTRIES, ("e", torch.float8_e4m3fn, [2])])


# ---- a real gloo group in this process: the test is rank 0, the receiver rank 1 -------------------------------------
class Sender:
    """Rank 0 of a push group: opens the store, joins on a thread, and broadcasts buckets on a thread."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.store, _ = open_store("127.0.0.1", timeout_s)
        self.timeout_s = timeout_s
        self.group: dist.ProcessGroup | None = None
        self.joining = threading.Thread(target=self._join, daemon=True)
        self.joining.start()
        self.outcome: dict = {}

    def _join(self) -> None:
        self.group = open_group(self.store, 0, 2, "gloo", self.timeout_s, "127.0.0.1")

    def joined(self) -> Sender:
        self.joining.join(self.timeout_s)
        assert self.group is not None
        return self

    def broadcast(self, buffers: list[torch.Tensor]) -> threading.Thread:
        """Send ``buffers`` on a thread; ``outcome`` gets ``error`` or ``done`` and the seconds it took."""
        from lit_grpo.wire.weight_transfer import wait_work

        def run() -> None:
            start = time.monotonic()
            try:
                for buffer in buffers:
                    wait_work(self.group.broadcast(buffer, root=0), self.timeout_s)
                self.outcome["done"] = True
            except Exception as err:  # noqa: BLE001
                self.outcome["error"] = err
            self.outcome["seconds"] = time.monotonic() - start

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


def packed_round(tensors: list[tuple[str, torch.Tensor]]) -> tuple[PushManifest, list[torch.Tensor]]:
    """The project's server's announcement of one bucket and its bytes."""
    manifest, packed = pack_bucket(tensors, torch.device("cpu"))
    return manifest, [packed]


# ---- (a) the project's server --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_server():
    from lit_grpo.models.loading import load_model_and_tokenizer
    from lit_grpo.serve.server import RolloutServer

    model, tokenizer = load_model_and_tokenizer("tiny-random-llama")
    return RolloutServer(model, tokenizer, "tiny-random-llama", "t" * 32), model


def joined_receiver(server) -> Sender:  # noqa: ANN001
    sender = Sender()
    info = {"master_address": "127.0.0.1", "master_port": sender.store.port, "rank_offset": 1, "world_size": 2,
            "backend": "gloo", "timeout_s": 30.0}
    server.receiver.init_weight_transfer_engine({"init_info": info}, {})
    return sender.joined()


def malformed_for_server(model: torch.nn.Module, case: str) -> tuple[dict, list[torch.Tensor]]:
    """A bucket of the model's first two parameters (new values), announced with the defect of ``case``, and the
    bytes the sender broadcasts."""
    (n1, p1), (n2, p2) = list(model.named_parameters())[:2]
    manifest, payload = packed_round([(n1, p1.detach() + 1), (n2, p2.detach() + 1)])
    info = manifest.to_json()
    if case == "wrong name":
        info["names"][1] = "model.layers.99.mlp.up_proj.weight"
    elif case == "wrong shape":
        info["shapes"][0] = info["shapes"][0][::-1]
    elif case == "wrong dtype":
        info["dtype_names"][1] = "float16"
    else:
        info["spans"][0][2] += 4
    return info, payload


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_the_project_server_refuses_a_malformed_round_and_loads_nothing(tiny_server, case):
    from lit_grpo.wire.protocol import HTTPFailure

    server, model = tiny_server
    receiver = server.receiver
    server.policy.weight_version = "4"
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    sender = joined_receiver(server)
    receiver.start_weight_update({}, {})
    info, payload = malformed_for_server(model, case)
    sending = sender.broadcast(payload)
    with pytest.raises(HTTPFailure) as refused:
        receiver.update_weights({"update_info": info}, {})
    message = refused.value.message
    assert refused.value.status == 400 and "\n" not in message
    assert message.startswith("malformed weight-push round refused by this server (tiny-random-llama), nothing "
                              "loaded: ")
    assert "weight version stays '4'" in message and "the transfer group is closed" in message
    expected = {"wrong name": "'model.layers.99.mlp.up_proj.weight': unknown parameter",
                "wrong shape": f"shape {info['shapes'][0]}, expected {info['shapes'][0][::-1]}",
                "wrong dtype": "dtype float16, expected float32 (cast before sending)",
                "spans that do not add up": f"announces {info['spans'][0][2]} bytes"}[case]
    assert expected in message
    # nothing loaded, the push dropped, and the sender learns it at once (the group is gone)
    assert receiver.group is None and receiver.staging is None
    assert server.policy.weight_version == "4"
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    sending.join(20)
    assert "error" in sender.outcome and sender.outcome["seconds"] < 15
    with pytest.raises(HTTPFailure, match="no weight update in progress"):
        receiver.finish_weight_update({"weight_version": "5"}, {})
    assert server.policy.weight_version == "4"


def test_the_project_server_loads_a_well_formed_round_through_the_same_path(tiny_server):
    server, model = tiny_server
    receiver = server.receiver
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    try:
        sender = joined_receiver(server)
        receiver.start_weight_update({}, {})
        params = [(name, p.detach() + 1) for name, p in model.named_parameters()]
        for start, stop in bucket_spans([p.numel() * 4 for _, p in params], 1 << 16):
            manifest, payload = packed_round(params[start:stop])
            sending = sender.broadcast(payload)
            receiver.update_weights({"update_info": manifest.to_json()}, {})
            sending.join(20)
            assert sender.outcome.pop("done")
        assert receiver.finish_weight_update({"weight_version": "9"}, {})["weight_version"] == "9"
        assert all(torch.equal(p, before[name] + 1) for name, p in model.named_parameters())
    finally:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(before[name])
        receiver.shutdown_weight_transfer_engine({}, {})


# ---- (b) the gloo vLLM plugin's worker, on stand-ins for vLLM's base class and model ----------------------------
def column_loader(param, loaded, shard=None) -> None:  # noqa: ANN001
    """A stand-in for a vLLM layer's own loader (packed rows: q then k)."""
    start = {None: 0, "q": 0, "k": 4}[shard]
    param.data[start:start + loaded.shape[0]].copy_(loaded)


class FakeVLLMModel(torch.nn.Module):
    """A model as vLLM builds it: a packed ``qkv_proj`` (q: 4 rows, k: 2 rows) taking the checkpoint's ``q_proj``
    and ``k_proj``, a plain ``norm``; ``load_weights`` records what it was given."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj"]}

    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = torch.nn.Parameter(torch.randn(6, 3))
        self.qkv_proj.weight_loader = column_loader
        self.qkv_proj.output_dim, self.qkv_proj.input_dim = 0, 1
        self.norm = torch.nn.Parameter(torch.randn(3))
        self.loaded: list[str] = []

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            self.loaded.append(name)
            if name == "norm":
                self.norm.data.copy_(tensor)
            else:
                column_loader(self.qkv_proj, tensor, name[0])


@pytest.fixture
def gloo_worker(monkeypatch):
    """A gloo worker engine over ``FakeVLLMModel``, its layerwise-reload calls recorded."""
    from fake_vllm import gloo_worker_over

    model = FakeVLLMModel()
    worker, calls = gloo_worker_over(model, monkeypatch)
    yield worker, model, calls
    worker.shutdown()


def joined_worker(worker) -> Sender:  # noqa: ANN001
    """The worker in a push group with this test as the trainer (the token check is the init's, tested apart)."""
    sender = Sender()
    client = dist.TCPStore("127.0.0.1", sender.store.port, 2, False, datetime.timedelta(seconds=30))
    worker.store, worker.group = client, open_group(client, 1, 2, "gloo", 30.0, "127.0.0.1")
    worker.timeout_s, worker.bucket_bytes = 30.0, 64
    return sender.joined()


def plugin_round(entries: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> tuple[dict, list[torch.Tensor]]:
    """The gloo trainer's round: one manifest, one packed buffer per span."""
    manifest = round_manifest(((name, t.dtype, t.shape) for name, t in entries), bucket_bytes)
    payload = [pack_bucket(entries[start:stop], torch.device("cpu"))[1] for start, stop, _ in manifest.spans]
    return manifest.to_json(), payload


SHARDS = [("q_proj", torch.full((4, 3), 2.0)), ("k_proj", torch.full((2, 3), 3.0)), ("norm", torch.full((3,), 5.0))]


def test_model_expectations_resolve_packed_shards_and_plain_parameters():
    from lit_grpo.wire.vllm_gloo import model_expectations

    lookup = model_expectations(FakeVLLMModel(), tensor_parallel_size=2)
    assert lookup("norm") == Expected(F32, (3,))
    assert lookup("q_proj") == Expected(F32, (6, 3), (0, 1), 2)
    assert lookup("qkv_proj") == Expected(F32, (6, 3), (0, 1), 2)  # its own loader: may come split over ranks
    assert lookup("v_proj") is None and lookup("bogus") is None


def test_a_layer_wrapped_for_lora_counts_under_the_checkpoint_s_name():
    """``vllm serve --enable-lora`` moves each target layer under ``base_layer`` of its LoRA wrapper; the pushed
    (checkpoint) names still load into it."""
    from lit_grpo.wire.vllm_gloo import model_expectations, model_format_parameters

    class Wrapped(torch.nn.Module):  # vLLM's ...WithLoRA: the layer as base_layer, beside the adapters' slots
        def __init__(self, layer: torch.nn.Module) -> None:
            super().__init__()
            self.base_layer = layer

    model = FakeVLLMModel()
    model.embed = Wrapped(torch.nn.Embedding(5, 3))
    params = model_format_parameters(model)
    assert params["embed.weight"] is params["embed.base_layer.weight"]
    assert model_expectations(model, params=params)("embed.weight") == Expected(F32, (5, 3))
    assert "embed.weight" not in dict(model.named_parameters())  # the alias is the check's, not the model's


def test_the_worker_checks_against_the_format_vllm_recorded_not_its_kernels(monkeypatch):
    """vLLM on a CPU repacks a linear layer's weight for its kernels and leaves an empty placeholder; the shapes a
    round must match are the ones it recorded for reloading."""
    from lit_grpo.wire.vllm_gloo import model_expectations, model_format_parameters

    model = FakeVLLMModel()
    recorded = {"qkv_proj": model.qkv_proj.detach().to("meta")}
    model.qkv_proj = torch.nn.Parameter(torch.empty(0))  # the kernel's placeholder
    info = types.SimpleNamespace(restore_metadata=(recorded, {}))
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.reload.layerwise",
                        types.SimpleNamespace(LAYERWISE_INFO={model: info}))
    params = model_format_parameters(model)
    assert set(params) == {"qkv_proj", "norm"} and params["qkv_proj"].shape == (6, 3)
    assert model_expectations(model, params=params)("q_proj") == Expected(F32, (6, 3), (0,), 1)
    assert model_expectations(model)("q_proj") == Expected(F32, (0,), (0,), 1)  # the live placeholder


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_the_gloo_plugin_refuses_a_malformed_round_before_any_layer_is_set_aside(gloo_worker, case):
    worker, model, calls = gloo_worker
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    sender = joined_worker(worker)
    info, payload = plugin_round(SHARDS, 64)
    info = {**info, "names": list(info["names"]), "dtype_names": list(info["dtype_names"]),
            "shapes": [list(s) for s in info["shapes"]], "spans": [list(s) for s in info["spans"]]}
    if case == "wrong name":
        info["names"][2] = "bogus"
    elif case == "wrong shape":
        info["shapes"][0] = [4, 4]
    elif case == "wrong dtype":
        info["dtype_names"][2] = "bfloat16"
    else:
        info["spans"][-1][2] -= 4
    sending = sender.broadcast(payload)
    worker.start_weight_update()
    with pytest.raises(PushFormatError) as refused:
        worker.update_weights(info)
    message = str(refused.value)
    assert message.startswith("malformed weight-push round refused by the vLLM worker, nothing loaded: ")
    expected = {"wrong name": "'bogus': unknown parameter",
                "wrong shape": "'q_proj': shape [4, 4], expected [6, 3] (dims [0, 1] up to x1)",
                "wrong dtype": "'norm': dtype bfloat16, expected float32",
                "spans that do not add up": "span 1 [1, 3) announces 32 bytes, its tensors hold 36"}[case]
    assert expected in message and "\n" not in message
    assert calls == [] and model.loaded == []  # no layer set aside, nothing given to load_weights
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert worker.group is None  # refused: the group goes, and with it the trainer's broadcast
    sending.join(20)
    assert "error" in sender.outcome and sender.outcome["seconds"] < 15
    worker.finish_weight_update()
    assert calls == []


def test_the_gloo_plugin_refuses_what_is_not_a_manifest(gloo_worker):
    worker, model, calls = gloo_worker
    joined_worker(worker)
    with pytest.raises(PushFormatError, match="refused by the vLLM worker, nothing loaded: .*unexpected keyword"):
        worker.update_weights({**plugin_round(SHARDS, 64)[0], "packed": True})
    assert calls == [] and model.loaded == [] and worker.group is None
    joined_worker(worker)
    with pytest.raises(PushFormatError) as refused:
        worker.update_weights({**plugin_round(SHARDS, 64)[0], "names": ["q_proj"]})
    assert str(refused.value) == ("malformed weight-push round refused by the vLLM worker, nothing loaded: names, "
                                  "dtype_names and shapes differ in length: 1, 3, 3")
    assert calls == [] and model.loaded == [] and worker.group is None


def test_the_gloo_plugin_loads_a_well_formed_round(gloo_worker):
    worker, model, calls = gloo_worker
    sender = joined_worker(worker)
    info, payload = plugin_round(SHARDS, 64)
    assert info["spans"] == [[0, 1, 48], [1, 3, 36]]  # 48 + 24 > 64: q_proj alone
    sending = sender.broadcast(payload)
    worker.start_weight_update()
    assert calls == []
    worker.update_weights(info)
    sending.join(20)
    assert sender.outcome.get("done")
    worker.finish_weight_update()
    assert calls == ["initialize", "finalize"] and model.loaded == ["q_proj", "k_proj", "norm"]
    assert torch.equal(model.qkv_proj, torch.cat([torch.full((4, 3), 2.0), torch.full((2, 3), 3.0)]))
    assert torch.equal(model.norm, torch.full((3,), 5.0))


# ---- the plugin's own trainer side to its worker: the refusal reaches the trainer at once ---------------------------
@pytest.fixture
def gloo_trainer(gloo_worker, monkeypatch):
    """The plugin's trainer engine (on stand-ins for vLLM's trainer base classes) in a group with ``gloo_worker``,
    its client calling the worker's routes directly, as ``vllm serve`` does over HTTP."""
    from dataclasses import dataclass, field

    from lit_grpo.wire.vllm_gloo import make_trainer_engine_class

    @dataclass
    class TrainerInitInfo:
        rank: int = field(kw_only=True)

    class TrainerWeightTransferEngine:
        def __init__(self, *, client, source=None, is_sender=True) -> None:  # noqa: ANN001
            self.client, self.source, self.is_sender = client, source, is_sender

    base = sys.modules["vllm.distributed.weight_transfer.base"]
    monkeypatch.setattr(base, "TrainerInitInfo", TrainerInitInfo, raising=False)
    monkeypatch.setattr(base, "TrainerWeightTransferEngine", TrainerWeightTransferEngine, raising=False)
    worker, model, calls = gloo_worker
    client = types.SimpleNamespace(start_weight_update=worker.start_weight_update,
                                   update_weights=worker.update_weights,
                                   finish_weight_update=worker.finish_weight_update)
    trainer = make_trainer_engine_class()(client=client, source=None, is_sender=True, bucket_bytes=64, timeout_s=30.0)
    trainer.group = joined_worker(worker).group
    return trainer, worker, model, calls


class Source:
    """A ``WeightSource`` (vLLM 0.32's shape) declaring ``meta`` and yielding ``tensors``."""

    def __init__(self, meta: list[tuple[str, torch.dtype, tuple]], tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.meta, self.tensors = meta, tensors

    def metadata(self) -> list:
        return [types.SimpleNamespace(name=n, dtype=d, shape=s) for n, d, s in self.meta]

    def __iter__(self):  # noqa: ANN204
        return iter(self.tensors)


def test_the_plugins_trainer_sends_one_round_the_worker_loads(gloo_trainer):
    trainer, _, model, calls = gloo_trainer
    trainer.source = Source([(n, t.dtype, tuple(t.shape)) for n, t in SHARDS], SHARDS)
    trainer.send_weights()
    assert calls == ["initialize", "finalize"] and model.loaded == ["q_proj", "k_proj", "norm"]
    assert torch.equal(model.norm, torch.full((3,), 5.0))


def test_a_round_the_worker_refuses_fails_the_trainer_at_once_with_the_workers_reason(gloo_trainer):
    trainer, worker, model, calls = gloo_trainer
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    wrong = [("q_proj", torch.zeros(3, 4)), *SHARDS[1:]]  # transposed
    trainer.source = Source([(n, t.dtype, tuple(t.shape)) for n, t in wrong], wrong)
    start = time.monotonic()
    with pytest.raises(PushFormatError, match=r"refused by the vLLM worker, nothing loaded: 'q_proj': shape \[3, 4\]"):
        trainer.send_weights()
    assert time.monotonic() - start < 15  # not the transfer's 30 s timeout
    assert calls == [] and model.loaded == [] and worker.group is None
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())

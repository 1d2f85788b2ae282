"""pi_ref on the rollout server (``data.reference_on_server``), against a real server process: the push of pi_ref
leaves the rollout policy alone, the server's log-probs equal the trainer's scoring of the same micro-batches bit
for bit (one thread each, float32), a request for another version or before any push is refused, and bad requests
and settings get a clear error before anything runs."""

from __future__ import annotations

import copy

import pytest
import torch
from server_process import ServerProcess

from lit_grpo.data.datamodule import RolloutDataModule
from lit_grpo.data.rollout import pad_rollouts
from lit_grpo.engines.base import Completion
from lit_grpo.models import eos_token_ids, load_model_and_tokenizer
from lit_grpo.scoring import completion_logprobs
from lit_grpo.serving.client import ServerEngine
from lit_grpo.serving.protocol import ServerError
from lit_grpo.serving.weight_transfer import checksum


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("reference"))
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def tiny():
    return load_model_and_tokenizer("tiny-random-llama")  # the server builds the very same weights


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the server's thread count: the same floating-point sums
    yield
    torch.set_num_threads(before)


def engine_for(server: ServerProcess, tiny) -> ServerEngine:
    model, tokenizer = tiny
    return ServerEngine(url=server.url, token=server.token, bucket_mb=0.05,
                        stop_token_ids=eos_token_ids(tokenizer, model))


def rollout_layout(micro_batch_size: int = 3):
    """Two prompts of different lengths x 3 completions of different lengths, as the data module pads them."""
    generator = torch.Generator().manual_seed(0)
    prompts = [[5, 9, 11, 2], [7, 3]]
    groups = []
    for g in range(2):
        group = []
        for j in range(3):
            n = 2 + (3 * g + 2 * j) % 5
            ids = torch.randint(3, 100, (n,), generator=generator).tolist()
            group.append(Completion(ids, [-1.0] * n, truncated=False, versions=("0",)))
        groups.append(group)
    padded = pad_rollouts(prompts, groups, pad_token_id=0)
    return padded, list(padded.micro_batches(micro_batch_size))


def test_the_server_scores_the_pushed_reference_exactly_as_the_trainer_would(server, tiny, one_thread):
    model, _ = tiny
    engine = engine_for(server, tiny)
    policy_before = {name: checksum(p) for name, p in model.named_parameters()}
    reference = copy.deepcopy(model)
    with torch.no_grad():  # a pi_ref unlike the served policy, so using the wrong model would show
        for p in reference.parameters():
            p.mul_(1.1)
    engine.load_reference(reference.named_parameters(), "3")
    assert engine.reference_version == "3"
    info = engine.servers[0].client.get("/weight_info")
    assert info["reference_version"] == "3"
    # the rollout policy is untouched by a push of pi_ref
    assert engine.weight_checksums()[server.url] == policy_before

    padded, micro_batches = rollout_layout()
    got, version = engine.score_reference(micro_batches, *padded.completion_ids.shape, temperature=0.7)
    assert version == "3" and got.shape == padded.completion_ids.shape
    with torch.no_grad():
        for mb in micro_batches:
            expected, _ = completion_logprobs(reference, mb, 0.7)
            assert torch.equal(mb.take(got), expected)
            policy_logp, _ = completion_logprobs(model, mb, 0.7)
            assert not torch.allclose(mb.take(got), policy_logp)
    untouched = torch.ones_like(padded.completion_mask, dtype=torch.bool)
    for mb in micro_batches:
        untouched[mb.rows, : mb.completion_ids.shape[1]] = False
    assert bool((got[untouched] == 0).all())  # columns past a micro-batch's width are padding everywhere

    # a trainer whose pi_ref label differs (a swap the server has not seen) is refused, naming both versions
    engine.reference_version = "4"
    with pytest.raises(ServerError, match="pi_ref version '3', not '4'"):
        engine.score_reference(micro_batches, *padded.completion_ids.shape, temperature=0.7)
    engine.close()


def test_scoring_before_any_push_and_bad_requests_are_refused(tmp_path, tiny):
    fresh = ServerProcess(tmp_path / "fresh")
    try:
        fresh.wait_ready()
        _, micro_batches = rollout_layout()
        mb = micro_batches[0]
        item = {"prompt_ids": mb.prompt_ids.tolist(), "prompt_mask": mb.prompt_mask.tolist(),
                "prompt_index": mb.prompt_index.tolist(), "completion_ids": mb.completion_ids.tolist(),
                "completion_mask": mb.completion_mask.tolist()}
        status, body = fresh.call("POST", "/reference/logprobs", {"reference_version": "0", "micro_batches": [item]})
        assert status == 409 and "holds no pi_ref" in body["error"]["message"]
        engine = ServerEngine(url=fresh.url, token=fresh.token, bucket_mb=0.05)
        with pytest.raises(ServerError, match="no pi_ref was pushed"):
            engine.score_reference(micro_batches, 6, 7, temperature=1.0)
        twos = [[2] * len(r) for r in item["completion_mask"]]
        bad = [
            ({"micro_batches": [item]}, "reference_version must be a string"),
            ({"reference_version": "0", "micro_batches": []}, "non-empty list"),
            ({"reference_version": "0", "micro_batches": [{**item, "prompt_index": [0, 5, 0]}]},
             "prompt_index must lie in"),
            ({"reference_version": "0", "micro_batches": [{**item, "completion_ids": [[1, 2], [3]]}]},
             "rectangular list of integers"),
            ({"reference_version": "0", "micro_batches": [{**item, "completion_mask": twos}]},
             "0 and 1 only"),
            ({"reference_version": "0", "temperature": 0, "micro_batches": [item]}, "temperature must be > 0"),
            ({"reference_version": "0", "autocast": "int8", "micro_batches": [item]}, "autocast must be one of"),
        ]
        for body_, message in bad:
            status, answer = fresh.call("POST", "/reference/logprobs", body_)
            assert status == 400 and message in answer["error"]["message"], (body_, answer)
        status, answer = fresh.call("POST", "/start_weight_update", {"target": "value_head"})
        assert status in (400, 409)
        engine.close()
    finally:
        fresh.kill()


def test_reference_on_server_needs_the_projects_server():
    with pytest.raises(ValueError, match="reference_on_server: true needs data.engine: server.*engine 'transformers'"):
        RolloutDataModule(reference_on_server=True)
    with pytest.raises(ValueError, match="reference_on_server: true needs .*a server of kind 'vllm'"):
        RolloutDataModule(engine="server", engine_options={"kind": "vllm", "url": "http://127.0.0.1:1"},
                          reference_on_server=True)
    with pytest.raises(ValueError, match="reference_on_server must be true or false, got 'yes'"):
        RolloutDataModule(reference_on_server="yes")


class RecordingEngine:
    """The part of ``ServerEngine`` that ``WeightSync`` uses for pi_ref: records what it was asked to push."""

    def __init__(self, serves_reference: bool = True) -> None:
        self.serves_reference = serves_reference
        self.reference_version = None
        self.pushed: list[tuple[str, list[str]]] = []

    def load_reference(self, named_tensors, version: str) -> None:  # noqa: ANN001
        self.pushed.append((version, [name for name, _ in named_tensors]))
        self.reference_version = version


def test_weight_sync_pushes_pi_ref_when_the_module_swapped_it():
    from types import SimpleNamespace

    from lit_grpo.callbacks import RefModelSwap, WeightSync

    module = SimpleNamespace(policy=torch.nn.Linear(2, 2), reference=torch.nn.Linear(2, 2), reference_version=0)
    sync, engine = WeightSync(), RecordingEngine()
    sync.push_reference_if_stale(engine, module)
    sync.push_reference_if_stale(engine, module)  # the server's copy is current: nothing to push
    assert engine.pushed == [("0", ["weight", "bias"])]
    RefModelSwap(every_n_batches=1).swap(SimpleNamespace(global_step=3, optimizers=[]), module)
    assert module.reference_version == 1 and torch.equal(module.reference.weight, module.policy.weight)
    sync.push_reference_if_stale(engine, module)
    assert [version for version, _ in engine.pushed] == ["0", "1"]
    # an engine that does not score pi_ref, or a module without one (beta = 0), pushes nothing
    for engine_, module_ in ((RecordingEngine(serves_reference=False), module),
                             (RecordingEngine(), SimpleNamespace(reference=None, reference_version=0))):
        sync.push_reference_if_stale(engine_, module_)
        assert engine_.pushed == []

"""pi_ref on the rollout server (``data.reference_on_server``), against a real server process: the push of pi_ref
leaves the rollout policy alone, the server's log-probs equal the trainer's scoring of the same micro-batches bit
for bit (one thread each, float32), a request for another version or before any push is refused, and bad requests
and settings get a clear error before anything runs."""

from __future__ import annotations

import copy
import json
import threading
from types import SimpleNamespace

import pytest
import torch
from server_process import ServerProcess

from lit_grpo.core.packing import packed_layout_kind
from lit_grpo.core.scoring import completion_logprobs, layout_logprobs
from lit_grpo.data.datamodule import RolloutDataModule
from lit_grpo.data.producer import RolloutProducer
from lit_grpo.data.rollout import collate_rollouts, pad_rollouts
from lit_grpo.data.server_reference import ServerReference
from lit_grpo.engines.base import Completion, ReferenceServing
from lit_grpo.engines.remote.client import Rollouts, ServerEngine
from lit_grpo.models.loading import eos_token_ids, load_model_and_tokenizer
from lit_grpo.serve.reference_routes import MICRO_BATCH_FIELDS
from lit_grpo.wire.protocol import ServerError
from lit_grpo.wire.weight_transfer import checksum

#: the module's server takes bodies up to this size (16 MiB by default): a batch whose scoring request as one body
#: would be larger must still be scored, one micro-batch per request
BODY_LIMIT = 20_000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("reference"), args=("--max-body-bytes", str(BODY_LIMIT)))
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def tiny():
    return load_model_and_tokenizer("tiny-random-llama")  # the server builds the very same weights


def engine_for(server: ServerProcess, tiny) -> ServerEngine:
    model, tokenizer = tiny
    return ServerEngine(url=server.url, token=server.token, bucket_mb=0.05,
                        stop_token_ids=eos_token_ids(tokenizer, model))


def rollout_groups(num_prompts: int = 2, n: int = 3, spread: int = 5, stride: int = 1):
    """Prompts of different lengths x ``n`` completions of different lengths (2 .. ``spread`` + 1 tokens)."""
    generator = torch.Generator().manual_seed(0)
    prompts = [[5, 9, 11, 2], [7, 3]] + [[4 + p, 8, 3 + p % 7] for p in range(num_prompts - 2)]
    groups = []
    for g in range(num_prompts):
        group = []
        for j in range(n):
            length = 2 + stride * (3 * g + 2 * j) % spread
            ids = torch.randint(3, 100, (length,), generator=generator).tolist()
            group.append(Completion(ids, [-1.0] * length, truncated=False, versions=("0",)))
        groups.append(group)
    return prompts, groups


def rollout_layout(micro_batch_size: int = 3, **shape):
    """``rollout_groups`` as the data module pads them, and its micro-batches."""
    padded = pad_rollouts(*rollout_groups(**shape), pad_token_id=0, micro_batch_size=micro_batch_size)
    return padded, list(padded.micro_batches())


def scaled_copy(model, factor: float = 1.1):
    """A pi_ref unlike the served policy, so that scoring with the wrong model would show."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in reference.parameters():
            p.mul_(factor)
    return reference


def test_the_server_scores_the_pushed_reference_exactly_as_the_trainer_would(server, tiny, one_thread):
    model, _ = tiny
    engine = engine_for(server, tiny)
    policy_before = {name: checksum(p) for name, p in model.named_parameters()}
    reference = scaled_copy(model)
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


def shared_prefix_groups():
    """3 prompts x 4 completions: each group's completions start with the same turn (as multi-turn trajectories
    that sampled it alike), then differ in tokens and length; the third group has the first one's prompt."""
    generator = torch.Generator().manual_seed(1)
    prompts = [[5, 9, 11, 2], [7, 3], [5, 9, 11, 2]]
    groups = []
    for g in range(3):
        turn = torch.randint(3, 100, (3 + 2 * g,), generator=generator).tolist()
        group = []
        for j in range(4):
            ids = turn + torch.randint(3, 100, ((5 * j + 3 * g) % 9 + 1,), generator=generator).tolist()
            group.append(Completion(ids, [-1.0] * len(ids), truncated=False, versions=("0",)))
        groups.append(group)
    return prompts, groups


def test_padded_scoring_of_the_server_and_of_kept_weights_equals_the_trainers_packed_tree(server, tiny,
                                                                                          one_thread):
    """Under ``model.packing`` the trainer cuts its micro-batches by the prefix tree's cost and scores each as one
    tree, while the server's pi_ref scoring and the kept weights' recompute of alpha run the padded micro-batches
    (``PaddedRollouts.micro_batches``): another cut and another forward, the same values within 1e-5 (float32)."""
    model, _ = tiny
    assert packed_layout_kind(model) == "packed_tree"
    engine = engine_for(server, tiny)
    reference = scaled_copy(model, 1.05)
    engine.load_reference(reference.named_parameters(), "5")
    prompts, groups = shared_prefix_groups()
    budget = 128
    asked = ServerReference(engine, pad_token_id=0, micro_batch_size=4, temperature=0.7, micro_batch_tokens=budget)
    got, version = asked(prompts, Rollouts(groups)).reference
    assert version == "5"
    padded = pad_rollouts(prompts, groups, pad_token_id=0, micro_batch_size=4, micro_batch_tokens=budget)
    batch = collate_rollouts(padded, [0.0] * padded.completion_ids.shape[0])
    trainer_cut = list(batch.micro_batches(layout="packed_tree"))
    assert ([mb.rows.tolist() for mb in trainer_cut]
            != [mb.rows.tolist() for mb in padded.micro_batches()])  # the server was sent another cut
    with torch.no_grad():
        kept = layout_logprobs(reference, padded, 0.7)  # the kept weights' (and in-process engine's) path
        for mb in trainer_cut:
            tree, _ = completion_logprobs(reference, mb, 0.7, packed=True)
            real = mb.completion_mask.bool()
            for theirs in (mb.take(got), mb.take(kept)):
                assert (theirs[real] - tree[real]).abs().max() <= 1e-5
            policy, _ = completion_logprobs(model, mb, 0.7, packed=True)
            assert (mb.take(got)[real] - policy[real]).abs().max() > 1e-3  # pi_ref, not the served policy
    engine.close()


def test_a_batch_larger_than_the_body_limit_is_scored_one_micro_batch_per_request(server, tiny, one_thread):
    """Every token of a batch travels to the server: as one body, 64 prompts x G = 16 x 2,048 tokens are about
    21 MiB, over the server's 16 MiB limit (a 413 on the first batch). Here the server's limit is BODY_LIMIT and
    the batch's one body would be larger; each request carries one micro-batch and stays within it."""
    model, _ = tiny
    engine = engine_for(server, tiny)
    reference = scaled_copy(model, 0.9)
    engine.load_reference(reference.named_parameters(), "7")
    padded, micro_batches = rollout_layout(micro_batch_size=4, num_prompts=8, n=4, spread=150, stride=13)
    whole = {"reference_version": "7", "temperature": 0.7, "autocast": None,
             "micro_batches": [{name: getattr(mb, name).tolist() for name in MICRO_BATCH_FIELDS}
                               for mb in micro_batches]}
    assert len(json.dumps(whole).encode()) > BODY_LIMIT  # the batch as one body would get a 413
    client = engine.servers[0].client
    post, sizes = client.post, []

    def measured_post(path, body=None, **kwargs):  # noqa: ANN001, ANN202
        if path == "/reference/logprobs":
            sizes.append(len(json.dumps(body).encode()))
        return post(path, body, **kwargs)

    client.post = measured_post
    got, version = engine.score_reference(micro_batches, *padded.completion_ids.shape, temperature=0.7)
    assert version == "7" and len(sizes) == len(micro_batches)
    for mb, size in zip(micro_batches, sizes):
        alone = len(json.dumps({name: getattr(mb, name).tolist() for name in MICRO_BATCH_FIELDS}).encode())
        assert size <= alone + 200 and size <= BODY_LIMIT  # a micro-batch and the request's few other fields
    with torch.no_grad():
        for mb in micro_batches:
            expected, _ = completion_logprobs(reference, mb, 0.7)
            assert torch.equal(mb.take(got), expected)
    engine.close()


def test_a_pi_ref_push_waits_for_a_scoring_job_past_its_version_check(server, tiny):
    """The asynchronous producer's job checks that a pi_ref was pushed (``ServerReference``), then reads its
    label (``score_reference``). A push of the next pi_ref that begins between the two must neither clear the
    label under the job nor change the server's copy: it drains the producer first. The interleaving is forced:
    the job is held after its check until the push has begun."""
    model, tokenizer = tiny
    engine = engine_for(server, tiny)
    engine.load_reference(model.named_parameters(), "10")
    prompts, groups = rollout_groups()
    checked, resume = threading.Event(), threading.Event()
    score = engine.score_reference

    def held_score(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        checked.set()  # past the check of engine.reference_version
        assert resume.wait(60)
        return score(*args, **kwargs)

    engine.score_reference = held_score
    server_reference = ServerReference(engine, tokenizer.pad_token_id, micro_batch_size=3, temperature=1.0)
    producer = RolloutProducer()
    try:
        producer.submit(0, lambda: server_reference(prompts, Rollouts(groups)))
        assert checked.wait(60)
        # the push's first act lets the held job go on; then it drains the producer, as the data module's hook does
        engine.before_push.extend([resume.set, producer.drain])
        engine.load_reference(scaled_copy(model).named_parameters(), "11")
        rollouts, error = producer.take(0)
    finally:
        resume.set()
        producer.close()
    assert error is None and rollouts.error is None, rollouts.error
    assert rollouts.reference[1] == "10"  # scored with the pi_ref the job was handed, before the swap
    padded = pad_rollouts(prompts, groups, pad_token_id=0, micro_batch_size=3)
    with torch.no_grad():
        for mb in padded.micro_batches():
            expected, _ = completion_logprobs(model, mb, 1.0)
            assert torch.allclose(mb.take(rollouts.reference[0]), expected, atol=1e-5, rtol=0)
    assert engine.reference_version == "11"
    assert engine.servers[0].client.get("/weight_info")["reference_version"] == "11"
    engine.close()


def test_a_failed_pi_ref_push_clears_the_label(server, tiny, monkeypatch):
    """After a failed push no one knows which pi_ref each server holds: the label is cleared, and scoring
    refuses to run rather than use a pi_ref that may be the wrong one."""
    model, _ = tiny
    engine = engine_for(server, tiny)
    engine.load_reference(model.named_parameters(), "20")

    def fail(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise ServerError("the push failed")

    monkeypatch.setattr(engine.pusher, "push", fail)
    with pytest.raises(ServerError, match="the push failed"):
        engine.load_reference(model.named_parameters(), "21")
    assert engine.reference_version is None
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


class RecordingEngine(ReferenceServing):
    """The part of ``ServerEngine`` that ``WeightSync`` uses for pi_ref: records what it was asked to push."""

    def __init__(self, serves_reference: bool = True) -> None:
        self.serves_reference = serves_reference
        self.reference_version = None
        self.pushed: list[tuple[str, list[str]]] = []

    def load_reference(self, named_tensors, version: str) -> None:  # noqa: ANN001
        self.pushed.append((version, [name for name, _ in named_tensors]))
        self.reference_version = version


def test_weight_sync_pushes_pi_ref_when_the_module_swapped_it():

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

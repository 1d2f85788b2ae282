"""Partial rollouts (``data.partial_rollouts``): a weight push pauses the rollout server's generations at a token
boundary (``/pause?mode=keep``), swaps the weights, and they go on under the new ones. Against a real server process
(``python -m lit_grpo serve``): a push mid-generation keeps the sequences in flight, which end with tokens from two
versions, exactly those of a decoding whose weights were swapped at that token; a fit at K = 1 with the trainer in a
process of its own (``dist_worker``) keeps every token within K versions, takes the sampler's log-probs as alpha for
batches that mix versions, and resumes exactly from a checkpoint taken with such a batch pending. The bookkeeping
(per-token versions, checkpoint state, old checkpoints, alpha's choice) and the refusals are checked in-process."""

from __future__ import annotations

import copy
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_data
from distributed_launch import free_port, launch
from server_process import ServerProcess
from test_rollout_server import perturbed

from lit_grpo.data.staleness import (
    check_partial_rollouts,
    groups_from_state,
    groups_to_state,
    mixes_versions,
    staleness_stats,
    token_versions,
)
from lit_grpo.engines.base import Completion, SamplingConfig
from lit_grpo.engines.remote.client import ServerEngine
from lit_grpo.engines.remote.request_layout import read_version_spans
from lit_grpo.engines.transformers_engine import TransformersEngine
from lit_grpo.models.loading import eos_token_ids, load_model_and_tokenizer
from lit_grpo.serve.generation import make_version_spans
from lit_grpo.wire.protocol import ServerError

TEXTS = ("What is 2+2?", "Name a prime.")
#: long enough (the tiny model ends a row with probability ~1/100 per token) that a push lands mid-generation
LONG = SamplingConfig(max_new_tokens=400, temperature=1.0)
#: a request seed whose rows all run long (lengths 27 49 70 162 168 200 234 329 without a push); seed 11's longest
#: ended at 51 tokens, before a push could land on a fast machine
SEED = 1


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(tmp_path_factory.mktemp("partial") / "server", port=free_port())
    try:
        process.wait_ready()
        yield process
    finally:
        process.kill()


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model_and_tokenizer("tiny-random-llama")  # the server builds the very same weights
    return model, tokenizer, [tokenizer.encode(t) for t in TEXTS]


def in_flight(server: ServerProcess) -> int:
    return server.call("GET", "/weight_info")[1]["in_flight"]


def push_mid_generation(server: ServerProcess, tiny, engine: ServerEngine, new, step: int, seed: int):
    """Request ``LONG`` completions on a thread, push ``new`` as version ``step`` once the server is generating
    them, and return the completions."""
    _, _, prompts = tiny
    out = {}
    thread = threading.Thread(target=lambda: out.update(r=engine.request_rollouts(prompts, 4, LONG, seed)))
    thread.start()
    deadline = time.monotonic() + 60
    while in_flight(server) == 0:
        assert thread.is_alive() and time.monotonic() < deadline, "the request never reached the server"
        time.sleep(0.005)
    time.sleep(0.05)  # a few tokens under the old weights
    engine.load_weights(new.named_parameters(), step)
    thread.join(120)
    assert out["r"].error is None, out["r"].error
    return out["r"].groups


def decode_with_swap(tiny, old, new, swap_at: int | None, seed: int, max_num_seqs: int | None = None,
                     cuts: dict | None = None):
    """The in-process engine's decoding of the same request (the server's code), its weights replaced by ``new``'s
    after decoding step ``swap_at`` (the hook the server parks in runs between two steps); ``cuts["lengths"]``: the
    tokens each row had decoded then, ``cuts["each"]`` after every step."""
    model, tokenizer, prompts = tiny
    sampler = copy.deepcopy(old)
    eos = eos_token_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]  # the server's choice
    engine = TransformersEngine(sampler, eos, pad, copy_weights=False, rescore=False, max_num_seqs=max_num_seqs)
    calls = [0]

    def between(done: bool) -> bool:
        calls[0] += 1
        if cuts is not None:
            cuts.setdefault("each", []).append(engine.decoded_lengths.tolist())
        if calls[0] == swap_at:
            if cuts is not None:
                cuts["lengths"] = engine.decoded_lengths.tolist()
            with torch.no_grad():
                for mine, theirs in zip(sampler.parameters(), new.parameters(), strict=True):
                    mine.copy_(theirs)
        return done

    return engine.generate(prompts, 4, LONG, seed, all_finished=between)


def keeping_engine(server: ServerProcess, tiny) -> ServerEngine:  # noqa: ANN001
    """A client of ``server`` whose pushes keep the generations in flight, holding version 1 (the tiny model); one
    thread here, as the server: the same kernels, the same numbers."""
    torch.set_num_threads(1)
    model, tokenizer, _ = tiny
    engine = ServerEngine(url=server.url, token=server.token, bucket_mb=0.05,
                          stop_token_ids=eos_token_ids(tokenizer, model))
    engine.keep_generating_through_pushes()
    engine.load_weights(model.named_parameters(), 1)
    return engine


def test_a_push_mid_generation_keeps_the_sequences_and_labels_each_token_with_its_version(server, tiny):
    model, _, _ = tiny
    engine = keeping_engine(server, tiny)
    new = perturbed(model, 0)
    groups = push_mid_generation(server, tiny, engine, new, 2, seed=SEED)
    completions = [c for g in groups for c in g]
    mixed = [c for c in completions if len(c.versions) > 1]
    assert mixed, [(c.versions, len(c.token_ids)) for c in completions]
    # every completion still running at the swap changed version at the same token: the decoding step it parked at
    cuts = {c.span_lengths[0] for c in mixed}
    assert len(cuts) == 1
    (cut,) = cuts
    assert 0 < cut
    for c in completions:
        if len(c.token_ids) > cut:
            assert c.versions == ("1", "2") and c.span_lengths == (cut, len(c.token_ids) - cut)
            assert token_versions(c) == [1] * cut + [2] * (len(c.token_ids) - cut)
        else:  # ended before the push: one version, no spans
            assert c.versions == ("1",) and c.span_lengths == ()
    # exactly the in-process decoding whose weights were swapped after step `cut`: tokens and sampler log-probs
    swapped = [c for g in decode_with_swap(tiny, model, new, cut, seed=SEED) for c in g]
    for got, expected in zip(completions, swapped, strict=True):
        assert got.token_ids == expected.token_ids
        assert got.logprobs == pytest.approx(expected.logprobs, abs=1e-5)
    # the tokens before the push are the old weights' own (the same decoding without a swap), and after it the new
    # weights sampled: the sequences part from the old weights' continuation
    unswapped = [c for g in decode_with_swap(tiny, model, new, None, seed=SEED) for c in g]
    assert all(got.token_ids[:cut] == old.token_ids[:cut] for got, old in zip(completions, unswapped, strict=True))
    parted = [got.token_ids != old.token_ids for got, old in zip(completions, unswapped, strict=True)
              if len(got.versions) > 1]
    assert any(parted)
    # the server answers with the version it ended under, and is not left paused
    info = server.call("GET", "/weight_info")[1]
    assert info["weight_version"] == "2" and not info["paused"] and info["parked"] == 0 and info["in_flight"] == 0


@pytest.fixture(scope="module")
def capped_server(tmp_path_factory):
    """A server decoding at most 3 sequences at once (``--max-num-seqs``): rows are admitted as others end."""
    process = ServerProcess(tmp_path_factory.mktemp("capped") / "server", port=free_port(),
                            args=("--max-num-seqs", "3"))
    try:
        process.wait_ready()
        yield process
    finally:
        process.kill()


def test_with_continuous_batching_each_row_changes_version_at_its_own_token(capped_server, tiny):
    model, _, _ = tiny
    engine = keeping_engine(capped_server, tiny)
    new = perturbed(model, 2)
    completions = [c for g in push_mid_generation(capped_server, tiny, engine, new, 2, seed=13) for c in g]
    # the decoding step of the swap: the one after which the old weights' own decoding had given every row that
    # changed version the tokens it sampled under version 1 (until then the two decodings are the same)
    mixed = {row: c.span_lengths[0] for row, c in enumerate(completions) if len(c.versions) > 1}
    assert mixed, [(c.versions, c.span_lengths, len(c.token_ids)) for c in completions]
    before = {}
    decode_with_swap(tiny, model, new, None, seed=13, max_num_seqs=3, cuts=before)
    steps = [i + 1 for i, lengths in enumerate(before["each"]) if all(lengths[r] == n for r, n in mixed.items())]
    assert len(steps) == 1, steps
    (step,) = steps
    cuts = {}
    swapped = [c for g in decode_with_swap(tiny, model, new, step, seed=13, max_num_seqs=3, cuts=cuts) for c in g]
    for row, (got, expected) in enumerate(zip(completions, swapped, strict=True)):
        assert got.token_ids == expected.token_ids and got.logprobs == pytest.approx(expected.logprobs, abs=1e-5)
        cut, length = min(cuts["lengths"][row], len(got.token_ids)), len(got.token_ids)
        labels = [(v, n) for v, n in (("1", cut), ("2", length - cut)) if n]
        if len(labels) == 2:
            assert (got.versions, got.span_lengths) == (("1", "2"), (cut, length - cut)), row
        else:  # ended before the swap, or admitted after it: one version
            assert (got.versions, got.span_lengths) == ((labels[0][0],), ()), row
    # rows still waiting for a slot at the swap were sampled by the new weights only (3 slots, 8 rows, a swap a few
    # dozen tokens in)
    assert any(c.versions == ("2",) for c in completions)


def test_a_keep_pause_is_authenticated_and_a_push_cut_off_leaves_the_old_weights(server, tiny):
    model, tokenizer, prompts = tiny
    assert server.call("POST", "/pause?mode=keep", token=None)[0] == 401
    assert server.call("POST", "/pause?mode=keep", token="wrong" * 8)[0] == 401
    status, payload = server.call("POST", "/pause?mode=freeze")
    assert status == 400 and "'freeze'" in payload["error"]["message"] and "'keep'" in payload["error"]["message"]
    assert server.call("GET", "/is_paused")[1] == {"is_paused": False}
    # a push refused at its end (a parameter missing) swaps nothing: the generation parked through it goes on under
    # the weights it started with, one version only
    engine = ServerEngine(url=server.url, token=server.token, bucket_mb=0.05,
                          stop_token_ids=eos_token_ids(tokenizer, model))
    engine.keep_generating_through_pushes()
    engine.load_weights(model.named_parameters(), 3)
    partial = [(n, p) for n, p in perturbed(model, 1).named_parameters()][:-1]
    out = {}
    thread = threading.Thread(target=lambda: out.update(r=engine.request_rollouts(prompts, 4, LONG, 5)))
    thread.start()
    while in_flight(server) == 0:
        time.sleep(0.005)
    with pytest.raises(ServerError, match="missing"):
        engine.load_weights(iter(partial), 4)
    thread.join(120)
    assert out["r"].error is None, out["r"].error
    assert {c.versions for g in out["r"].groups for c in g} == {("3",)}
    assert [[c.token_ids for c in g] for g in out["r"].groups] == [
        [c.token_ids for c in g] for g in decode_with_swap(tiny, model, model, None, seed=5)]
    assert server.call("GET", "/weight_info")[1]["weight_version"] == "3"


def test_span_bookkeeping_and_the_checkpoint_state_of_mixed_completions():
    # the server's spans: cut where the version went on, a version that began after the completion ended is left out
    starts = [("1", None), ("2", [5, 2, 0])]  # row 1 had 2 tokens at the swap, row 2 was not admitted yet
    assert make_version_spans(starts, 0, 9) == [{"version": "1", "start": 0, "end": 5},
                                                {"version": "2", "start": 5, "end": 9}]
    assert make_version_spans(starts, 0, 5) == [{"version": "1", "start": 0, "end": 5}]  # it had ended at the swap
    assert make_version_spans(starts, 2, 4) == [{"version": "2", "start": 0, "end": 4}]  # all its tokens are new
    assert make_version_spans(starts, 1, 0) == [{"version": "1", "start": 0, "end": 0}]
    # the client's reading: back to back from 0, or a ServerError naming the spans
    assert read_version_spans([{"version": "1", "start": 0, "end": 5}, {"version": "2", "start": 5, "end": 9}], 9,
                              "s") == (("1", "2"), (5, 4))
    assert read_version_spans([{"version": 7}], 3, "s") == (("7",), ())
    with pytest.raises(ServerError, match="back to back"):
        read_version_spans([{"version": "1", "start": 0, "end": 4}, {"version": "2", "start": 5, "end": 9}], 9, "s")
    old = Completion([1, 2, 3], [-0.1, -0.2, -0.3], False, ("4",))
    mixed = Completion([4, 5, 6, 7], [-1.0, -1.5, -2.0, -2.5], True, ("3", "5"), span_lengths=(1, 3))
    groups = [[old, mixed]]
    assert token_versions(mixed) == [3, 5, 5, 5] and token_versions(old) == [4, 4, 4]
    assert mixes_versions(groups) and not mixes_versions([[old]])
    stats = staleness_stats(groups, step=5)
    # per completion its oldest token (1 and 2 steps old); per token: 1, 1, 1, 2, 0, 0, 0
    assert stats["staleness_mean"] == 1.5 and stats["staleness_max"] == 2.0
    assert stats["token_staleness_mean"] == pytest.approx(5 / 7) and stats["token_staleness_max"] == 2.0
    assert stats["mixed_versions"] == 1.0
    state = groups_to_state(groups)
    assert "span_lengths" not in state[0][0] and state[0][1]["span_lengths"] == [1, 3]
    assert groups_from_state(state) == groups
    # a checkpoint written before partial rollouts (no span_lengths) still loads, one span per completion
    legacy = [[{"token_ids": [1, 2], "logprobs": [-0.5, -0.5], "truncated": False, "versions": ["2"]}]]
    (restored,) = groups_from_state(legacy)[0]
    assert restored.span_lengths == () and token_versions(restored) == [2, 2]


def test_alpha_of_a_batch_that_mixes_versions_is_the_samplers_never_a_recompute():
    data = tiny_data()
    recomputed = torch.full((2, 3), -9.0)
    sampler = torch.full((2, 3), -1.0)
    # an engine that could recompute alpha (a kept copy of the last push, synced at the batch's oldest version)
    data.rollout_engine = SimpleNamespace(rescore=True, synced_step=3, score=lambda padded, temperature: recomputed)
    data.reuse_policy_logprobs = False
    padded = SimpleNamespace(sampler_logp=sampler)
    alpha, source = data.alpha_logprobs(padded, 3)
    assert source == "recompute" and alpha is recomputed
    alpha, source = data.alpha_logprobs(padded, 3, mixed=True)
    assert source == "sampler" and alpha is sampler


def test_refusals_are_one_line():
    check_partial_rollouts(False, 0, "transformers")  # off: nothing to check
    check_partial_rollouts(True, 1, "server")
    cases = [((True, 0, "server"), "max_staleness=0"), ((True, 2, "transformers"), "engine 'transformers'"),
             (("yes", 1, "server"), "'yes'"), ((True, 1, "server", True), "reference_on_server")]
    for args, words in cases:
        with pytest.raises(ValueError, match=words) as err:
            check_partial_rollouts(*args)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="partial_rollouts: true needs max_staleness >= 1"):
        tiny_data(partial_rollouts=True)  # the data module checks it before anything loads


def job(server: ServerProcess, max_steps: int, **extra) -> dict:
    data = dict(prompts_per_step=1, max_staleness=1, partial_rollouts=True, max_new_tokens=256)
    return dict(v=1, max_steps=max_steps, module=dict(beta=0.1, lr=1e-2, max_completion_length=256), data=data,
                server=dict(url=server.url, token=server.token, timeout_s=60, bucket_mb=0.05), **extra)


@pytest.mark.slow
def test_a_fit_with_partial_rollouts_bounds_staleness_per_token_and_resumes_exactly(server, tmp_path):
    ckpt = str(tmp_path / "mid.ckpt")
    # the first run saves a checkpoint after step 3 (batch 3, requested when batch 2 was taken, is pending) and goes
    # on; the second starts from it in the same process order and trains on the batch the checkpoint carried
    full, resumed = launch([job(server, 5, ckpt_at=dict(step=3, path=ckpt)), job(server, 5, ckpt_in=ckpt)],
                           world=1, workdir=tmp_path / "runs", timeout_s=400)[0]
    steps = full["steps"]
    assert len(steps) == 5 and len(resumed["steps"]) == 2
    for s in steps:  # every token at most K = 1 versions old (v = 1)
        assert s["rollout/token_staleness_max"] <= 1 and s["rollout/staleness_max"] <= 1
        assert s["rollout/token_staleness_mean"] <= s["rollout/staleness_mean"]
    # pushes did not wait: batches sampled while a push landed carry two versions, each token labelled
    mixed = [b for b, spans in enumerate(full["spans"]) if any(len(v) > 1 for v, _, _ in spans)]
    assert mixed and all(steps[b]["rollout/mixed_versions"] > 0 for b in mixed)
    for b, spans in enumerate(full["spans"]):
        for versions, lengths, length in spans:
            assert not lengths or (len(lengths) == len(versions) and sum(lengths) == length)
            assert all(b - 1 <= int(v) <= b for v in versions)  # sampled after push b - 1, before push b + 1
    # alpha of a batch whose tokens come from several versions is the sampler's per token
    for b, source in enumerate(full["alpha_sources"]):
        if len(full["versions"][b]) > 1:
            assert source == "sampler"
    # exact resume: the pending batch (sampled across the push after step 2, generation being the longer side here)
    # comes back as it was, tokens' versions included, and the step trained on it is the same
    assert any(len(versions) > 1 for versions, _, _ in full["spans"][3])
    assert resumed["spans"][0] == full["spans"][3] and resumed["versions"][0] == full["versions"][3]
    expected = steps[3]
    got = resumed["steps"][0]
    for key in expected.keys() - {"rollout/producer_waits"}:
        assert got[key] == pytest.approx(expected[key], abs=1e-6), key


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    """Two servers of the same tiny model, one token."""
    root = tmp_path_factory.mktemp("two")
    token = "k" * 32
    processes = [ServerProcess(root / f"server{i}", token=token, port=free_port()) for i in range(2)]
    try:
        for process in processes:
            process.wait_ready()
        yield processes
    finally:
        for process in processes:
            process.kill()


@pytest.mark.parametrize("keep", [True, False])
def test_a_push_while_requests_are_in_flight_on_two_servers_labels_every_token_with_the_version_that_sampled_it(
        two_servers, tiny, keep):
    model, tokenizer, prompts = tiny
    torch.set_num_threads(1)
    engine = ServerEngine(urls=[s.url for s in two_servers], token=two_servers[0].token, bucket_mb=0.05,
                          stop_token_ids=eos_token_ids(tokenizer, model))
    if keep:
        engine.keep_generating_through_pushes()
    base = 10 if keep else 20
    engine.load_weights(model.named_parameters(), base)
    out = {}
    thread = threading.Thread(target=lambda: out.update(r=engine.request_rollouts(prompts, 4, LONG, 13)))
    thread.start()
    deadline = time.monotonic() + 60
    while not all(in_flight(s) for s in two_servers):  # one prompt per server: both are generating
        assert thread.is_alive() and time.monotonic() < deadline, "the requests never reached both servers"
        time.sleep(0.005)
    time.sleep(0.05)
    engine.load_weights(perturbed(model, 1).named_parameters(), base + 1)
    pushed_while = thread.is_alive()
    thread.join(120)
    assert out["r"].error is None, out["r"].error
    completions = [c for g in out["r"].groups for c in g]
    old, new = str(base), str(base + 1)
    for c in completions:
        assert set(c.versions) <= {old, new} and c.token_ids  # none aborted or restarted empty
        assert not c.span_lengths or sum(c.span_lengths) == len(c.token_ids)
    if keep:  # the push did not wait: on each server, rows still running went on under the new version
        assert pushed_while
        for group in out["r"].groups:
            assert any(c.versions == (old, new) for c in group), [c.versions for c in group]
    else:  # the push waited for both requests: every token is the old version's
        assert all(c.versions == (old,) for c in completions)
    assert engine.weight_versions() == {s.url: new for s in two_servers}

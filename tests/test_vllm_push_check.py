"""Every push to a real ``vllm serve`` checked (``engine_options.verify_pushes``,
``lit_grpo.engines.remote.vllm_verify``):
a server whose load silently drops the pushed tensors, all of them or one kind, answers the push as done and reports
the pushed version, and the trainer stops with one line naming it. The fault is injected into the server's processes
only, by a ``sitecustomize`` that wraps this package's gloo receiver so that ``load_weights`` skips the tensors a flag
file names (the field's "training does nothing" bug: weights that never reach the sampler).

The vLLM tier: ``python -m pytest -m vllm`` in the CPU-with-vLLM environment (README, Install)."""

from __future__ import annotations

import copy
import time
import warnings

import pytest
from vllm_helpers import VLLMServe, perturbed, requires_vllm, save_model, tiny_vllm_llama

from lit_grpo.wire.protocol import ServerError

pytestmark = [pytest.mark.vllm, requires_vllm]

SITECUSTOMIZE = '''
import os

FLAG = os.environ.get("DROP_PUSHED_FLAG")
if FLAG:
    import lit_grpo.wire.vllm_gloo as gloo

    build = gloo.make_worker_engine_class

    def dropping_engine_class():
        base = build()

        class Dropping(base):
            def receive_weights(self, update_info):
                drop = open(FLAG).read().strip() if os.path.exists(FLAG) else ""
                if not drop:
                    return super().receive_weights(update_info)
                load = self.model.load_weights

                def load_some(weights):
                    return load([(n, t) for n, t in weights if drop != "*" and drop not in n])

                self.model.load_weights = load_some
                try:
                    return super().receive_weights(update_info)
                finally:
                    del self.model.load_weights

        return Dropping

    gloo.make_worker_engine_class = dropping_engine_class
'''


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_push_check")
    (root / "site").mkdir()
    (root / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    flag = root / "drop"
    import os

    path = os.pathsep.join(filter(None, [str(root / "site"), os.environ.get("PYTHONPATH")]))
    server = VLLMServe(save_model(root / "tiny"), root / "serve.log",
                       env={"PYTHONPATH": path, "DROP_PUSHED_FLAG": str(flag)})
    try:
        server.wait_ready()
        yield server, flag
    finally:
        server.stop()


def engine_for(server: VLLMServe, model, **options):  # noqa: ANN001, ANN003, ANN201
    from lit_grpo.engines.remote.client import ServerEngine

    return ServerEngine(url=server.url, kind="vllm", backend="gloo", dtype="float32", policy=model, timeout_s=120,
                        token=server.token, **options)


def push(engine, model, step: int) -> float:  # noqa: ANN001
    start = time.monotonic()
    engine.load_weights(model.named_parameters(), step=step)
    return time.monotonic() - start


def test_a_push_the_server_did_not_load_stops_naming_it_and_a_partial_load_too(faulty):
    server, flag = faulty
    model, _ = tiny_vllm_llama()
    engine = engine_for(server, model)
    push(engine, model, 1)  # forms the group, learns what the server keeps as sent (its norms)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a healthy server: every served parameter moved with the policy
        seconds = push(engine, perturbed(model, scale=0.1, seed=1), 2)  # learns which of them move
    print(f"a verified push of the tiny model: {seconds:.2f} s")
    assert engine.weight_versions() == {server.url: "2"}

    flag.write_text("*")  # the server's load drops every tensor, and still reports the version
    with pytest.raises(ServerError) as caught:
        push(engine, perturbed(model, scale=0.1, seed=2), 3)
    message = str(caught.value)
    assert "\n" not in message and server.url in message and "the push of step 3 did not take effect:" in message
    assert "model.norm.weight" in message or "input_layernorm" in message
    assert server.get("/weight_info")["weight_version"] == "3"  # vLLM itself saw nothing wrong
    engine.close()

    # a fresh trainer; the load skips the embedding only, which vLLM pads (so it is not compared byte for byte):
    # every pushed tensor moved, and the served embedding did not
    flag.write_text("")
    engine = engine_for(server, model)
    push(engine, model, 4)
    push(engine, perturbed(model, scale=0.1, seed=3), 5)
    flag.write_text("embed_tokens")
    with pytest.raises(ServerError, match=r"the push of step 6 did not take effect in full: 1 of \d+ served "
                                          r"parameters that moved with the policy kept the previous push's bytes "
                                          r".*\(model.embed_tokens.weight\)"):
        push(engine, perturbed(model, scale=0.1, seed=4), 6)
    engine.close()


def test_with_verification_off_the_same_fault_goes_unnoticed(faulty):
    """What the check adds: the old behaviour, kept behind ``verify_pushes: false``."""
    server, flag = faulty
    flag.write_text("")
    model, _ = tiny_vllm_llama()
    engine = engine_for(server, model, verify_pushes=False)
    push(engine, model, 7)
    flag.write_text("*")
    push(engine, perturbed(copy.deepcopy(model), scale=0.1, seed=5), 8)  # no error: the version is all it reads
    assert engine.weight_versions() == {server.url: "8"}
    engine.close()
    flag.write_text("")


def test_the_check_costs_a_hash_of_the_served_model(faulty):
    server, flag = faulty
    flag.write_text("")
    start = time.monotonic()
    checksums = server.post("/weight_checker", {"action": "checksum"})["checksums"]
    print(f"/weight_checker over {len(checksums)} tensors: {time.monotonic() - start:.3f} s")
    assert len(checksums) >= 5

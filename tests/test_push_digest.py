"""Every push verified (``lit_grpo.wire.push_digest``): the digest is exact, sees a changed value and a swap of two
elements of a small tensor, a large tensor that moved, a name or a dtype; a real server's digest after the swap
equals the trainer's (every push of the server tests passes through the check); and a push whose served weights
differ from what was sent stops in one line naming the server, the server left generating on its previous weights."""

from __future__ import annotations

import pytest
import torch
from distributed_launch import free_port
from server_process import ServerProcess

from lit_grpo.wire.protocol import ServerError
from lit_grpo.wire.push_digest import STRIDE, PushDigest, tensor_digest


def test_the_digest_sees_every_byte_and_its_place():
    t = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert tensor_digest(t) == tensor_digest(t.clone())
    changed = t.clone()
    changed[500] = changed[500].nextafter(torch.tensor(1e9))  # one ulp
    swapped = t.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert len({tensor_digest(t), tensor_digest(changed), tensor_digest(swapped)}) == 3
    assert tensor_digest(t.to(torch.bfloat16)) != tensor_digest(t)
    assert tensor_digest(torch.arange(7, dtype=torch.uint8)) != tensor_digest(torch.arange(1, 8, dtype=torch.uint8))
    named = [("a", t), ("b", t[:10])]
    assert PushDigest().add_all(named).value == PushDigest().add_all(list(named)).value
    assert PushDigest().add_all(named).value != PushDigest().add_all(named[::-1]).value
    assert PushDigest().add_all(named).value != PushDigest().add_all([("c", t), ("b", t[:10])]).value


def test_the_digest_by_hand_whole_and_sampled():
    big = torch.randint(-(2**15), 2**15, (3 * 2**20 + 5,), dtype=torch.int16)
    expected = sum(int(v) * ((i % 65521) + 1) for i, v in enumerate(big[:1000].tolist()))
    assert tensor_digest(big[:1000]) == expected % (2**61 - 1)  # a small tensor, read whole, by hand
    sampled = sum(int(big[i]) * ((i % 65521) + 1) for i in range(0, big.numel(), STRIDE))
    assert tensor_digest(big) == sampled % (2**61 - 1)  # a large one, every STRIDE-th element
    assert tensor_digest(big) == tensor_digest(big.view(torch.bfloat16))  # bytes, not values
    # a training step moves nearly every weight: a large tensor that moved is seen
    weights = torch.randn(2**20, generator=torch.Generator().manual_seed(1))
    assert tensor_digest(weights) != tensor_digest(weights - 1e-3 * weights.sign())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(tmp_path_factory.mktemp("digest") / "server", port=free_port())
    try:
        process.wait_ready()
        yield process
    finally:
        process.kill()


def test_a_push_the_served_model_does_not_hold_stops_in_one_line(server, monkeypatch):
    import lit_grpo.engines.remote.weight_push as weight_push
    from lit_grpo.engines.remote.client import ServerEngine
    from lit_grpo.models.loading import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer("tiny-random-llama")
    engine = ServerEngine(policy=model, url=server.url, token=server.token, timeout_s=30, bucket_mb=0.05)
    engine.load_weights(model.named_parameters(), step=1)  # the server's digest equals the trainer's

    class Misread(PushDigest):  # the trainer's record of what it sent, one tensor short: as if one never arrived
        def add(self, name, tensor):  # noqa: ANN001
            if not name.endswith("lm_head.weight"):
                super().add(name, tensor)

    monkeypatch.setattr(weight_push, "PushDigest", Misread)
    with pytest.raises(ServerError, match=rf"^weight push of step 2 failed: rollout server {server.url}: the weight "
                                          r"push of '2' did not take effect: the served weights' digest \d+ is not "
                                          r"the pushed \d+"):
        engine.load_weights(model.named_parameters(), step=2)
    info = server.call("GET", "/weight_info")[1]
    assert not info["paused"]  # it goes on generating
    engine.close()

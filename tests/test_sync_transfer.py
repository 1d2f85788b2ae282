"""The weight push's transfer pieces that a CPU can check with fakes (NCCL between processes needs two GPUs):

- the transfer device is the server's own ``--device``, not the handler thread's current CUDA device;
- the push group's NCCL settings (blocking wait, abort without ending the process, the group's timeout) apply
  while that group is built and only then;
- a transfer that fails the way NCCL fails on a timeout or a dead peer (``DistBackendError`` from the work's
  ``wait``) comes out of ``load_weights`` as a ``ServerError`` naming the server's URL, and on the server as a 500
  that drops the push and keeps the previous weights;
- the bucket plan and the shard rows that the gather to rank 0 relies on, and the copy-free packing of a bucket
  that already lies back to back.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from lit_grpo.engines.remote import weight_push
from lit_grpo.engines.remote.client import ServerEngine
from lit_grpo.engines.remote.weight_gather import shard_rows
from lit_grpo.wire import weight_transfer
from lit_grpo.wire.protocol import HTTPClient, ServerError
from lit_grpo.wire.weight_transfer import (
    NCCL_GROUP_ENV,
    bucket_spans,
    buckets,
    open_group,
    pack,
    packed_view,
    transport_device,
)

URL = "http://10.1.2.3:8765"
#: what ProcessGroupNCCL's wait raises when a broadcast outlives the group's timeout
NCCL_TIMEOUT = ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, OpType=BROADCAST, "
                "NumelIn=1048576, NumelOut=1048576, Timeout(ms)=60000) ran for 60001 milliseconds before timing out.")


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA build whose current device is cuda:0 (the HTTP handler threads' view)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_transport_device_is_the_given_cuda_device_not_the_current_one(fake_cuda):
    assert transport_device("nccl", torch.device("cuda:1")) == torch.device("cuda", 1)
    assert transport_device("nccl", "cuda:3") == torch.device("cuda", 3)
    assert transport_device("nccl") == torch.device("cuda", 0)  # the trainer: its rank's current device
    assert transport_device("nccl", "cuda") == torch.device("cuda", 0)
    assert transport_device("gloo", torch.device("cuda:1")) == torch.device("cpu")
    with pytest.raises(ValueError, match="needs a CUDA device, got cpu"):
        transport_device("nccl", torch.device("cpu"))
    with pytest.raises(ValueError, match="'mpi'"):
        transport_device("mpi")


def test_server_receives_on_its_own_device(fake_cuda):
    from types import SimpleNamespace

    from lit_grpo.serve.weight_receive import WeightReceiver

    receiver = WeightReceiver(SimpleNamespace(device=torch.device("cuda", 1)), None, "m")  # only the device matters
    receiver.backend = "nccl"
    assert receiver.transfer_device() == torch.device("cuda", 1)
    receiver.backend = "gloo"
    assert receiver.transfer_device() == torch.device("cpu")


class FakeNCCLGroup:
    """Stands in for ``ProcessGroupNCCL``: records the environment it was built under."""

    class Options:
        _timeout = None

    def __init__(self, store, rank, world_size, options) -> None:  # noqa: ANN001
        self.env = {name: os.environ.get(name) for name in NCCL_GROUP_ENV}
        self.rank, self.world_size, self.timeout = rank, world_size, options._timeout


def test_nccl_push_group_blocks_on_wait_and_does_not_end_the_process(monkeypatch):
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCLGroup, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # the trainer's own setting
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    group = open_group(dist.HashStore(), 0, 2, "nccl", 42.0, "127.0.0.1")
    assert group.env == {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    assert group.timeout == datetime.timedelta(seconds=42) and (group.rank, group.world_size) == (0, 2)
    # only that group: process groups made afterwards keep the trainer's settings
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and "TORCH_NCCL_BLOCKING_WAIT" not in os.environ


class Work:
    """A broadcast's work whose ``wait`` fails like NCCL's (or answers ``result``); records the timeout asked."""

    def __init__(self, error: Exception | None = None, result: bool = True) -> None:
        self.error, self.result, self.timeouts = error, result, []

    def wait(self, timeout=None):  # noqa: ANN001, ANN201
        self.timeouts.append(timeout)
        if self.error is not None:
            raise self.error
        return self.result


class Group:
    def __init__(self, work: Work) -> None:
        self.work, self.aborted = work, False

    def broadcast(self, tensor, root):  # noqa: ANN001, ANN201
        return self.work

    def abort(self) -> None:
        self.aborted = True


def test_wait_work_blocks_with_the_timeout_and_raises_when_not_done():
    work = Work()
    weight_transfer.wait_work(work, 7.5)
    assert work.timeouts == [datetime.timedelta(seconds=7.5)]
    with pytest.raises(TimeoutError, match="within 3 s"):
        weight_transfer.wait_work(Work(result=False), 3.0)
    with pytest.raises(dist.DistBackendError, match="timing out"):
        weight_transfer.wait_work(Work(dist.DistBackendError(NCCL_TIMEOUT)), 3.0)


@pytest.fixture
def answering(monkeypatch):
    """Every HTTP call of the client succeeds (a server of float32 weights that has a transfer group)."""
    calls = []

    def request(self, method, path, body=None, query=None, timeout_s=None, headers=None):  # noqa: ANN001, ANN202
        calls.append((method, path))
        if path == "/weight_info":
            return {"dtypes": ["float32"], "transfer_group": True, "weight_version": "1"}
        return {}

    monkeypatch.setattr(HTTPClient, "request", request)
    return calls


def test_a_failed_nccl_wait_is_a_server_error_naming_the_url(answering):
    engine = ServerEngine(url=URL, token="t" * 32, timeout_s=9.0, bucket_mb=1.0)
    work = Work(dist.DistBackendError(NCCL_TIMEOUT))
    group = engine.servers[0].group = Group(work)
    weights = [("a", torch.ones(3)), ("b", torch.zeros(2, 2))]
    with pytest.raises(ServerError) as caught:
        engine.load_weights(weights, step=3)
    message = str(caught.value)
    assert message.startswith(f"weight push of step 3 failed: rollout server {URL}: sending a bucket of 2 tensors")
    assert "DistBackendError" in message and "timing out" in message
    assert work.timeouts == [datetime.timedelta(seconds=9)]  # the transfer's own timeout, not a bare wait()
    assert group.aborted and engine.servers[0].group is None  # the next push forms a new group
    assert ("POST", "/resume") in answering and ("POST", "/finish_weight_update") not in answering


def test_server_maps_a_failed_receive_to_a_500_and_keeps_its_weights():
    from lit_grpo.models.loading import load_model_and_tokenizer
    from lit_grpo.serve.server import RolloutServer
    from lit_grpo.wire.protocol import HTTPFailure

    model, tokenizer = load_model_and_tokenizer("tiny-random-llama")
    server = RolloutServer(model, tokenizer, "tiny-random-llama", "t" * 32)
    receiver = server.receiver
    before = {name: p.clone() for name, p in model.named_parameters()}
    work = Work(dist.DistBackendError(NCCL_TIMEOUT))
    receiver.group, receiver.transfer_timeout_s, server.policy.weight_version = Group(work), 11.0, "4"
    receiver.start_weight_update({}, {})
    name, param = next(iter(model.named_parameters()))
    update = {"update_info": {"names": [name], "dtype_names": ["float32"], "shapes": [list(param.shape)]}}
    with pytest.raises(HTTPFailure) as caught:
        receiver.update_weights(update, {})
    assert caught.value.status == 500 and "timing out" in caught.value.message
    assert "weight version stays '4'" in caught.value.message
    assert work.timeouts == [datetime.timedelta(seconds=11)]
    assert receiver.group is None and receiver.staging is None
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_shard_rows_split_like_torch_chunk():
    for rows in range(0, 12):
        for shards in (1, 2, 3, 4, 5):
            chunks = torch.arange(rows).chunk(shards) if rows else ()
            for index in range(shards):
                start, stop = shard_rows(rows, shards, index)
                expected = chunks[index].tolist() if index < len(chunks) else []
                assert list(range(start, stop)) == expected, (rows, shards, index)


def test_bucket_spans_cut_consecutive_runs_of_at_most_the_bucket():
    assert list(bucket_spans([3, 3, 5, 1, 10, 2, 2], 6)) == [(0, 2), (2, 4), (4, 5), (5, 7)]
    assert list(bucket_spans([7], 6)) == [(0, 1)]  # larger than a bucket: alone
    assert list(bucket_spans([], 6)) == []
    assert list(bucket_spans([6, 6, 6], 6)) == [(0, 1), (1, 2), (2, 3)]  # exactly full: the next one opens a bucket
    assert list(bucket_spans([1] * 13, 5)) == [(0, 5), (5, 10), (10, 13)]
    # empty tensors join the open bucket while it is within the cap; after a tensor above the cap they start anew
    assert list(bucket_spans([0, 6, 0, 7, 0], 6)) == [(0, 3), (3, 4), (4, 5)]
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1, got 0"):
        bucket_spans([1], 0)  # at the call, before anything is read


def test_bucket_spans_read_a_stream_one_item_ahead_only():
    read = []

    def sizes():
        for index, size in enumerate([3, 3, 5, 1, 10]):
            read.append(index)
            yield size

    spans = bucket_spans(sizes(), 6)
    assert read == []
    assert next(spans) == (0, 2) and read == [0, 1, 2]
    assert next(spans) == (2, 4) and read == [0, 1, 2, 3, 4]
    assert next(spans) == (4, 5) and list(spans) == []


def test_streamed_buckets_are_the_bucket_spans_handed_out_as_soon_as_full():
    sizes = [3, 3, 5, 1, 10, 2, 2]
    converted = []

    def convert(tensor):
        converted.append(tensor.numel())
        return tensor.float()  # a cast: the bucket is cut by the converted bytes (4 per element)

    tensors = [(str(i), torch.zeros(size, dtype=torch.uint8)) for i, size in enumerate(sizes)]
    stream = buckets(iter(tensors), 24, convert)
    first = next(stream)
    assert [name for name, _ in first] == ["0", "1"] and len(converted) == 3  # one tensor ahead, no more
    assert all(t.dtype == torch.float32 for _, t in first)
    streamed = [[int(name) for name, _ in bucket] for bucket in [first, *stream]]
    assert streamed == [list(range(a, b)) for a, b in bucket_spans([4 * s for s in sizes], 24)]
    assert streamed == [[0, 1], [2, 3], [4], [5, 6]]
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1, got 0"):
        next(buckets(iter(tensors), 0))


def test_a_bucket_lying_back_to_back_is_packed_without_a_copy():
    memory = torch.arange(64, dtype=torch.uint8)
    a, b = memory[8:24].view(torch.float32).view(2, 2), memory[24:32].view(torch.float32)
    view = packed_view([a, b], torch.device("cpu"))
    assert view.data_ptr() == memory[8:].data_ptr() and torch.equal(view, memory[8:32])
    assert pack([a, b], torch.device("cpu")).data_ptr() == memory[8:].data_ptr()
    assert packed_view([b, a], torch.device("cpu")) is None  # out of order: copied
    packed = pack([b, a], torch.device("cpu"))
    assert torch.equal(packed, torch.cat([memory[24:32], memory[8:24]]))
    assert packed.data_ptr() not in (memory.data_ptr(), memory[8:].data_ptr(), memory[24:].data_ptr())


def test_the_bucket_error_names_the_server_and_the_error_type():
    error = weight_push.transfer_error(URL, 4, dist.DistBackendError("peer gone"), 5.0)
    assert str(error) == f"rollout server {URL}: sending a bucket of 4 tensors failed: DistBackendError: peer gone"
    assert "not finished within 5 s" in str(weight_push.transfer_error(URL, 1, None, 5.0))

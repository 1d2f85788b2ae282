"""Units of asynchronous rollouts: the producer thread (order, errors, drain, close), the staleness bookkeeping
and the checkpoint form of generated batches."""

from __future__ import annotations

import threading
import time

import pytest

from lit_grpo.data.async_rollouts import AsyncRollouts
from lit_grpo.data.producer import InlineProducer, ProducerClosed, RolloutProducer
from lit_grpo.data.staleness import (
    check_staleness_setup,
    groups_from_state,
    groups_to_state,
    staleness_stats,
    weight_version_of,
)
from lit_grpo.engines.base import Completion, Rollouts


def test_jobs_run_in_order_on_one_thread_and_results_wait_to_be_taken():
    producer = RolloutProducer()
    seen = []

    def job(k):
        seen.append((k, threading.current_thread().name))
        return k * 10

    for k in range(4):
        producer.submit(k, lambda k=k: job(k))
    assert producer.take(2) == (20, None)
    producer.drain()
    assert [k for k, _ in seen] == [0, 1, 2, 3]
    assert {name for _, name in seen} == {"rollout-producer"}  # never the training thread
    assert sorted(producer.finished()) == [0, 1, 3]  # 2 was taken
    assert producer.take(0) == (0, None)
    producer.close()


def test_a_failing_job_hands_its_exception_to_the_taker_and_the_next_job_still_runs():
    producer = RolloutProducer()

    def fail():
        raise ConnectionError("server at http://127.0.0.1:1 is gone")

    producer.submit("a", fail)
    producer.submit("b", lambda: "fine")
    result, error = producer.take("a")
    assert result is None and isinstance(error, ConnectionError) and "127.0.0.1:1" in str(error)
    assert producer.take("b") == ("fine", None)
    producer.close()


def test_drain_waits_for_the_running_job_and_the_queue():
    producer = RolloutProducer()
    release = threading.Event()
    producer.submit(0, lambda: release.wait(5) and "slow")
    producer.submit(1, lambda: "quick")
    threading.Timer(0.3, release.set).start()
    start = time.perf_counter()
    producer.drain()
    assert time.perf_counter() - start >= 0.25
    assert producer.idle() and sorted(producer.finished()) == [0, 1]
    producer.close()


def test_duplicate_unknown_and_closed_jobs_are_refused():
    producer = RolloutProducer()
    producer.submit(0, lambda: 0)
    with pytest.raises(ValueError, match="already submitted"):
        producer.submit(0, lambda: 0)
    with pytest.raises(KeyError, match="never submitted"):
        producer.take(7)
    block = threading.Event()
    producer.submit(1, lambda: block.wait(5))
    producer.submit(2, lambda: 2)
    waiter_error = []

    def wait_for_2():
        try:
            producer.take(2)
        except ProducerClosed as err:
            waiter_error.append(err)

    waiter = threading.Thread(target=wait_for_2)
    waiter.start()
    time.sleep(0.1)
    producer.close()  # job 2 is dropped: its taker stops waiting
    waiter.join(5)
    block.set()
    assert waiter_error and not waiter.is_alive()
    with pytest.raises(ProducerClosed):
        producer.submit(3, lambda: 3)


def completion(versions, n=2):
    return Completion(list(range(n)), [-0.5] * n, False, tuple(versions))


def test_staleness_is_the_step_minus_the_oldest_version_of_each_completion():
    groups = [[completion(["4"]), completion(["3", "4"])], [completion(["4"]), completion(["4"])]]
    assert weight_version_of(groups[0][1]) == 3
    stats = staleness_stats(groups, step=5)
    # per token (two each; without span lengths a completion's tokens take its oldest version): 1 1 2 2 1 1 1 1
    assert stats == {"staleness_mean": (1 + 2 + 1 + 1) / 4, "staleness_max": 2.0, "mixed_versions": 1.0,
                     "token_staleness_mean": 10 / 8, "token_staleness_max": 2.0}


def test_a_completion_without_a_version_or_with_a_foreign_one_is_refused():
    with pytest.raises(ValueError, match="carries no weight version"):
        weight_version_of(completion([]))
    with pytest.raises(ValueError, match="not optimizer steps"):
        weight_version_of(completion(["policy-v2"]))


def test_generated_batches_survive_their_checkpoint_form():
    groups = [[Completion([5, 6, 7], [-0.25, -1.5, -2.0], True, ("3",))], [completion(["2", "3"], n=1)]]
    state = groups_to_state(groups)
    assert all(type(x) in (int, float, bool, str) for g in state for c in g for v in c.values()
               for x in (v if isinstance(v, list) else [v]))
    assert groups_from_state(state) == groups


@pytest.mark.parametrize(("k", "engine", "match"), [
    (-1, "server", "integer >= 0"), (1.5, "server", "integer >= 0"), (True, "server", "integer >= 0"),
    (1, "transformers", "stays synchronous"), (2, "vllm", "stays synchronous"),
])
def test_bad_staleness_settings_are_refused_with_the_value(k, engine, match):
    with pytest.raises(ValueError, match=match):
        check_staleness_setup(k, engine)


def test_async_rollouts_refuse_a_delayed_weight_sync():
    class Delayed:
        delay_batches = 2

    with pytest.raises(ValueError, match="delay_batches=2"):
        check_staleness_setup(1, "server", [Delayed()])
    check_staleness_setup(0, "transformers", [Delayed()])  # synchronous: any engine, any sync


def data_module(k: int, restored: dict | None = None):
    """A data module with K = ``k`` holding ``restored`` batches generated ahead (as an earlier fit's teardown
    or an earlier state leaves them). Its engine is never built: only its checkpoint state is used."""
    from lit_grpo.data.datamodule import RolloutDataModule

    module = RolloutDataModule(max_prompts=4, prompts_per_step=1)
    # K set past the constructor, which would ask for a server: the state does not use one
    module.async_rollouts = AsyncRollouts(k, module.rollout_job)
    module.async_rollouts.restored = dict(restored or {})
    return module


EARLIER = {5: ([[completion(["4"])]], 1.5)}  # left by an earlier fit's teardown or an earlier state
SAVED = {7: ([[completion(["6"]), completion(["6", "7"])]], 2.5)}  # generated ahead in the checkpoint's run


def test_a_state_without_batches_generated_ahead_leaves_none_restored():
    # a checkpoint of a synchronous run (K = 0) holds none
    loaded = data_module(1, EARLIER)
    loaded.load_state_dict(data_module(0).state_dict())
    assert loaded.async_rollouts.restored == {}
    # a synchronous run loading an asynchronous checkpoint regenerates its batches
    loaded = data_module(0, EARLIER)
    with pytest.warns(UserWarning, match="this run is synchronous"):
        loaded.load_state_dict(data_module(1, SAVED).state_dict())
    assert loaded.async_rollouts.restored == {}


def test_a_state_from_another_world_size_leaves_none_restored():
    state = data_module(1, SAVED).state_dict()
    loaded = data_module(1, EARLIER)
    loaded.load_state_dict(state)
    assert loaded.async_rollouts.restored == SAVED  # the same world size: the checkpoint's batches, and only those
    in_flight = state["in_flight"]
    other_world = dict(state, in_flight=dict(in_flight, world_size=2, ranks=in_flight["ranks"] * 2))
    loaded = data_module(1, EARLIER)
    with pytest.warns(UserWarning, match="come from 2 ranks and this run has 1"):
        loaded.load_state_dict(other_world)
    assert loaded.async_rollouts.restored == {}  # regenerated, and the earlier ones with them


def requests_of(k: int, log: list) -> AsyncRollouts:
    """``AsyncRollouts`` whose request for batch j records the thread it runs on and returns one completion."""
    def request(j: int):  # noqa: ANN202
        def job():  # noqa: ANN202
            log.append((j, threading.current_thread().name))
            if j == 99:
                raise RuntimeError("engine broke")
            return Rollouts([[completion([str(j)])]]), float(j)
        return job
    return AsyncRollouts(k, request)


def test_k0_requests_each_batch_on_the_training_thread_when_it_is_taken():
    log = []
    rollouts = requests_of(0, log)
    for index in (0, 1, 2):
        got, seconds, waited = rollouts.take(index)
        assert got.groups[0][0].versions == (str(index),) and seconds == float(index) and waited == 0.0
    assert log == [(j, threading.current_thread().name) for j in (0, 1, 2)]  # nothing ahead, nothing elsewhere
    assert isinstance(rollouts.producer, InlineProducer) and rollouts.producer_waits == 0
    with pytest.raises(RuntimeError, match="engine broke"):  # as from a direct call: no error to agree on
        rollouts.take(99)
    rollouts.keep_generated()
    assert rollouts.restored == {} and rollouts.producer is None


def test_k1_requests_the_next_batch_ahead_on_the_producer_thread():
    log = []
    rollouts = requests_of(1, log)
    got, _, _ = rollouts.take(0)
    assert got.groups[0][0].versions == ("0",)
    rollouts.drain()  # batch 1 was handed over when batch 0 was taken
    assert [j for j, _ in log] == [0, 1] and {name for _, name in log} == {"rollout-producer"}
    rollouts.keep_generated()  # the end of a fit keeps batch 1 for the next one
    assert list(rollouts.restored) == [1] and rollouts.producer is None
    got, seconds, _ = rollouts.take(1)  # the kept batch, not requested again; batch 2 is handed over
    rollouts.drain()
    assert got.groups[0][0].versions == ("1",) and seconds == 1.0 and [j for j, _ in log] == [0, 1, 2]
    rollouts.stop()

"""The OpenEnv adapter against a real OpenEnv server (tests/openenv_echo_server.py, started here over uvicorn): the
episode's text, rewards and done flags over the WebSocket protocol, the options a config names, close() freeing the
server's session, and one-line errors (server down, server-side failure, bad options, package missing)."""

from __future__ import annotations

import re
import select
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ports import free_port

from lit_grpo.environments.openenv import (
    INSTALL_HINT,
    OpenEnvEnvironment,
    OpenEnvFactory,
    observation_text,
    step_reward,
)
from lit_grpo.environments.protocol import StepResult, check_reset, check_step

SERVER = Path(__file__).with_name("openenv_echo_server.py")
MAX_SESSIONS = 2
LOOP_THREAD = "openenv-sync-client-loop"  # the name openenv's sync client gives its event-loop thread


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    yield from serve(MAX_SESSIONS)


def serve(max_sessions: int) -> Iterator[str]:
    """The test server with room for ``max_sessions`` sessions, running until the generator is closed."""
    # the server's log goes to a file, not a pipe: a pipe nobody reads fills up and then blocks the server
    log_file = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, str(SERVER), str(max_sessions)], stdout=subprocess.PIPE,
                            stderr=log_file, text=True)
    try:
        # imported while the server starts (both take seconds): skipped, with the reason, without the extra
        pytest.importorskip("openenv.core.generic_client", reason=INSTALL_HINT)
        deadline = time.monotonic() + 60
        url = None
        while url is None:
            if proc.poll() is not None:
                log_file.seek(0)
                log = log_file.read()[-2000:]
                raise RuntimeError(f"the OpenEnv test server exited with {proc.returncode}: {log}")
            if time.monotonic() > deadline:
                raise RuntimeError("the OpenEnv test server did not start within 60 s")
            if select.select([proc.stdout], [], [], 0.5)[0]:
                match = re.search(r"listening on (http://\S+)", proc.stdout.readline())
                url = match.group(1) if match else None
        yield url
    finally:
        proc.kill()
        proc.wait()
        log_file.close()


def loop_threads() -> int:
    return sum(t.name == LOOP_THREAD and t.is_alive() for t in threading.enumerate())


def play(env: OpenEnvEnvironment, guesses: list[str]) -> tuple[str, list[StepResult]]:
    """reset, then one step per guess; every answer checked by the protocol's own checks (what the data path
    does)."""
    first = env.reset()
    check_reset(first)
    return first, [check_step(env.step(guess)) for guess in guesses]


def test_an_episode_over_the_wire_gives_text_rewards_and_done(server_url):
    env = OpenEnvFactory(base_url=server_url)({"seed": 17})  # target 17 % 10 = 7: the row's seed reached reset
    try:
        first, steps = play(env, ["3", "9", "7"])
    finally:
        env.close()
    assert first == "Guess a number from 0 to 9."  # the one string field; tries_left (an int) is not shown
    assert [s.reply for s in steps] == [[{"role": "user", "content": "Wrong: higher."}],
                                        [{"role": "user", "content": "Wrong: lower."}],
                                        [{"role": "user", "content": "Correct!"}]]
    assert [s.reward for s in steps] == [0.0, 0.0, 1.0]
    assert [s.done for s in steps] == [False, False, True]


def test_the_last_wrong_guess_ends_with_the_servers_penalty(server_url):
    env = OpenEnvFactory(base_url=server_url)({"seed": 4})
    try:
        _, steps = play(env, ["not a guess", "9", "0"])
    finally:
        env.close()
    assert steps[0].reply[0]["content"] == "Wrong: not a number."
    assert [s.reward for s in steps] == [0.0, 0.0, -1.0]
    assert [s.done for s in steps] == [False, False, True]
    assert steps[-1].reply[0]["content"] == "Out of tries; it was 4."


def test_rendering_options_observation_field_and_render(server_url):
    env = OpenEnvFactory(base_url=server_url, observation_field="tries_left")({"seed": 1})
    try:
        assert env.reset() == "3"  # a non-string field is shown as JSON
        assert env.step("5") == ("2", 0.0, False)
    finally:
        env.close()

    def as_chat(observation: dict[str, Any]) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{observation['text']} ({observation['tries_left']} left)"}]

    env = OpenEnvFactory(base_url=server_url, render=as_chat)({"seed": 1})
    try:
        assert check_reset(env.reset()) == [{"role": "user", "content": "Guess a number from 0 to 9. (3 left)"}]
        assert env.step("1") == ([{"role": "user", "content": "Correct! (2 left)"}], 1.0, True)
    finally:
        env.close()


def test_an_action_class_named_by_import_path_builds_the_action(server_url):
    # tests/ is on sys.path (conftest.py): the environment's own pydantic Action validates before sending
    factory = OpenEnvFactory(base_url=server_url, action="openenv_echo_server:GuessAction")
    env = factory({"seed": 2})
    try:
        env.reset()
        assert env.step("2") == ("Correct!", 1.0, True)
    finally:
        env.close()


def custom_action(text: str) -> dict[str, str]:
    return {"message": text.strip().removeprefix("ANSWER:").strip()}


def test_an_action_function_shapes_the_completion(server_url):
    env = OpenEnvFactory(base_url=server_url, action=custom_action)({"seed": 8})
    try:
        env.reset()
        assert env.step("  ANSWER: 8 ") == ("Correct!", 1.0, True)
    finally:
        env.close()


def test_the_rows_address_overrides_the_factorys_when_allowed(server_url):
    dead = f"http://127.0.0.1:{free_port()}"
    env = OpenEnvFactory(base_url=dead, url_from_row=True)({"seed": 0, "base_url": server_url})
    try:
        assert env.reset() == "Guess a number from 0 to 9."
    finally:
        env.close()
    # the class itself is a factory when each row names its server, allowed explicitly
    env = OpenEnvEnvironment({"base_url": server_url, "seed": 5}, url_from_row=True)
    try:
        env.reset()
        assert env.step("5")[1:] == (1.0, True)
    finally:
        env.close()


def test_server_side_errors_are_raised_as_one_line(server_url):
    env = OpenEnvFactory(base_url=server_url)({"seed": 0})
    try:
        env.reset()
        with pytest.raises(RuntimeError) as raised:
            env.step("boom")
    finally:
        env.close()
    message = str(raised.value)
    assert "\n" not in message
    assert server_url in message and "step()" in message and "the environment blew up on purpose" in message

    # an Action class checks before sending: its validation error, as one line
    env = OpenEnvFactory(base_url=server_url, action="openenv_echo_server:GuessAction", action_field="guess")({})
    try:
        env.reset()
        with pytest.raises(ValueError, match=r"could not be built from the completion: .*message") as raised:
            env.step("3")
        assert "\n" not in str(raised.value)
    finally:
        env.close()

    # an action the server's Action class rejects (no field 'guess'): the server's validation error, raised
    env = OpenEnvFactory(base_url=server_url, action_field="guess")({"seed": 0})
    try:
        env.reset()
        with pytest.raises(RuntimeError, match=r"failed step\(\).*VALIDATION_ERROR"):
            env.step("3")
    finally:
        env.close()


def test_close_frees_the_servers_session_and_the_clients_thread(server_url):
    before = loop_threads()
    envs = [OpenEnvFactory(base_url=server_url)({"seed": i}) for i in range(MAX_SESSIONS)]
    for env in envs:
        env.reset()
    assert loop_threads() == before + MAX_SESSIONS
    extra = OpenEnvFactory(base_url=server_url)({"seed": 9})
    # the server is full: its refusal is raised, or (when it closed before the refusal was read) the close, named
    with pytest.raises(RuntimeError, match=r"CAPACITY_REACHED|closed the session during reset\(\).*max_concurrent"):
        extra.reset()
    extra.close()

    envs[0].close()
    envs[0].close()  # idempotent
    assert loop_threads() == before + MAX_SESSIONS - 1
    with pytest.raises(RuntimeError, match="is closed"):
        envs[0].step("1")
    # the freed session is reused; the server drops it once its WebSocket closes, which may take a moment
    deadline = time.monotonic() + 60
    while True:
        again = OpenEnvFactory(base_url=server_url, connect_timeout_s=30.0)({"seed": 3})
        try:
            assert again.reset() == "Guess a number from 0 to 9."
            assert again.step("3") == ("Correct!", 1.0, True)
            break
        except (RuntimeError, ConnectionError):  # not freed yet, or a handshake slowed by a loaded machine
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
        finally:
            again.close()
    envs[1].close()
    assert loop_threads() == before


def test_a_server_that_is_down_gives_one_clear_line():
    pytest.importorskip("openenv.core.generic_client", reason=INSTALL_HINT)
    url = f"http://127.0.0.1:{free_port()}"
    before = loop_threads()
    env = OpenEnvFactory(base_url=url, connect_timeout_s=2.0)({"seed": 0})
    with pytest.raises(ConnectionError) as raised:
        env.reset()
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"OpenEnv server at {url} did not answer reset()")
    assert message.endswith("is it running there?")
    assert loop_threads() == before  # the failed client's thread was stopped
    env.close()


@pytest.mark.parametrize("make, expected", [
    (lambda: OpenEnvEnvironment({}), r"OpenEnv server address is None; expected base_url="),
    (lambda: OpenEnvFactory(base_url="http://x", reset_fields="seed")({}), r"reset_fields='seed'; expected a list"),
    (lambda: OpenEnvFactory(action="no_such_module:Action"), r"OpenEnv action 'no_such_module:Action': cannot import"),
    (lambda: OpenEnvFactory(render=42), r"OpenEnv render must be an import path or a callable, got int"),
])
def test_bad_options_fail_at_configuration_with_one_line(make: Callable[[], Any], expected: str):
    with pytest.raises((ValueError, TypeError), match=expected) as raised:
        make()
    assert "\n" not in str(raised.value)


def test_step_before_reset_is_refused():
    env = OpenEnvFactory(base_url="http://127.0.0.1:1")({})
    with pytest.raises(RuntimeError, match=r"step\(\) before reset\(\)"):
        env.step("1")


def test_observation_text_and_reward_conversions():
    assert observation_text({"text": "hi", "n": 2}) == "hi"
    # no single string field: every field, sorted compact JSON (stable whatever the dict order)
    assert observation_text({"b": "x", "a": "y"}) == '{"a":"y","b":"x"}'
    assert observation_text({"n": 2, "board": [[0, 1]]}) == '{"board":[[0,1]],"n":2}'
    assert observation_text({"board": [[0, 1]], "n": 2}, "board") == "[[0,1]]"
    with pytest.raises(KeyError, match=r"no field 'txt'; it has \['n', 'text'\]"):
        observation_text({"text": "hi", "n": 2}, "txt")
    assert step_reward(None) is None
    assert step_reward(True) == 1.0 and isinstance(step_reward(True), float)
    assert step_reward(3) == 3.0
    with pytest.raises(TypeError, match="reward '1'; expected a number"):
        step_reward("1")


def test_missing_package_names_the_extra(monkeypatch):
    for name in ("openenv", "openenv.core", "openenv.core.generic_client"):
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: the import fails as if not installed
    env = OpenEnvFactory(base_url="http://127.0.0.1:1")({})
    with pytest.raises(ImportError) as raised:
        env.reset()
    assert str(raised.value).startswith(INSTALL_HINT)
    assert 'pip install -e ".[openenv]"' in INSTALL_HINT  # the package is not on the index: a checkout's extra


def test_a_config_names_the_factory_with_its_options():
    # data.environment takes a callable; jsonargparse builds a callable class from class_path and init_args
    from collections.abc import Callable as CallableType

    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--environment", type=str | CallableType[[dict], Any])
    config = parser.parse_args(["--environment", '{"class_path": "lit_grpo.environments.openenv.OpenEnvFactory", '
                                                 '"init_args": {"base_url": "http://h:1", "action_field": "code"}}'])
    factory = parser.instantiate_classes(config).environment
    assert isinstance(factory, OpenEnvFactory)
    env = factory({"seed": 3})
    assert env.base_url == "http://h:1" and env.reset_kwargs == {"seed": 3}


def test_a_fit_trains_on_an_openenv_server():
    """The adapter as a run uses it: ``data.environment`` an ``OpenEnvFactory``, one step of a fit whose trajectories
    are played on the server (a session per trajectory, several at once)."""
    import lightning as L
    from conftest import MetricsRecorder, tiny_module
    from lit_grpo.callbacks import WeightSync

    from lit_grpo.data.datamodule import RolloutDataModule

    server = serve(16)
    url = next(server)
    try:
        data = RolloutDataModule(dataset=str(Path(__file__).parent / "data" / "openenv_tasks.jsonl"),
                                 environment=OpenEnvFactory(base_url=url, connect_timeout_s=30.0),
                                 prompts_per_step=2, num_generations=2, micro_batch_size=4, max_new_tokens=4,
                                 system_prompt=None, multi_turn={"max_turns": 2})
        recorder = MetricsRecorder()
        trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, callbacks=[WeightSync(), recorder])
        trainer.fit(tiny_module(max_completion_length=4), data)
    finally:
        server.close()
    (metrics,) = recorder.steps
    assert metrics["rollout/env_errors"] == 0.0  # every session opened, played and closed
    assert 1.0 <= metrics["rollout/turns"] <= 2.0
    assert metrics["rollout/reward_mean"] in {0.0, 0.25, 0.5, 0.75, 1.0}  # the server's rewards, 1 per right guess

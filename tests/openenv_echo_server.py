"""A small OpenEnv environment served for tests/test_openenv.py: guess a number from 0 to 9, three tries.

Built on openenv-core's own server classes (``Environment``, ``Action``, ``Observation``, ``create_app``), so the
adapter is tested against the real wire protocol. The target is ``seed % 10`` (the seed comes from the dataset row
through ``reset``). A correct guess: reward 1.0, done. A wrong one: reward 0.0 and a hint; the third wrong one ends
the episode with reward -1.0. The guess ``boom`` makes the environment raise (a server-side error).

Run: ``python tests/openenv_echo_server.py [MAX_SESSIONS]``: serves on a free port of 127.0.0.1 and prints
``listening on http://127.0.0.1:PORT`` once bound.
"""

from __future__ import annotations

import sys
from typing import Any

if __name__ == "__main__":
    # no web UI is served here (ENABLE_WEB_INTERFACE is unset): without gradio, openenv's server side imports in a
    # few seconds instead of over ten (it skips its web interface when gradio cannot be imported)
    sys.modules["gradio"] = None  # type: ignore[assignment]

from openenv.core.env_server import Action, Environment, Observation, State, create_app
from pydantic import Field


class GuessAction(Action):
    message: str = Field(..., description="the guess, as text")


class GuessObservation(Observation):
    text: str = Field(default="", description="what the environment says")
    tries_left: int = Field(default=3, description="guesses left")


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each WebSocket session gets its own instance; nothing is shared

    def __init__(self) -> None:
        super().__init__()
        self._state = State()
        self.target = 0
        self.tries_left = 3

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.target = (seed or 0) % 10
        self.tries_left = 3
        return GuessObservation(text="Guess a number from 0 to 9.", tries_left=self.tries_left)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        if action.message.strip() == "boom":
            raise ValueError("the environment blew up on purpose")
        self._state.step_count += 1
        self.tries_left -= 1
        try:
            guess = int(action.message.strip())
        except ValueError:
            guess = None
        if guess == self.target:
            return GuessObservation(text="Correct!", tries_left=self.tries_left, reward=1.0, done=True)
        if self.tries_left == 0:
            return GuessObservation(text=f"Out of tries; it was {self.target}.", tries_left=0, reward=-1.0,
                                    done=True)
        hint = "not a number" if guess is None else ("higher" if guess < self.target else "lower")
        return GuessObservation(text=f"Wrong: {hint}.", tries_left=self.tries_left, reward=0.0, done=False)

    @property
    def state(self) -> State:
        return self._state


def make_app(max_sessions: int) -> Any:
    return create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess_number",
                      max_concurrent_envs=max_sessions)


if __name__ == "__main__":
    import socket

    import uvicorn

    sessions = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    # the socket is bound here, on a port the system picks, and handed to uvicorn: no race for a "free" port
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # connections made before uvicorn has started wait in the backlog instead of being refused
    server = uvicorn.Server(uvicorn.Config(make_app(sessions), log_level="warning"))
    print(f"listening on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    server.run(sockets=[sock])

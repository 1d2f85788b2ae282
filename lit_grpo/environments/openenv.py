"""OpenEnv environments as lit_grpo environments: an adapter over ``openenv-core``'s WebSocket client.

An OpenEnv environment runs as a server (``openenv.core.env_server.create_app`` served by uvicorn, a Docker image, a
Space); a client holds one session per trajectory over the server's ``/ws`` endpoint (its HTTP ``/step`` makes a
fresh environment each call, so it cannot hold a multi-turn episode). The adapter speaks to any such server with
``openenv``'s generic client, so the environment's own package need not be installed here:

- ``reset()`` resets the server's session (the row's ``seed`` and ``episode_id`` go along when the row has them) and
  returns the first observation as text: the first user message;
- ``step(completion)`` turns the model's text into the server's action (``{action_field: completion}`` by default),
  steps the session and returns ``(observation text, reward, done)``;
- ``close()`` ends the session; the server frees its slot.

Errors are raised, one line naming the server: a server that does not answer, a session the server refuses (its
``max_concurrent_envs`` is full), an action it rejects, an environment that raises. The data path counts them as
environment errors.

How a run names it. The data module calls the factory with a dataset row only, so the options are bound first:

- in a config, as a class with its arguments (``data.environment`` takes a callable)::

      data:
        environment:
          class_path: lit_grpo.environments.openenv.OpenEnvFactory
          init_args: {base_url: "http://127.0.0.1:8000", action_field: message}

- in Python, ``OpenEnvFactory(base_url=..., ...)`` is the factory itself; or bind it once in a module of your own
  (``echo = OpenEnvFactory(base_url="http://127.0.0.1:8000")``) and name it ``data.environment: my_envs:echo``;
- rows that carry their server's address (a ``base_url`` field: rows spread over several servers) are taken only
  with ``url_from_row: true`` in the factory's options. The server answers with the rewards, so a row's address
  decides who scores the completions sent there; a dataset is data, and does not get to choose that unless the
  config says so. Without the option, a row whose address differs from ``base_url`` is refused in one line, not
  ignored: ignoring it would quietly play that task on another server than the one the dataset named.

The server must allow as many sessions as trajectories run at once (``create_app(..., max_concurrent_envs=N)`` with
an environment marked ``SUPPORTS_CONCURRENT_SESSIONS``); one more is refused with the server's message.

Installing: ``pip install -e ".[openenv]"`` in a checkout (the extra is ``openenv-core``). Importing ``openenv``
takes seconds (its package imports its server side, gradio included); it happens once per process, on the first
environment made.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Sequence
from typing import Any

from lit_grpo.core.import_paths import resolve_callable
from lit_grpo.environments.protocol import Messages

INSTALL_HINT = ('the OpenEnv adapter needs openenv-core: pip install -e ".[openenv]" in a checkout, or '
                'pip install "openenv-core>=0.3,<0.4"')
ActionBuilder = Callable[[str], Any]
ObservationRenderer = Callable[[dict[str, Any]], "str | Messages"]


def _generic_client_class() -> type:
    """``openenv``'s generic (dict-based) client class, imported on first use: the package is an optional extra."""
    try:
        from openenv.core.generic_client import GenericEnvClient
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return GenericEnvClient


def observation_text(observation: dict[str, Any], field: str | None = None) -> str:
    """The text of an OpenEnv observation (its fields, without ``reward``, ``done`` and ``metadata``, which the
    server sends apart). With ``field``, that field's value; without, the one string field when there is exactly
    one (an echo environment's message, a game's board); otherwise every field as sorted, compact JSON, so the
    model still sees all of it and the rendering never depends on dict order."""
    if not isinstance(observation, dict):
        raise TypeError(f"OpenEnv observation is a {type(observation).__name__}; expected a dict of fields")
    if field is not None:
        if field not in observation:
            raise KeyError(f"OpenEnv observation has no field {field!r}; it has {sorted(observation)} "
                           f"(set observation_field to one of them)")
        value = observation[field]
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(",", ":"))
    texts = [value for value in observation.values() if isinstance(value, str)]
    if len(texts) == 1:
        return texts[0]
    return json.dumps(observation, sort_keys=True, separators=(",", ":"))


def step_reward(value: object) -> float | None:
    """An OpenEnv reward as the protocol's: ``None`` stays ``None`` (counts 0); a bool or a number becomes a float
    (OpenEnv's ``Observation.reward`` may be a bool, which the protocol does not take)."""
    if value is None:
        return None
    if isinstance(value, bool | int | float):
        return float(value)
    raise TypeError(f"OpenEnv server returned reward {value!r}; expected a number, a bool or null")


def text_action(field: str) -> ActionBuilder:
    """The default action: the model's whole completion in one field of the server's action (``{field: text}``)."""

    def build(text: str) -> dict[str, Any]:
        return {field: text}

    return build


def _resolve(spec: str | Callable[..., Any] | None, what: str, expected: str) -> Callable[..., Any] | None:
    if spec is None or callable(spec):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"OpenEnv {what} must be an import path or a callable, got {type(spec).__name__}; "
                         f"{expected}")
    return resolve_callable(spec, f"OpenEnv {what}", expected)


def action_builder(action: str | Callable[..., Any] | None, action_field: str) -> ActionBuilder:
    """How a completion becomes the server's action. ``None``: ``{action_field: text}``. A class (the
    environment's pydantic ``Action``, checked here before it is sent): ``Action(**{action_field: text})``. Any other
    callable (or its import path): ``action(text)``, returning a dict or an ``Action``."""
    resolved = _resolve(action, "action", "expected package.module:name of an Action class or of a function "
                                          "text -> action")
    if resolved is None:
        return text_action(action_field)
    if isinstance(resolved, type):
        return lambda text: resolved(**{action_field: text})
    return resolved


def observation_renderer(render: str | Callable[..., Any] | None, observation_field: str | None
                         ) -> ObservationRenderer:
    """How an observation (a dict of fields) becomes the reply: ``render(observation)`` when given (text or chat
    messages), else :func:`observation_text` with ``observation_field``."""
    resolved = _resolve(render, "render", "expected package.module:name of a function observation dict -> text")
    if resolved is not None:
        return resolved
    return lambda observation: observation_text(observation, observation_field)


class OpenEnvEnvironment:
    """One trajectory's OpenEnv session (the plain protocol: ``reset``, ``step``, ``close``).

    ``row`` is the dataset row: with ``url_from_row``, its ``url_field`` (``base_url``) overrides ``base_url``
    (else a row's address other than ``base_url`` is refused); its fields named in ``reset_fields`` (``seed``,
    ``episode_id``) go to the server's ``reset`` when present. The other options are those of
    :class:`OpenEnvFactory`. Nothing is sent before ``reset()``.
    """

    def __init__(self, row: dict[str, Any], base_url: str | None = None, action_field: str = "message",
                 observation_field: str | None = None, action: str | Callable[..., Any] | None = None,
                 render: str | Callable[..., Any] | None = None,
                 reset_fields: Sequence[str] = ("seed", "episode_id"), url_field: str = "base_url",
                 url_from_row: bool = False, connect_timeout_s: float = 10.0,
                 message_timeout_s: float = 60.0) -> None:
        if not isinstance(row, dict):
            raise TypeError(f"OpenEnvEnvironment takes a dataset row (a dict), got {type(row).__name__}")
        url = server_address(row, base_url, url_field, url_from_row)
        if isinstance(reset_fields, str):
            raise ValueError(f"reset_fields={reset_fields!r}; expected a list of row field names")
        self.base_url = url
        self.reset_kwargs = {name: row[name] for name in reset_fields if row.get(name) is not None}
        self._action = action_builder(action, action_field)
        self._render = observation_renderer(render, observation_field)
        self._timeouts = {"connect_timeout_s": connect_timeout_s, "message_timeout_s": message_timeout_s}
        self._client: Any = None
        self.closed = False

    def reset(self) -> str | Messages:
        """Start the session (connecting on the first call) and return the first observation's text."""
        result = self._call("reset", lambda client: client.reset(**self.reset_kwargs))
        return self._render(result.observation)

    def step(self, completion: str) -> tuple[str | Messages | None, float | None, bool]:
        """Send the completion as the action; the observation's text (also when done: the trajectory's record keeps
        it), its reward and whether the episode ended."""
        if self._client is None and not self.closed:
            raise RuntimeError(f"OpenEnv environment at {self.base_url}: step() before reset(); the data path "
                               f"resets each environment first")
        try:
            action = self._action(completion)
        except Exception as e:  # e.g. the Action class's validation, which pydantic spreads over several lines
            raise ValueError(f"OpenEnv action for {self.base_url} could not be built from the completion: "
                             f"{_one_line(e)}") from e
        result = self._call("step", lambda client: client.step(action))
        return self._render(result.observation), step_reward(result.reward), bool(result.done)

    def close(self) -> None:
        """End the session (the server frees it) and stop the client's event-loop thread; idempotent."""
        self.closed = True
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def _call(self, what: str, request: Callable[[Any], Any]) -> Any:
        """``request(client)``, connecting first; any failure re-raised as one line naming the server."""
        if self.closed:
            raise RuntimeError(f"OpenEnv environment at {self.base_url} is closed; {what}() needs a new one")
        try:
            if self._client is None:
                self._client = _connected(_generic_client_class()(base_url=self.base_url, **self._timeouts).sync())
            return request(self._client)
        except ImportError:
            raise
        except ConnectionError as e:
            raise ConnectionError(f"OpenEnv server at {self.base_url} did not answer {what}(): {_one_line(e)}; "
                                  f"is it running there?") from e
        except (TimeoutError, asyncio.TimeoutError) as e:  # the server took longer than message_timeout_s
            raise TimeoutError(f"OpenEnv server at {self.base_url} did not answer {what}() within "
                               f"{self._timeouts['message_timeout_s']} s (message_timeout_s)") from e
        except Exception as e:
            if type(e).__name__.startswith("ConnectionClosed"):  # websockets' ConnectionClosed{OK,Error}
                # a full server accepts the WebSocket, then closes it: its refusal may not be read before the close
                raise RuntimeError(f"OpenEnv server at {self.base_url} closed the session during {what}() "
                                   f"({_one_line(e)}); a server whose max_concurrent_envs sessions are all in use "
                                   f"closes new ones") from e
            raise RuntimeError(f"OpenEnv server at {self.base_url} failed {what}(): {_one_line(e)}") from e


def server_address(row: dict[str, Any], base_url: str | None, url_field: str, url_from_row: bool) -> str:
    """The server a row's trajectory plays on: ``base_url``, or with ``url_from_row`` the row's ``url_field`` when it
    has one. A row's address is refused unless allowed (it would pick the server that scores the completions), except
    when it is ``base_url`` itself."""
    row_url = row.get(url_field)
    if row_url is not None and not url_from_row and row_url != base_url:
        raise ValueError(f"the dataset row's {url_field!r} {row_url!r} would send its completions to another OpenEnv "
                         f"server than base_url={base_url!r}, and that server gives the rewards; set "
                         f"url_from_row=True in the factory's options to let rows name their server, or drop the "
                         f"field from the rows")
    url = row_url if row_url is not None and url_from_row else base_url
    if not isinstance(url, str) or not url:
        raise ValueError(f"OpenEnv server address is {url!r}; expected base_url='http://host:port' in the factory's "
                         f"options (or, with url_from_row=True, a {url_field!r} field in each dataset row)")
    return url


class OpenEnvFactory:
    """The ``data.environment`` factory for an OpenEnv server: options bound once, one
    :class:`OpenEnvEnvironment` per dataset row (``factory(row)``).

    Options:
        base_url: the server (``http://host:port`` or ``ws://host:port``).
        action_field: the field of the server's action that receives the completion (``message`` for echo).
        observation_field: the observation field shown to the model; ``None``: the one string field, else JSON.
        action: an ``Action`` class, or a function ``text -> action`` (a dict or an ``Action``), or its import path.
        render: a function ``observation dict -> text or chat messages``, or its import path; replaces
            ``observation_field``.
        reset_fields: row fields passed to the server's ``reset`` when present (``seed``, ``episode_id``).
        url_field: the row field that holds a per-row server address.
        url_from_row: let a row's ``url_field`` override ``base_url`` (off: such a row is refused, unless its address
            is ``base_url``). The server gives the rewards, so only a config may let the data choose it.
        connect_timeout_s, message_timeout_s: the client's limits for connecting and for each answer.
    """

    def __init__(self, base_url: str | None = None, action_field: str = "message",
                 observation_field: str | None = None, action: str | Callable[..., Any] | None = None,
                 render: str | Callable[..., Any] | None = None,
                 reset_fields: Sequence[str] = ("seed", "episode_id"), url_field: str = "base_url",
                 url_from_row: bool = False, connect_timeout_s: float = 10.0,
                 message_timeout_s: float = 60.0) -> None:
        self.options: dict[str, Any] = {
            "base_url": base_url, "action_field": action_field, "observation_field": observation_field,
            # resolved once here, so a bad import path fails when the run is configured, not per trajectory
            "action": _resolve(action, "action", "expected package.module:name of an Action class or of a "
                                                 "function text -> action"),
            "render": _resolve(render, "render", "expected package.module:name of a function observation "
                                                 "dict -> text"),
            "reset_fields": tuple(reset_fields) if not isinstance(reset_fields, str) else reset_fields,
            "url_field": url_field, "url_from_row": bool(url_from_row), "connect_timeout_s": connect_timeout_s,
            "message_timeout_s": message_timeout_s,
        }

    def __call__(self, row: dict[str, Any]) -> OpenEnvEnvironment:
        return OpenEnvEnvironment(row, **self.options)


def _connected(client: Any) -> Any:
    """``client`` connected; when it cannot connect, its event-loop thread is stopped before the error goes up."""
    try:
        client.connect()
    except BaseException:
        with contextlib.suppress(Exception):
            client.close()
        raise
    return client


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__

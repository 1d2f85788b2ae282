"""Tools a model calls by name: plain Python functions with type hints and a Google-style docstring.

Their JSON schemas come from transformers (``transformers.utils.get_json_schema``, the same schemas
``apply_chat_template(tools=...)`` renders), so a function that transformers cannot describe is refused when the
run starts, in one line. A tool that raises, times out, or gets arguments it does not take answers with an error
message, which goes back to the model as the tool's result, and the trajectory goes on; a tool that raises or times
out is also warned about once, in one line naming it and its first failure.

The calls of a batch (every trajectory's calls of one turn) run at once, at most :data:`MAX_CONCURRENT_CALLS` calls
of each tool at a time, each with the time limit ``timeout_s`` from its start: a turn whose tools hang waits about
one limit, not the sum. Two runners (``multi_turn.tool_runner``):

- ``thread`` (the default): each call on a daemon thread of the trainer's process. Any callable runs (a closure, a
  function of the script, an object's method), with no cost per call, which suits the quick pure functions tools
  mostly are (the calculator answers in microseconds). Python cannot stop a thread: a call past its limit is
  answered with a timeout and runs on, its side effects included, holding one of its tool's slots until it returns
  (so a tool that hangs for ever leaves at most :data:`MAX_CONCURRENT_CALLS` threads; its later calls that find no
  free slot within the limit are answered with a timeout too, and the other tools keep theirs).
- ``process``: each call in a process of its own, forked from a server process that Python's ``forkserver`` start
  method starts once (``spawn`` where the platform has no ``forkserver``), never from the trainer (a fork of a
  process with threads and CUDA may deadlock). A call past its limit is killed (SIGKILL; processes the tool started
  itself are not), so nothing it would have done afterwards happens. The child imports the tool by its module and
  qualified name: a tool must be a module-level function importable as ``package.module:function`` (not a closure,
  a lambda or a function of the script run as ``__main__``), refused in one line otherwise. The server imports the
  tools' modules once and does not run the trainer's script (:func:`adopt_trainer_main`), so each call costs a
  fork, about 10-20 ms on a loaded 2-core machine, whatever the script imports. A tool cannot start processes of its
  own through ``multiprocessing`` (``subprocess`` works). Where the server was started by other code first, or
  ``spawn`` is used, each call's process runs the script again, as Python does for any process it starts so: the
  script must then guard its entry point with ``if __name__ == "__main__":``, and an unguarded one is refused there
  in one line.
"""

from __future__ import annotations

import importlib.machinery
import inspect
import json
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.spawn
import os
import pickle
import queue
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from lit_grpo.core.import_paths import resolve_callable
from lit_grpo.environments.tool_calls import ToolCall

EXPECTED_TOOL = "expected an import path package.module:function of a type-hinted function with a docstring"
#: how tool calls run (``multi_turn.tool_runner``; the module's docstring compares them)
TOOL_RUNNERS = ("process", "thread")
#: calls of one tool running at once at most (a thread runner's calls past their limit included)
MAX_CONCURRENT_CALLS = 32
#: how long a process call may take beyond its limit before it is answered anyway (its kill normally takes
#: milliseconds; this only bounds a turn if starting or killing a process ever stalls)
PROCESS_GRACE_S = 5.0
#: how often a batch whose calls wait for a slot looks again (a slot freed by an earlier batch's call wakes no one)
SLOT_POLL_S = 0.05
#: how the process runner's server learns the trainer's ``__main__`` (set only while the trainer starts the server)
TRAINER_MAIN_ENV = "LIT_GRPO_TOOL_SERVER_MAIN"


def check_tool_runner(runner: object) -> None:
    """Refuse, in one line, a ``multi_turn.tool_runner`` that is not one of :data:`TOOL_RUNNERS`."""
    if not isinstance(runner, str) or runner not in TOOL_RUNNERS:
        raise ValueError(f"multi_turn.tool_runner must be one of {sorted(TOOL_RUNNERS)}, got {runner!r}")


def trainer_main() -> str | None:
    """How a process that multiprocessing starts would run this process's ``__main__`` again: ``name:<module>`` or
    ``path:<file>`` (what it sends each child), ``None`` when it would not."""
    data = multiprocessing.spawn.get_preparation_data("tool")
    if "init_main_from_name" in data:
        return f"name:{data['init_main_from_name']}"
    if "init_main_from_path" in data:
        return f"path:{data['init_main_from_path']}"
    return None


def adopt_trainer_main() -> None:
    """In the process runner's server only (a ``python -c`` process started with :data:`TRAINER_MAIN_ENV`): take the
    trainer's ``__main__`` as the server's own. multiprocessing runs the trainer's script again in each process it
    starts unless that process's ``__main__`` already is the script (the case of a fork, which the calls' processes
    are): a call needs its tool's module only, and running the script's imports (torch, Lightning) in each call
    would cost seconds."""
    spec = os.environ.pop(TRAINER_MAIN_ENV, None)
    main = sys.modules.get("__main__")
    if spec is None or main is None or getattr(main, "__file__", None) or getattr(main, "__spec__", None):
        return  # not a `python -c` process: only the server adopts
    kind, _, value = spec.partition(":")
    if kind == "name":
        main.__spec__ = importlib.machinery.ModuleSpec(value, None)
    elif kind == "path":
        main.__file__ = value


adopt_trainer_main()


def check_not_bootstrapping() -> None:
    """Refuse, in a call's process, the tool box of a script that runs its training again there: Python's
    ``forkserver`` and ``spawn`` run the script run as ``__main__`` in each process they start, so an entry point
    without ``if __name__ == "__main__":`` would train in every call's process (the call then fails in this line)."""
    # the flag multiprocessing itself reads to refuse a process started while the script is being run again
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError("multi_turn.tool_runner 'process' started a tool's process, which ran the script's code "
                           "again and reached the training: guard the script's entry point with "
                           "if __name__ == '__main__': (Python's rule for processes started by forkserver or spawn)")


def process_problem(fn: Callable[..., Any]) -> str | None:
    """Why a process of its own could not run ``fn`` (``None`` when it can): the process imports it by its module
    and qualified name, which must give ``fn`` back."""
    if getattr(fn, "__module__", None) == "__main__":
        return "it is defined in the script run as __main__, which the call's process does not run"
    try:
        same = pickle.loads(pickle.dumps(fn)) is fn
    except Exception as e:  # PicklingError, AttributeError ("Can't pickle local object ...")
        return f"it cannot be imported by its name ({type(e).__name__}: {e})"
    if not same:
        return f"its name {getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')} imports another object"
    return None


def resolve_tool(spec: str | Callable[..., Any]) -> Callable[..., Any]:
    """The function ``spec`` names (an import path), or ``spec`` itself when it is callable."""
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"a tool must be an import path or a function, got {type(spec).__name__}; {EXPECTED_TOOL}")
    return resolve_callable(spec, "tool", EXPECTED_TOOL)


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """transformers' JSON schema of ``fn`` (one line naming the function when it cannot be described)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # DocstringParsingException, TypeHintParsingException
        raise ValueError(f"tool {getattr(fn, '__name__', fn)!r} cannot be described for the chat template: {e}; "
                         f"give it type hints and a docstring with an Args: section") from e


def start_server() -> None:
    """Start the ``forkserver`` server (when this process has none yet) knowing the trainer's ``__main__``, which it
    adopts (:func:`adopt_trainer_main`); a server started earlier by other code is used as it is."""
    main = trainer_main()
    if main is not None:
        os.environ[TRAINER_MAIN_ENV] = main
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.pop(TRAINER_MAIN_ENV, None)


class ToolOutcome:
    """What one call gave: the text for the tool message, whether it failed (raised, timed out, unknown tool, wrong
    arguments) or timed out, and ``fault``: what the tool itself did wrong (it raised or timed out), ``None`` when it
    answered or when the call was the model's mistake."""

    __slots__ = ("text", "failed", "timed_out", "fault")

    def __init__(self, text: str, failed: bool = False, timed_out: bool = False, fault: str | None = None) -> None:
        self.text, self.failed, self.timed_out, self.fault = text, failed, timed_out, fault


def run_tool(fn: Callable[..., Any], arguments: dict[str, Any]) -> tuple[str, str]:
    """``("ok", text)`` of ``fn(**arguments)``'s result as the tool message's text (a string as it is, anything else
    as JSON), or ``("error", "<type>: <message>")`` of what it raised: plain strings, which a process can send."""
    try:
        value = fn(**arguments)
        return "ok", value if isinstance(value, str) else json.dumps(value, default=str)
    except Exception as e:  # noqa: BLE001 (the model sees the error and goes on)
        return "error", f"{type(e).__name__}: {e}"


def run_tool_in_child(send: Any, fn: Callable[..., Any], arguments: dict[str, Any]) -> None:
    """The process runner's child: run the call and send its :func:`run_tool` answer back."""
    send.send(run_tool(fn, arguments))


class ToolBox:
    """The tools of a run, by name: their schemas for the chat template, and their calls, run concurrently with a
    time limit each, on threads or in processes (``runner``, the module's docstring)."""

    def __init__(self, tools: Sequence[str | Callable[..., Any]], timeout_s: float = 10.0,
                 runner: str = "thread") -> None:
        if not timeout_s > 0:
            raise ValueError(f"tool_timeout_s must be > 0, got {timeout_s}")
        check_tool_runner(runner)
        functions = [resolve_tool(t) for t in tools]
        self.schemas = [tool_schema(fn) for fn in functions]
        names = [s["function"]["name"] for s in self.schemas]
        if len(set(names)) != len(names):
            raise ValueError(f"two tools share a name: {names}")
        if runner == "process":
            check_not_bootstrapping()
            for name, fn in zip(names, functions):
                problem = process_problem(fn)
                if problem is not None:
                    raise ValueError(f"tool {name!r} cannot run with multi_turn.tool_runner 'process': {problem}; "
                                     f"expected a module-level function importable by path package.module:function, "
                                     f"or tool_runner 'thread'")
        self.functions = dict(zip(names, functions))
        self.timeout_s = timeout_s
        self.runner = runner
        self.slots = self.new_slots()
        self.warned: set[str] = set()  # the tools whose failure was warned about
        self.context: Any = None  # the process runner's multiprocessing context, made on its first call

    def __bool__(self) -> bool:
        return bool(self.functions)

    def __getstate__(self) -> dict[str, Any]:
        # a copy (a pickled data module) gets slots and a context of its own
        return {k: v for k, v in self.__dict__.items() if k not in ("slots", "context")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, context=None)
        self.slots = self.new_slots()

    def new_slots(self) -> dict[str, threading.BoundedSemaphore]:
        """Each tool's slots: :data:`MAX_CONCURRENT_CALLS` calls of it at once, so a tool that hangs holds its own."""
        return {name: threading.BoundedSemaphore(MAX_CONCURRENT_CALLS) for name in self.functions}

    def call(self, call: ToolCall) -> ToolOutcome:
        """Run ``call``; every failure becomes an error message for the model."""
        return self.call_many([call])[0]

    def call_many(self, calls: Sequence[ToolCall]) -> list[ToolOutcome]:
        """Run ``calls`` at once (at most :data:`MAX_CONCURRENT_CALLS` of each tool at a time), each limited to
        ``timeout_s`` from its start, and return their outcomes in order; a call that finds no free slot within
        ``timeout_s`` is answered with a timeout. Warns once per tool that raises or times out."""
        outcomes: list[ToolOutcome | None] = [self.refusal(call) for call in calls]
        waiting = [i for i, outcome in enumerate(outcomes) if outcome is None]
        finished: queue.SimpleQueue[tuple[int, ToolOutcome]] = queue.SimpleQueue()
        deadlines: dict[int, float] = {}  # the calls running, by index: when they are answered with a timeout
        # a process call times itself out (and is killed); the grace only bounds a stalled start or kill
        grace = PROCESS_GRACE_S if self.runner == "process" else 0.0
        give_up = time.monotonic() + self.timeout_s  # waiting for a slot past it: answered with a timeout
        while waiting or deadlines:
            for index in [i for i in waiting if self.slots[calls[i].name].acquire(blocking=False)]:
                waiting.remove(index)
                deadlines[index] = time.monotonic() + self.timeout_s + grace
                self.start(index, calls[index], finished)
            wake = min([*deadlines.values(), *([give_up, time.monotonic() + SLOT_POLL_S] if waiting else [])])
            try:
                index, outcome = finished.get(timeout=max(0.0, wake - time.monotonic()))
                if deadlines.pop(index, None) is not None:  # else answered already: a late thread's result
                    outcomes[index] = outcome
            except queue.Empty:  # a deadline or the slot poll came first: handled below
                pass
            now = time.monotonic()
            for index in [i for i, deadline in deadlines.items() if now >= deadline]:
                del deadlines[index]
                outcomes[index] = self.timeout(calls[index].name, self.runner_fault())
            if waiting and now >= give_up:
                for index in waiting:
                    outcomes[index] = self.timeout(calls[index].name, f"it found no free slot in that time: "
                                                                      f"{MAX_CONCURRENT_CALLS} calls of it still ran")
                waiting.clear()
        done = [outcome for outcome in outcomes if outcome is not None]
        self.warn_failures(calls, done)
        return done

    def refusal(self, call: ToolCall) -> ToolOutcome | None:
        """The answer to a call that cannot run (an unknown tool, arguments it does not take), ``None`` otherwise."""
        fn = self.functions.get(call.name)
        if fn is None:
            return ToolOutcome(f"Error: unknown tool {call.name!r}; the tools are {sorted(self.functions)}", True)
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as e:
            return ToolOutcome(f"Error: {call.name} does not take these arguments ({e})", True)
        return None

    def start(self, index: int, call: ToolCall, finished: queue.SimpleQueue) -> None:
        """Start ``call`` on a daemon thread that puts ``(index, outcome)`` in ``finished`` and frees its slot when it
        returns (a thread call runs the tool there; a process call waits for its process there)."""
        fn = self.functions[call.name]

        def target() -> None:
            # a tool that ends its thread otherwise than by an Exception (SystemExit) still answers
            outcome = self.broken(call.name, "ended without answering")
            try:
                if self.runner == "process":
                    outcome = self.in_process(call.name, fn, call.arguments)
                else:
                    outcome = self.outcome(call.name, run_tool(fn, call.arguments))
            finally:
                self.slots[call.name].release()
                finished.put((index, outcome))

        threading.Thread(target=target, daemon=True, name=f"tool-{call.name}").start()

    def in_process(self, name: str, fn: Callable[..., Any], arguments: dict[str, Any]) -> ToolOutcome:
        """Run one call in a process of its own, killed when it runs past ``timeout_s``."""
        context = self.process_context()
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=run_tool_in_child, args=(send, fn, arguments), daemon=True,
                                  name=f"tool-{name}")
        try:
            process.start()
        except Exception as e:  # noqa: BLE001 (the model is told; the run goes on)
            receive.close()
            send.close()
            return self.broken(name, f"could not start its process ({type(e).__name__}: {e})")
        send.close()  # the child holds the other copy: its death makes the pipe readable (EOF)
        try:
            if not receive.poll(self.timeout_s):
                return self.timeout(name, "its process was killed")
            try:
                return self.outcome(name, receive.recv())
            except EOFError:
                process.join()
                return self.broken(name, f"ended its process without answering (exit code {process.exitcode})")
        finally:
            if process.is_alive():
                process.kill()
            process.join()
            receive.close()

    def process_context(self) -> Any:
        """The process runner's context: ``forkserver`` (``spawn`` where the platform lacks it), whose server imports
        this module and the tools' once, so that each call's fork has them."""
        if self.context is None:
            method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
            context = multiprocessing.get_context(method)
            if method == "forkserver":  # taken into account only when the server starts (once per process)
                modules = {fn.__module__ for fn in self.functions.values()}
                context.set_forkserver_preload([__name__, *sorted(modules)])
                start_server()
            self.context = context
        return self.context

    def outcome(self, name: str, answer: tuple[str, str]) -> ToolOutcome:
        """The outcome of a call that answered (``run_tool``'s ``(kind, text)``)."""
        kind, text = answer
        if kind == "error":
            return self.broken(name, f"raised {text}")
        return ToolOutcome(text)

    def broken(self, name: str, what: str) -> ToolOutcome:
        """The answer to a call whose tool failed: ``what`` it did (``raised ...``), for the model and the warning."""
        return ToolOutcome(f"Error: {name} {what}", True, fault=f"it {what}")

    def timeout(self, name: str, detail: str) -> ToolOutcome:
        """The answer to a call past its limit; ``detail`` says what became of it (for the warning)."""
        return ToolOutcome(f"Error: {name} timed out after {self.timeout_s:g} s", True, timed_out=True,
                           fault=f"it timed out after {self.timeout_s:g} s; {detail}")

    def runner_fault(self) -> str:
        """What became of a call past its limit, by runner (for the warning)."""
        if self.runner == "thread":
            return "tool_runner 'thread' cannot stop its call, which runs on: tool_runner 'process' kills it"
        return "its process did not end in time"

    def warn_failures(self, calls: Sequence[ToolCall], outcomes: Sequence[ToolOutcome]) -> None:
        """Warn, once per tool, about the first call of it that raised or timed out: a broken tool would otherwise
        show only as ``rollout/tool_errors``. The model's own mistakes (an unknown tool, wrong arguments) are not
        warned about: they are the model's to learn from."""
        for call, outcome in zip(calls, outcomes):
            if outcome.fault is not None and call.name not in self.warned:
                self.warned.add(call.name)
                warnings.warn(f"tool {call.name!r} failed ({outcome.fault}): the model is told the error and its "
                              f"trajectory goes on; counted in rollout/tool_errors (further failures of this tool "
                              f"are counted, not warned)", stacklevel=3)

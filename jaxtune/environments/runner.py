"""Tools run in a child process with a time limit, so a tool the model calls cannot stop the rollout.

`ToolRunner(tools, timeout_s)` starts one worker process (multiprocessing's "spawn": a fresh interpreter, never a fork
of the trainer, whose JAX threads a fork would copy mid-lock) and sends it one call at a time. The reply is always
one string the model reads as the tool's turn:

  the tool's return value     a string as it is, anything else as JSON
  one error line              "error: tool 'NAME' raised ValueError: ...", "... returned a set, which is not
                              JSON-serialisable", "... did not finish within 2s and was stopped", "... process exited
                              with code -11", "error: no tool named 'NAME' (tools: ...)"

A call past the time limit kills the worker (SIGKILL: a tool in C code or `time.sleep` ignores anything gentler) and the
next call starts a fresh one; so does a worker that died. Tools are sent to the worker by reference, so each is a
module-level function (or a "module:function" path) the worker can import.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import pickle
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection

from jaxtune.errors import JaxtuneError


def load_object(path: str, what: str):
    """The object named by a dotted path, "package.module.name" or "package.module:name"; `what` names it in
    errors ("tool", "environment")."""
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise JaxtuneError(f"{what} {path!r}: expected a dotted path such as 'mypackage.tools.search'")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise JaxtuneError(f"{what} {path!r} cannot be imported: {e}") from None


def _one_line(text: object, limit: int = 500) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_tool(function: Callable, name: str, arguments: dict) -> str:
    """One call, in whatever process runs it: the reply string (the result, or one error line)."""
    try:
        result = function(**arguments)
    except Exception as e:  # the tool's own failure is the model's information, not the rollout's
        return f"error: tool {name!r} raised {type(e).__name__}: {_one_line(e)}"
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError):
        return f"error: tool {name!r} returned a {type(result).__name__}, which is not JSON-serialisable"


def _serve(connection: Connection, tools: dict[str, Callable]) -> None:
    """The worker: answer (name, arguments) requests until the parent closes the pipe."""
    while True:
        try:
            name, arguments = connection.recv()
        except (EOFError, OSError):
            return
        connection.send(run_tool(tools[name], name, arguments))


class ToolRunner:
    """Named tools run in a worker process, each call within `timeout_s` seconds. Close it (or use `with`) to stop
    the worker."""

    def __init__(self, tools: Mapping[str, Callable | str] | Sequence[Callable | str], timeout_s: float = 10.0):
        if timeout_s <= 0:
            raise JaxtuneError(f"tool timeout_s = {timeout_s}: must be > 0")
        if not isinstance(tools, Mapping):
            resolved = [load_object(t, "tool") if isinstance(t, str) else t for t in tools]
            tools = {getattr(t, "__name__", str(t)): t for t in resolved}
        self.tools: dict[str, Callable] = {n: load_object(t, "tool") if isinstance(t, str) else t
                                           for n, t in tools.items()}
        for name, function in self.tools.items():
            if not callable(function):
                raise JaxtuneError(f"tool {name!r} is not callable")
            try:
                pickle.dumps(function)
            except Exception as e:  # lambdas, closures, methods of unpicklable objects
                raise JaxtuneError(f"tool {name!r} cannot be sent to the tool process ({type(e).__name__}: {e}); "
                                   "define it at module level") from None
        self.timeout_s = timeout_s
        self._context = multiprocessing.get_context("spawn")
        self._process: multiprocessing.process.BaseProcess | None = None
        self._connection: Connection | None = None

    def _start(self) -> Connection:
        if self._process is None or not self._process.is_alive():
            self._stop()
            ours, theirs = self._context.Pipe()
            self._process = self._context.Process(target=_serve, args=(theirs, self.tools), daemon=True,
                                                  name="jaxtune-tools")
            self._process.start()
            theirs.close()
            self._connection = ours
        assert self._connection is not None
        return self._connection

    def _stop(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
        if self._process is not None:
            if self._process.is_alive():
                self._process.kill()
            self._process.join()
            self._process = None

    def call(self, name: str, arguments: dict) -> str:
        """The reply to one call: the tool's result as a string, or one error line; never raises for the tool's
        sake."""
        if name not in self.tools:
            return f"error: no tool named {name!r} (tools: {', '.join(self.tools) or 'none'})"
        connection = self._start()
        connection.send((name, arguments))
        try:
            if connection.poll(self.timeout_s):
                return connection.recv()
        except (EOFError, OSError):  # the worker died mid-call (os._exit, a crash in C code, out of memory)
            assert self._process is not None
            self._process.join()
            code = self._process.exitcode
            self._stop()
            return f"error: tool {name!r}'s process exited with code {code}"
        self._stop()  # past the limit: killed, the next call starts a fresh worker
        return f"error: tool {name!r} did not finish within {self.timeout_s:g}s and was stopped"

    def close(self) -> None:
        self._stop()

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self._stop()
        except Exception:  # interpreter shutdown
            pass

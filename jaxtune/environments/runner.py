"""Tools run in a child process with a time limit, so no tool the model calls can stop the rollout (`ToolRunner`).

One worker process, spawned (a fresh interpreter: a fork would copy the trainer's JAX threads mid-lock), runs one call
at a time. Every reply is one string the model reads as the tool's turn: the result (a string as is, else JSON) or
one error line naming the tool and what happened (it raised, returned what JSON cannot hold, ran past the limit, its
process died, no such tool). Past the limit the worker is killed (SIGKILL: `time.sleep` or C code ignore gentler
signals) and the next call starts a fresh one. Tools go to the worker by reference: module-level functions.
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
    """The worker: say it is ready (the tools' modules are imported by now), then answer (name, arguments) requests
    until the parent closes the pipe."""
    connection.send("ready")
    while True:
        try:
            name, arguments = connection.recv()
        except (EOFError, OSError):
            return
        connection.send(run_tool(tools[name], name, arguments))


class ToolRunner:
    """Named tools (a mapping, or functions and dotted paths named by their `__name__`) run in a worker process,
    each call within `timeout_s` seconds; the worker's start (importing the tools' modules) has `start_s` of its own.
    Close it (or use `with`) to stop the worker; one `shared_by(n)` users stops it at the n-th close."""

    def __init__(self, tools: Mapping[str, Callable | str] | Sequence[Callable | str], timeout_s: float = 10.0,
                 start_s: float = 120.0):
        if timeout_s <= 0 or start_s <= 0:
            raise JaxtuneError(f"tool timeout_s = {timeout_s}, start_s = {start_s}: both must be > 0")
        if not isinstance(tools, Mapping):
            resolved = [load_object(t, "tool") if isinstance(t, str) else t for t in tools]
            names = [getattr(t, "__name__", str(t)) for t in resolved]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise JaxtuneError(f"two tools named {', '.join(twice)}: name them with a mapping {{name: tool}}")
            tools = dict(zip(names, resolved))
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
        self.timeout_s, self.start_s = timeout_s, start_s
        self._users = 1
        self._context = multiprocessing.get_context("spawn")
        self._process: multiprocessing.process.BaseProcess | None = None
        self._connection: Connection | None = None

    def _start(self) -> Connection | str:
        """The live worker's end of the pipe, a fresh worker started if need be; or the error line why none runs."""
        if self._process is None or not self._process.is_alive():
            self._stop()
            ours, theirs = self._context.Pipe()
            self._process = self._context.Process(target=_serve, args=(theirs, self.tools), daemon=True,
                                                  name="jaxtune-tools")
            try:
                self._process.start()
            except Exception as e:  # noqa: BLE001  e.g. the new interpreter died at once (a broken pipe)
                self._process = None
                ours.close()
                return f"error: the tool process could not start ({type(e).__name__}: {_one_line(e, 200)})"
            finally:
                theirs.close()
            self._connection = ours
            try:
                ready = ours.poll(self.start_s) and ours.recv() == "ready"
            except (EOFError, OSError):  # it died importing a tool's module
                ready = False
            if not ready:
                self._process.join(0.1)
                code = self._process.exitcode
                self._stop()
                return (f"error: the tool process did not start within {self.start_s:g}s" if code is None else
                        f"error: the tool process exited with code {code} as it started")
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
        if isinstance(connection, str):
            return connection
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

    def shared_by(self, users: int) -> ToolRunner:
        """This runner, its worker stopped only when `users` closes have come (one an environment sharing it)."""
        self._users = users
        return self

    def close(self) -> None:
        self._users -= 1
        if self._users <= 0:
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

"""One process with 8 fake CPU devices per test file, serving that file's calls.

XLA fixes the number of host devices when jax is first imported, which a pytest worker has already done, so the
sharded checks run in a worker script under XLA_FLAGS=--xla_force_host_platform_device_count=8. Rather than a new
interpreter for each call (JAX imported, the devices made, the compiled programs read again), a test module holds
one `DeviceWorker` per script and flags, started on its first call and closed with the module:

    worker = DeviceWorker(Path("tests/parallel_worker.py"))
    worker("lora")                  # the script's `dispatch(["lora"])`, its JSON result back

The script's side is `serve(dispatch)`: one JSON list of arguments a line on stdin, one JSON reply a line on stdout
(what the called code prints goes to stderr). `python SCRIPT ARGS...` still runs one call and prints its result.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

EIGHT_DEVICES = "--xla_force_host_platform_device_count=8"
# XLA:CPU's backend optimisation off: the worker's programs are small and compiled once each, which halves compiling
UNOPTIMISED = " --xla_backend_optimization_level=0"


class DeviceWorker:
    """A long-lived `python SCRIPT --serve` on 8 fake CPU devices; calling it runs one request there."""

    def __init__(self, script: Path, optimize: bool = False, timeout: float = 1200):
        self.script, self.timeout = script, timeout
        self.flags = EIGHT_DEVICES + ("" if optimize else UNOPTIMISED)
        self.process: subprocess.Popen | None = None
        self.stderr = tempfile.TemporaryFile(mode="w+")

    def _start(self) -> subprocess.Popen:
        env = {**os.environ, "XLA_FLAGS": self.flags, "JAX_PLATFORMS": "cpu"}
        return subprocess.Popen([sys.executable, str(self.script), "--serve"], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=self.stderr, text=True)

    def _stderr_tail(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-4000:]

    def __call__(self, *args: str) -> dict:
        if self.process is None or self.process.poll() is not None:
            self.process = self._start()
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(list(args)) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], self.timeout)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise AssertionError(f"{self.script.name} {' '.join(args)}: no reply "
                                 f"({'timed out' if not ready else 'the worker exited'})\n{self._stderr_tail()}")
        reply = json.loads(line)
        assert "error" not in reply, f"{self.script.name} {' '.join(args)}:\n{reply['error']}"
        return reply["result"]

    def close(self) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                self.process.stdin.close()
                try:
                    self.process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.process.kill()
            self.process = None


def serve(dispatch: Callable[[list[str]], dict]) -> None:
    """A worker script's main: `--serve` answers requests until stdin closes; otherwise one call of `sys.argv`."""
    if sys.argv[1:] != ["--serve"]:
        print(json.dumps(dispatch(sys.argv[1:])))
        return
    replies, sys.stdout = sys.stdout, sys.stderr
    for line in sys.stdin:
        try:
            reply = {"result": dispatch(json.loads(line))}
        except Exception:  # the test that asked fails with this traceback; the worker serves the next request
            reply = {"error": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()

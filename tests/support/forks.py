"""The preloaded workers the suite's own worker processes come from (``conftest.FORKS``)."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import threading

from benchbackend.backends.probe import worker_command
from benchbackend.run.preload import Preloaders, key


class Forks:
    """The preloaded workers the suite's own worker processes come from, as a run's do
    (``preload.Preloaders``): a framework is imported once per (interpreter, adapter module, environment)
    and each worker is forked from it, where a fresh ``python -m benchbackend.run.worker`` imported
    it every time (119 of the 217 core-seconds the suite's directly started workers used). The six
    most recently used preloaders are kept (a test's own environment makes one of its own)."""

    MOST = 6

    def __init__(self) -> None:
        self._kept: dict[tuple, object] = {}

    def start(self, python: str, env, target: str, stderr, timeout):
        env = {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}  # pytest's, a new value each test
        served = key(str(python), env, target)
        kept = self._kept.pop(served, None) or Preloaders()
        self._kept[served] = kept  # the most recent last
        while len(self._kept) > self.MOST:
            self._kept.pop(next(iter(self._kept))).close()
        return kept.start(str(python), env, target, stderr, timeout)

    def run(self, python, env, job, timeout: float = 900):
        """One worker with ``job`` on its stdin, as ``subprocess.run([python, "-m",
        "benchbackend.run.worker"], input=..., capture_output=True, text=True)`` runs it, and its
        ``CompletedProcess``. Killed (its process group) after ``timeout`` seconds."""
        with tempfile.TemporaryFile("w+") as err:
            try:
                proc = self.start(str(python), dict(env), job.target, err, timeout)
            except OSError:  # no preloader for this interpreter: a fresh one
                return subprocess.run(worker_command(str(python)), input=job.to_json(), text=True,
                                      capture_output=True, timeout=timeout, env=dict(env))
            watchdog = threading.Timer(timeout, _kill_group, (proc.pid,))
            watchdog.start()
            try:
                proc.stdin.write(job.to_json())
                proc.stdin.close()
                out = proc.stdout.read()
                code = proc.wait()
            finally:
                watchdog.cancel()
                proc.stdout.close()
            err.seek(0)
            return subprocess.CompletedProcess(worker_command(str(python)), code, out, err.read())

    def close(self) -> None:
        for kept in self._kept.values():
            kept.close()
        self._kept.clear()


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # it ended as the time ran out
        os.killpg(pid, signal.SIGKILL)

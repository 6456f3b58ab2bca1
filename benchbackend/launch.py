"""Start one worker process and stream its messages: the one launcher every executor uses.

``run_worker`` spawns ``python -m benchbackend.worker`` in the given interpreter and environment,
sends the JSON job on stdin, hands each JSON line it prints to ``on_message`` as it arrives,
calls ``on_wait`` every ``heartbeat_s`` seconds of silence, kills the process group past
``timeout``, and keeps the tail of its stderr. Ctrl-C kills the worker and propagates. It knows
nothing about backends, rows or CSVs: the local executor and the Ray executor build on it.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from .errors import BackendUnavailable

HEARTBEAT_S = 30.0
Message = dict[str, Any]


@dataclass
class Outcome:
    """How a worker ended. ``status`` is ``done``, ``unavailable``, ``timeout`` or ``crashed``."""

    status: str
    message: str = ""
    returncode: Optional[int] = None


def tail(text: str, lines: int = 6, chars: int = 600) -> str:
    kept = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(kept[-lines:])[-chars:]


def worker_command(python: str) -> list[str]:
    return [python, "-m", "benchbackend.worker"]


def run_worker(python: str, env: Mapping[str, str], job: Mapping[str, Any], on_message: Callable[[Message], None],
               timeout: Optional[float] = None, on_wait: Callable[[float], None] = lambda s: None,
               heartbeat_s: float = HEARTBEAT_S) -> Outcome:
    """Run one worker to its end; see the module docstring."""
    with tempfile.TemporaryFile("w+") as err:
        try:
            proc = subprocess.Popen(worker_command(python), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=err, text=True, env=dict(env, PYTHONUNBUFFERED="1"),
                                    start_new_session=True)
        except OSError as exc:
            return Outcome("crashed", f"cannot start worker: {exc}")
        assert proc.stdin and proc.stdout
        try:
            proc.stdin.write(json.dumps(job))
            proc.stdin.close()
        except BrokenPipeError:
            pass  # the worker died before reading its job: its exit code and stderr say why
        lines: "queue.Queue[Optional[str]]" = queue.Queue()
        stdout = proc.stdout

        def reader() -> None:
            for line in stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=reader, daemon=True).start()
        try:
            ended, error, unavailable = _pump(lines, proc, on_message, timeout, on_wait, heartbeat_s)
        except BaseException:  # Ctrl-C (or the caller's own failure): never leave the worker behind
            kill(proc)
            raise

        def stderr_tail() -> str:
            err.seek(0)
            text = tail(err.read())
            return f"; stderr: {text}" if text else ""

        if unavailable is not None:
            return Outcome("unavailable", unavailable, proc.returncode)
        if not ended:
            return Outcome("timeout", f"worker ran past --timeout {timeout:g}s" + stderr_tail(), None)
        if error is not None or proc.returncode != 0:
            what = error or f"worker exited with code {proc.returncode}"
            return Outcome("crashed", what + stderr_tail(), proc.returncode)
        return Outcome("done", "", 0)


def _pump(lines: "queue.Queue[Optional[str]]", proc: subprocess.Popen, on_message: Callable[[Message], None],
          timeout: Optional[float], on_wait: Callable[[float], None],
          heartbeat_s: float) -> tuple[bool, Optional[str], Optional[str]]:
    """Read messages until the worker exits: (ended in time, error message, unavailable message)."""
    start = time.monotonic()
    error: Optional[str] = None
    unavailable: Optional[str] = None
    while True:
        remaining = None if timeout is None else timeout - (time.monotonic() - start)
        if remaining is not None and remaining <= 0:
            kill(proc)
            return False, error, unavailable
        try:
            line = lines.get(timeout=heartbeat_s if remaining is None else min(heartbeat_s, remaining))
        except queue.Empty:
            on_wait(time.monotonic() - start)
            continue
        if line is None:
            proc.wait()
            return True, error, unavailable
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue  # not protocol output; the worker keeps stdout clean, so ignore strays
        if not isinstance(msg, dict):
            continue
        kind = msg.get("type")
        if kind == "error":
            tb = tail(msg.get("traceback", ""), lines=3)
            error = f"{msg.get('message', 'error')} ({tb})" if tb else msg.get("message", "error")
        elif kind == "unavailable":
            unavailable = msg.get("message", "")
        on_message(msg)


def kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def probe_in(python: str, backend: str, env: Mapping[str, str], timeout: float) -> dict[str, Any]:
    """Run ``python -m benchbackend.worker --probe BACKEND``: ``{"version", "devices"}``.

    Raises ``BackendUnavailable`` with one line saying why (the worker's own error, the last
    stderr line, or the exit status) when the probe cannot run or fails.
    """
    try:
        proc = subprocess.run([*worker_command(python), "--probe", backend], env=dict(env),
                              capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BackendUnavailable(f"could not run: {str(exc).splitlines()[0]}") from None
    error = ""
    for line in proc.stdout.splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if proc.returncode == 0 and isinstance(msg, dict) and "devices" in msg:
            return msg
        error = (msg.get("message", "") if isinstance(msg, dict) else "") or error
    stderr = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    raise BackendUnavailable(error or (stderr[-1].strip() if stderr else f"exit status {proc.returncode}"))

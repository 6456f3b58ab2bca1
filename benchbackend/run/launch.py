"""One worker process: the typed job it runs, the interpreter and environment it runs in, its messages.

``Job`` is the record the parent sends and the worker reads (JSON on stdin), the one description
of a cell's work. ``python_for`` and ``worker_environ`` say how a backend's worker is started.
``stream`` spawns ``python -m benchbackend.run.worker`` (or has a ``preload.Preloaders`` fork one),
sends the job, and yields the worker's messages as they arrive (``messages.Info``, ``Peak``,
``Row``; a ``Heartbeat`` every ``heartbeat_s`` of silence); it returns the ``Outcome`` when the
worker ends. It kills the worker's process group past ``timeout``, when the consumer stops early
(Ctrl-C), and keeps the tail of its stderr. It knows nothing about rows' meaning or CSVs: both executors build on it.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import IO, TYPE_CHECKING, Any, Generator, Mapping, Optional, Protocol

from ..backends.probe import worker_command
from ..backends.spec import BackendSpec, Capabilities
from ..paths import PACKAGE_PARENT
from . import machine
from .messages import Heartbeat, Info, Message, Outcome, Peak, Row
from .plan import Options

if TYPE_CHECKING:
    from ..spec.workload import Workload
    from .plan import Cell

__all__ = ["HEARTBEAT_S", "THREAD_VARS", "Job", "Options", "python_for", "stream", "worker_environ"]

HEARTBEAT_S = 30.0
#: Thread-count variables every worker gets from ``--threads`` (OpenMP, MKL, OpenBLAS, TensorFlow).
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
               "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")


@dataclass(frozen=True)
class Job:
    """One repeat of one cell, as the worker runs it. ``data`` is the path of the run's arrays
    (``arrays.prepare``) on the machine that runs the worker."""

    workload: "Workload"
    backend: str
    target: str  # "package.module:ClassName" of the adapter
    mode: str
    precision: str
    device: str = "cpu"
    repeat: int = 1
    data: str = ""
    trains: bool = True
    parity_steps: int = 0
    #: ``--generate``: greedy decoding with a key/value cache instead of training and inference.
    generate: bool = False
    options: Options = field(default_factory=Options)
    capabilities: Capabilities = field(default_factory=Capabilities)

    @classmethod
    def for_spec(cls, spec: BackendSpec, workload: "Workload", **fields: Any) -> "Job":
        """The job of one repeat of ``spec`` on ``workload``; ``mode`` defaults to the spec's first.
        More than one replica (``options.replicas``) runs the spec's data-parallel adapter."""
        fields.setdefault("mode", spec.default_mode)
        fields.setdefault("precision", "fp32")
        fields["trains"] = spec.trains and fields.get("trains", True)
        many = fields.get("options", Options()).replicas > 1 and spec.capabilities.replicas
        return cls(workload=workload, backend=spec.name, target=spec.capabilities.replicas if many else spec.target,
                   capabilities=spec.capabilities, **fields)

    def to_json(self) -> str:
        body = {**{f: getattr(self, f) for f in self.__dataclass_fields__}, "workload": self.workload.to_dict(),
                "options": asdict(self.options), "capabilities": asdict(self.capabilities)}
        return json.dumps(body)

    @classmethod
    def from_json(cls, text: str) -> "Job":
        from ..spec.workload import Workload

        raw = json.loads(text)
        return cls(**{**raw, "workload": Workload.model_validate(raw["workload"]),
                      "options": Options(**raw.get("options", {})),
                      "capabilities": Capabilities(**raw.get("capabilities", {}))})

    def with_data(self, path: str) -> "Job":
        return replace(self, data=path)

    def with_threads(self, threads: Optional[int]) -> "Job":
        return replace(self, options=replace(self.options, threads=threads))


def python_for(spec: BackendSpec) -> str:
    """The interpreter of ``spec``'s workers: a configured one, its isolated environment's, or this one."""
    if spec.python:
        return spec.python
    if spec.isolated_env:
        from ..backends import envs

        return str(envs.python_for(spec.isolated_env))
    return sys.executable


def worker_environ(spec: BackendSpec, device: str = "cpu", threads: Optional[int] = None) -> dict[str, str]:
    """The worker's environment: the backend's variables set unconditionally (a user's exported
    ``KERAS_BACKEND`` cannot pick another framework), thread counts, and a PYTHONPATH that shows
    an isolated env nothing of the main env's packages."""
    if spec.isolated_env:
        from ..backends import envs

        env = envs.worker_env()
    else:
        path = os.pathsep.join(filter(None, [str(PACKAGE_PARENT), os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, PYTHONPATH=path)
    if threads:
        env.update({var: str(threads) for var in THREAD_VARS})
    env.update(spec.env(device))
    env[machine.DRIVER_ENV] = str(os.getpid())  # this run's processes are not another's load (machine.py)
    return env


def tail(text: str, lines: int = 6, chars: int = 600) -> str:
    kept = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(kept[-lines:])[-chars:]


class Forker(Protocol):
    """What forks a worker instead of starting an interpreter (``preload.Preloaders``; named here,
    not imported, because the forked child runs ``worker``, which imports this module)."""

    def start(self, python: str, env: Mapping[str, str], target: str, stderr: IO[str],
              timeout: Optional[float]) -> Any: ...


def stream(cell: "Cell", python: str, env: Mapping[str, str], job: Job, timeout: Optional[float] = None,
           heartbeat_s: float = HEARTBEAT_S, preloaders: Optional[Forker] = None,
           ) -> Generator[Message, None, Outcome]:
    """Run one worker to its end, yielding its messages; see the module docstring. With
    ``preloaders``, the worker is forked from a process that has imported the backend already."""
    env = dict(env, PYTHONUNBUFFERED="1")
    with tempfile.TemporaryFile("w+") as err:
        proc: Any = None
        if preloaders is not None:
            try:
                proc = preloaders.start(python, env, job.target, err, timeout)
            except TimeoutError:
                return Outcome("timeout", f"worker ran past --timeout {timeout:g}s while its backend imported", None)
            except OSError:
                pass  # no usable preloader for this interpreter: a fresh one, as --no-preload
        try:
            if proc is None:
                proc = subprocess.Popen(worker_command(python), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=err, text=True, env=env, start_new_session=True)
        except OSError as exc:
            return Outcome("crashed", f"cannot start worker: {exc}")
        try:
            state = yield from _pump(cell, proc, job, timeout, heartbeat_s)
        finally:  # Ctrl-C, or a consumer that stopped early: never leave the worker behind
            kill(proc)
        return state.outcome(proc.returncode, timeout, _stderr_tail(err))


def _stderr_tail(err: Any) -> str:
    err.seek(0)
    text = tail(err.read())
    return f"; stderr: {text}" if text else ""


@dataclass
class _State:
    """What the worker said about its own end."""

    ended: bool = False
    error: Optional[str] = None
    unavailable: Optional[str] = None
    #: The last row the worker sent ("inference pass 1"): a timeout happened in the work after it.
    last: str = ""

    def outcome(self, returncode: Optional[int], timeout: Optional[float], stderr: str) -> Outcome:
        if self.unavailable is not None:
            return Outcome("unavailable", self.unavailable, returncode)
        if not self.ended:  # stderr's tail is a killed worker's last words, rarely the reason: the place comes first
            after = f" (after its {self.last} row)" if self.last else " (before its first row)"
            return Outcome("timeout", f"worker ran past --timeout {timeout:g}s{after}" + stderr, None)
        if self.error is not None or returncode != 0:
            return Outcome("crashed", (self.error or f"worker exited with code {returncode}") + stderr, returncode)
        return Outcome("done", "", 0)


def _lines(proc: Any, job: Job) -> "queue.Queue[Optional[str]]":
    """Send the job; a thread puts each stdout line on the queue, then None at the end."""
    assert proc.stdin and proc.stdout
    try:
        proc.stdin.write(job.to_json())
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
    return lines


def _pump(cell: "Cell", proc: Any, job: Job, timeout: Optional[float],
          heartbeat_s: float) -> Generator[Message, None, _State]:
    lines = _lines(proc, job)
    state = _State()
    start = time.monotonic()
    while True:
        remaining = None if timeout is None else timeout - (time.monotonic() - start)
        if remaining is not None and remaining <= 0:
            return state
        try:
            line = lines.get(timeout=heartbeat_s if remaining is None else min(heartbeat_s, remaining))
        except queue.Empty:
            yield Heartbeat(cell, time.monotonic() - start)
            continue
        if line is None:
            proc.wait()
            state.ended = True
            return state
        message = _parse(cell, line, state)
        if message is not None:
            yield message


def _parse(cell: "Cell", line: str, state: _State) -> Optional[Message]:
    """One protocol line as a message; ``error`` and ``unavailable`` lines set ``state`` instead."""
    try:
        msg = json.loads(line)
    except json.JSONDecodeError:
        return None  # not protocol output; the worker keeps stdout clean, so ignore strays
    if not isinstance(msg, dict):
        return None
    kind = msg.pop("type", None)
    if kind == "row":
        state.last = " ".join([str(msg.get("phase", "")), *(f"{k} {msg[k]}" for k in ("epoch", "pass") if msg.get(k))])
        return Row(cell, msg)
    if kind == "info":
        return Info(cell, backend_version=str(msg.get("backend_version", "")), device=str(msg.get("device", "")),
                    gpu=str(msg.get("gpu", "")), python=str(msg.get("python", "")), threads=msg.get("threads"),
                    math_mode=str(msg.get("math_mode", "")),
                    data_on_device=None if msg.get("data_on_device") is None else bool(msg["data_on_device"]),
                    compile_cache=str(msg.get("compile_cache") or ""),
                    compile_cache_hit=None if msg.get("compile_cache_hit") is None else bool(msg["compile_cache_hit"]),
                    machine={k: v for k, v in (msg.get("machine") or {}).items() if k in machine.CELL_COLUMNS},
                    environment={k: str(msg[k]) for k in ("host", "os", "cpu") if msg.get(k)})
    if kind == "peak":
        return Peak(cell, float(msg["flops"]), str(msg.get("source", "")), str(msg.get("cache_key", "")))
    if kind == "error":
        tb = tail(msg.get("traceback", ""), lines=3)
        state.error = f"{msg.get('message', 'error')} ({tb})" if tb else msg.get("message", "error")
    elif kind == "unavailable":
        state.unavailable = msg.get("message", "")
    return None


def kill(proc: Any) -> None:
    """Kill the worker's process group (a ``subprocess.Popen`` or a ``preload.Forked``) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()

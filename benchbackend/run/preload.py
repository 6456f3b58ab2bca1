"""Workers forked from a process that has already imported the backend: a fresh process per
repeat, without paying the framework's import in every one.

A cell's worker spent 1.2 s (torch) to 3.2 s (TensorFlow) starting Python and importing its
framework, before anything was timed: a third of the quick start's wall time. The cells of a
backend run in the same interpreter and environment, so one *preloader* per (interpreter,
environment, adapter module) imports the adapter once and forks a worker for each repeat. Each
worker is still a new process: its own PID and process group, nothing executed in the framework
before the fork (import only: no graph, no kernel, no thread pool of the framework's), the job on
its own stdin, its protocol on its own stdout, exactly as ``python -m benchbackend.run.worker``.

Protocol, over a Unix socket pair: the parent sends ``run`` with the worker's stdin, stdout and
stderr descriptors; the preloader forks, answers ``pid N`` once the worker leads its own process
group (so that the parent's kill of that group always reaches it), waits for the worker, and answers
``exit N CODE``. One worker at a time per preloader. The preloader exits when the parent's end
closes (the parent ended, even by SIGKILL), killing the worker it was running, if any.

``python -m benchbackend.run.preload SOCKET_FD MODULE:CLASS`` is the preloader. Only for CPU cells:
forking after a GPU runtime has loaded is not safe in every framework, so GPU cells start fresh.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import IO, Mapping, Optional

#: Seconds the parent waits for a preloader's answer before it counts the start as failed.
START_GRACE_S = 600.0


class Forked:
    """The parent's handle on one forked worker; the ``subprocess.Popen`` surface ``launch.stream``
    uses (``pid``, ``stdin``, ``stdout``, ``wait``, ``returncode``)."""

    def __init__(self, server: "Preloader", pid: int, stdin: IO[str], stdout: IO[str]):
        self.server, self.pid, self.stdin, self.stdout = server, pid, stdin, stdout
        self.returncode: Optional[int] = None

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid)
        return self.returncode


class Preloader:
    """One preloader process for one (interpreter, environment, adapter module); forks a worker per ``start``."""

    def __init__(self, python: str, env: Mapping[str, str], target: str):
        self.sock, theirs = socket.socketpair()
        self.proc = subprocess.Popen([python, "-m", "benchbackend.run.preload", str(theirs.fileno()), target],
                                     pass_fds=[theirs.fileno()], env=dict(env), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self._buffer = b""
        self.running: Optional[int] = None  # the worker forked last, until its exit is read

    def alive(self) -> bool:
        return self.proc.poll() is None

    def start(self, stderr: IO[str], timeout: Optional[float]) -> Forked:
        """Fork a worker; raises ``OSError`` when the preloader is gone, ``TimeoutError`` when it does
        not answer in time (an import that hangs)."""
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        try:
            socket.send_fds(self.sock, [b"run"], [in_r, out_w, stderr.fileno()])
        finally:
            os.close(in_r)
            os.close(out_w)
        try:
            pid = int(self._answer("pid", timeout)[0])
        except BaseException:
            os.close(in_w)
            os.close(out_r)
            raise
        self.running = pid
        return Forked(self, pid, os.fdopen(in_w, "w"), os.fdopen(out_r, "r"))

    def exit_code(self, pid: int) -> int:
        try:
            got, code = self._answer("exit", None)
        except OSError:
            return -signal.SIGKILL  # the preloader died with its worker
        assert int(got) == pid, (got, pid)
        self.running = None
        return int(code)

    def _answer(self, kind: str, timeout: Optional[float]) -> list[str]:
        self.sock.settimeout(timeout if timeout is not None else START_GRACE_S if kind == "pid" else None)
        while b"\n" not in self._buffer:
            try:
                chunk = self.sock.recv(256)
            except socket.timeout:
                self.close()
                raise TimeoutError(f"the {kind} answer did not come") from None
            if not chunk:
                raise OSError("the preloader exited")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        head, *rest = line.decode().split()
        if head != kind:
            raise OSError(f"preloader protocol: expected {kind}, got {line!r}")
        return rest

    def close(self) -> None:
        """Kill the preloader and the worker it runs, if any (that worker leads a session of its own,
        out of the preloader's group: killed with the preloader alone, it ran on as an orphan)."""
        self.sock.close()
        for group in (self.running, self.proc.pid):
            if group is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(group, signal.SIGKILL)
        self.running = None
        self.proc.wait()


def key(python: str, env: Mapping[str, str], target: str) -> tuple:
    """What one preloader serves: an interpreter, an environment and the adapter's *module*. A
    preloader only imports (``main``) and each worker loads its own job's class, so the adapters of
    one module (a framework's classes, a test's planted variants of one) share one import."""
    return python, target.partition(":")[0], tuple(sorted(env.items()))


class Preloaders:
    """The run's preloaders, started on first use, one per (interpreter, environment, adapter
    module: :func:`key`); ``close()`` (or leaving the ``with``) kills them."""

    def __init__(self) -> None:
        self._servers: dict[tuple, Preloader] = {}
        self._broken: set[tuple] = set()

    def __enter__(self) -> "Preloaders":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, python: str, env: Mapping[str, str], target: str, stderr: IO[str],
              timeout: Optional[float]) -> Forked:
        """A forked worker; ``OSError`` when this interpreter has no working preloader (the caller
        then starts a fresh interpreter), ``TimeoutError`` when the preloader's import hangs."""
        served = key(python, env, target)
        if served in self._broken:
            raise OSError("this interpreter has no working preloader")
        server = self._servers.get(served)
        if server is None or not server.alive():
            server = self._servers[served] = Preloader(python, env, target)
        try:
            return server.start(stderr, timeout)
        except TimeoutError:
            raise
        except OSError:
            # It died before forking (not a Python that runs benchbackend.run.preload, a crash on
            # import): the caller starts a fresh interpreter, here and for the rest of the run.
            self._broken.add(served)
            server.close()
            raise

    def close(self) -> None:
        for server in self._servers.values():
            server.close()
        self._servers.clear()


def serve(sock: socket.socket) -> None:
    """The preloader's loop: a fork per request, one at a time, until the parent's end closes."""
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, 16, 3)
        except OSError:
            return
        if not message:
            return
        ready_r, ready_w = os.pipe()
        me = os.getpid()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            _worker(sock, fds, ready_w, me)
        os.close(ready_w)
        for fd in fds:
            os.close(fd)
        # The PID goes out only once the worker leads its own process group (or died trying): a
        # parent that kills it at once (Ctrl-C) must find the group, or it waits for its exit forever.
        os.read(ready_r, 1)
        os.close(ready_r)
        sock.sendall(f"pid {pid}\n".encode())
        status = _wait(sock, pid)
        if status is None:  # the parent is gone: so are its worker and this preloader
            return
        sock.sendall(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n".encode())


def _wait(sock: socket.socket, pid: int) -> Optional[int]:
    """The worker's wait status; or, when the parent's end closes first (the parent was killed, even
    by SIGKILL, while the worker ran), None after killing the worker's process group. A worker left
    to run on was an orphan computing for no one: after the Ray tests that remove a node, such
    workers and their preloaders stayed until their work ended."""
    watch = select.poll()
    watch.register(sock, select.POLLIN | select.POLLHUP)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if watch.poll(200):
            try:
                gone = sock.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                gone = True
            if gone:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return None
            time.sleep(0.2)  # a request while a worker runs is not in the protocol: leave it, wait on


def _die_with(parent: int) -> None:
    """Linux: SIGKILL this process when ``parent`` (the preloader, single-threaded) dies. Ray kills a
    worker's child processes when its node goes, the preloader among them, and a forked worker, in
    a session of its own, ran on as an orphan (the Ray node-removal tests left such workers
    sleeping); its exit is read as ``-SIGKILL`` ("the preloader died with its worker") either way."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: the worker outlives a killed preloader
    if os.getppid() != parent:  # the preloader died before the line above
        os._exit(1)


def _worker(sock: socket.socket, fds: list[int], ready: int, preloader: int) -> None:
    """In the forked child: become ``python -m benchbackend.run.worker`` on the given descriptors;
    ``ready`` is closed once it leads its own session and process group."""
    code = 1
    try:
        sock.close()
        _die_with(preloader)
        os.setsid()  # its own process group, which the parent kills on timeout or Ctrl-C
        os.close(ready)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        from . import worker

        code = worker.main([])
    finally:
        sys.stderr.flush()
        os._exit(code)


def main(argv: list[str]) -> None:
    sock = socket.socket(fileno=int(argv[0]))
    try:  # best effort: a backend that fails to import says so from the worker, as it would unforked
        from ..backends.spec import load_class

        load_class(argv[1])
    except Exception:  # noqa: BLE001 - any failure is the worker's to report
        pass
    serve(sock)


if __name__ == "__main__":
    main(sys.argv[1:])

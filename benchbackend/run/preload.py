"""Workers forked from a process that has already imported the backend: a fresh process per
repeat, without paying the framework's import in every one.

A cell's worker spent 1.2 s (torch) to 3.2 s (TensorFlow) starting Python and importing its
framework, before anything was timed: a third of the quick start's wall time. The cells of a
backend run in the same interpreter and environment, so one *preloader* per (interpreter,
environment) imports the adapter once and forks a worker for each repeat. Each worker is still a new
process: its own PID and process group, nothing executed in the framework before the fork (import
only: no graph, no kernel, no thread pool of the framework's), the job on its own stdin, its
protocol on its own stdout, exactly as ``python -m benchbackend.run.worker``.

Protocol, over a Unix socket pair: the parent sends ``run`` with the worker's stdin, stdout and
stderr descriptors; the preloader forks, answers ``pid N`` once the worker leads its own process
group (so that the parent's kill of that group always reaches it), waits for the worker, and answers
``exit N CODE``. One worker at a time per preloader. The preloader exits when the parent's end
closes (the parent ended, even by SIGKILL).

``python -m benchbackend.run.preload SOCKET_FD MODULE:CLASS`` is the preloader. Only for CPU cells:
forking after a GPU runtime has loaded is not safe in every framework, so GPU cells start fresh.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
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
    """One preloader process for one (interpreter, environment); forks a worker per ``start``."""

    def __init__(self, python: str, env: Mapping[str, str], target: str):
        self.sock, theirs = socket.socketpair()
        self.proc = subprocess.Popen([python, "-m", "benchbackend.run.preload", str(theirs.fileno()), target],
                                     pass_fds=[theirs.fileno()], env=dict(env), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self._buffer = b""

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
        return Forked(self, pid, os.fdopen(in_w, "w"), os.fdopen(out_r, "r"))

    def exit_code(self, pid: int) -> int:
        try:
            got, code = self._answer("exit", None)
        except OSError:
            return -signal.SIGKILL  # the preloader died with its worker
        assert int(got) == pid, (got, pid)
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
        self.sock.close()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()


class Preloaders:
    """The run's preloaders, started on first use, one per (interpreter, environment); ``close()``
    (or leaving the ``with``) kills them."""

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
        key = (python, target, tuple(sorted(env.items())))
        if key in self._broken:
            raise OSError("this interpreter has no working preloader")
        server = self._servers.get(key)
        if server is None or not server.alive():
            server = self._servers[key] = Preloader(python, env, target)
        try:
            return server.start(stderr, timeout)
        except TimeoutError:
            raise
        except OSError:
            # It died before forking (not a Python that runs benchbackend.run.preload, a crash on
            # import): the caller starts a fresh interpreter, here and for the rest of the run.
            self._broken.add(key)
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
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            _worker(sock, fds, ready_w)
        os.close(ready_w)
        for fd in fds:
            os.close(fd)
        # The PID goes out only once the worker leads its own process group (or died trying): a
        # parent that kills it at once (Ctrl-C) must find the group, or it waits for its exit forever.
        os.read(ready_r, 1)
        os.close(ready_r)
        sock.sendall(f"pid {pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        sock.sendall(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n".encode())


def _worker(sock: socket.socket, fds: list[int], ready: int) -> None:
    """In the forked child: become ``python -m benchbackend.run.worker`` on the given descriptors;
    ``ready`` is closed once it leads its own session and process group."""
    code = 1
    try:
        sock.close()
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

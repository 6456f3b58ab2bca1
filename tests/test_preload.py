"""Workers forked from a preloader (``preload.py``): the backend is imported once per run, each
repeat is still its own process with its own result, and no preloader outlives its run."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from benchbackend.backends import registry as backends
from benchbackend.run import launch, plan
from benchbackend.run.preload import Preloader, Preloaders
from benchbackend.spec import workload as W
from conftest import make_job

#: An adapter that logs its module's import (PID per line) and the PID each cell built in.
PLUGIN = '''
import os
from benchbackend.backends.numpy.reference import NumpyBackend

LOG = os.environ["PRELOAD_TEST_LOG"]
with open(LOG, "a") as f:
    f.write(f"import {os.getpid()}\\n")


class Logged(NumpyBackend):
    def build(self, weights):
        with open(LOG, "a") as f:
            f.write(f"build {os.getpid()}\\n")
        return super().build(weights)


class Sibling(Logged):
    def build(self, weights):
        with open(LOG, "a") as f:
            f.write(f"sibling {os.getpid()}\\n")
        return super().build(weights)
'''


def _run_repeats(tmp_path: Path, preloaders: Preloaders | None, repeats: int = 2,
                 target: str = "preload_plugin:Logged") -> list[tuple[str, int]]:
    (tmp_path / "preload_plugin.py").write_text(PLUGIN)
    log = tmp_path / "log.txt"
    w = W.load("mnist").with_overrides(limit=64, epochs=1)
    spec = backends.get("numpy")
    env = launch.worker_environ(spec)
    env.update(PRELOAD_TEST_LOG=str(log), PYTHONPATH=os.pathsep.join([str(tmp_path), env["PYTHONPATH"]]))
    for repeat in range(1, repeats + 1):
        job = make_job(tmp_path, w, "numpy", target=target, repeat=repeat)
        cell = plan.Cell(w, plan.Choice("numpy", job.mode, job.precision), repeat, 1, 0)
        messages = launch.stream(cell, launch.python_for(spec), env, job, 120, preloaders=preloaders)
        rows = []
        while True:
            try:
                rows.append(next(messages))
            except StopIteration as stop:
                assert stop.value.status == "done", stop.value
                break
        assert any(getattr(m, "fields", {}).get("phase") == "inference" for m in rows)
    return [(kind, int(pid)) for kind, pid in (line.split() for line in log.read_text().splitlines())]


def test_preloaded_workers_import_once_and_each_repeat_is_its_own_process(tmp_path: Path) -> None:
    with Preloaders() as preloaders:
        log = _run_repeats(tmp_path, preloaders, repeats=3)
    imports = [pid for kind, pid in log if kind == "import"]
    builds = [pid for kind, pid in log if kind == "build"]
    assert len(imports) == 1, "the adapter (and so the framework) imported once, in the preloader"
    assert len(builds) == 3 and len(set(builds)) == 3, "a new process per repeat"
    assert imports[0] not in builds and os.getpid() not in builds


def test_the_adapters_of_one_module_share_its_preloader_and_each_worker_runs_its_own(tmp_path: Path) -> None:
    with Preloaders() as preloaders:
        _run_repeats(tmp_path, preloaders, repeats=1)
        log = _run_repeats(tmp_path, preloaders, repeats=1, target="preload_plugin:Sibling")
        assert len(preloaders._servers) == 1
    assert [kind for kind, _ in log] == ["import", "build", "sibling", "build"]
    first, sibling = log[1][1], log[2][1]
    assert len({log[0][1], first, sibling}) == 3, "one preloader, a process per cell"


def test_without_preload_every_repeat_imports_in_its_own_interpreter(tmp_path: Path) -> None:
    log = _run_repeats(tmp_path, None)
    imports = [pid for kind, pid in log if kind == "import"]
    assert imports == [pid for kind, pid in log if kind == "build"] and len(set(imports)) == 2


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_preloaders_are_killed_when_the_run_ends(tmp_path: Path) -> None:
    with Preloaders() as preloaders:
        _run_repeats(tmp_path, preloaders, repeats=1)
        (server,) = preloaders._servers.values()
        pid = server.proc.pid
        assert server.alive()
    assert server.proc.returncode is not None and _gone(pid)


def test_a_preloader_exits_when_its_parent_goes(tmp_path: Path) -> None:
    # The parent's end of the socket closes when the parent dies, even by SIGKILL.
    server = Preloader(launch.python_for(backends.get("numpy")), launch.worker_environ(backends.get("numpy")),
                       "benchbackend.backends.numpy.reference:NumpyBackend")
    server.sock.close()
    assert server.proc.wait(timeout=30) == 0


def test_a_parent_gone_while_its_worker_runs_takes_the_worker_and_the_preloader_with_it(tmp_path: Path) -> None:
    """The parent killed (SIGKILL, a Ray node removed) while a forked worker runs: the preloader used
    to wait for that worker (a cell's whole run) before it saw its parent gone, and both stayed as
    orphans. Here the worker waits for a job that never comes; the parent's end closes."""
    import tempfile

    server = Preloader(launch.python_for(backends.get("numpy")), launch.worker_environ(backends.get("numpy")),
                       "benchbackend.backends.numpy.reference:NumpyBackend")
    with tempfile.TemporaryFile("w") as err:
        worker = server.start(err, 60)
        os.kill(worker.pid, 0)  # running (it waits for its job)
        server.sock.close()  # as a SIGKILLed parent's end closes
        assert server.proc.wait(timeout=30) == 0
        assert _gone(worker.pid, 30), "the worker outlived its parent"
        worker.stdin.close()
        worker.stdout.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_dies_with_its_preloader(tmp_path: Path) -> None:
    """Ray kills a worker's children when its node goes: the preloader, but not the worker it forked
    (a session of its own), which slept on as an orphan after the node-removal tests."""
    import signal
    import tempfile

    server = Preloader(launch.python_for(backends.get("numpy")), launch.worker_environ(backends.get("numpy")),
                       "benchbackend.backends.numpy.reference:NumpyBackend")
    with tempfile.TemporaryFile("w") as err:
        worker = server.start(err, 60)
        os.kill(worker.pid, 0)  # running (it waits for its job)
        os.kill(server.proc.pid, signal.SIGKILL)  # the preloader alone, not its group
        server.proc.wait(timeout=30)
        assert _gone(worker.pid, 30), "the worker outlived its preloader"
        assert server.exit_code(worker.pid) == -signal.SIGKILL
        worker.stdin.close()
        worker.stdout.close()
    server.close()


def test_a_worker_that_hangs_is_killed_at_the_timeout(tmp_path: Path) -> None:
    # A hung cell: the forked worker's process group is killed, the preloader serves the next one.
    slow = tmp_path / "slow_plugin.py"
    slow.write_text("import time\nfrom benchbackend.backends.numpy.reference import NumpyBackend\n\n\n"
                    "class Hang(NumpyBackend):\n    def build(self, weights):\n        time.sleep(600)\n")
    w = W.load("mnist").with_overrides(limit=64, epochs=1)
    spec = backends.get("numpy")
    env = launch.worker_environ(spec)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    job = make_job(tmp_path, w, "numpy", target="slow_plugin:Hang")
    cell = plan.Cell(w, plan.Choice("numpy", job.mode, job.precision), 1, 1, 0)
    with Preloaders() as preloaders:
        started = time.monotonic()
        messages = launch.stream(cell, launch.python_for(spec), env, job, 3.0, preloaders=preloaders)
        with pytest.raises(StopIteration) as stop:
            while True:
                next(messages)
        assert stop.value.value.status == "timeout" and time.monotonic() - started < 60
        (server,) = preloaders._servers.values()
        assert server.alive(), "the preloader survives its worker's kill"


def test_a_worker_killed_the_moment_it_is_forked_is_gone_and_reaped(tmp_path: Path) -> None:
    """Ctrl-C right after the fork: the parent kills the worker's process group before the worker
    has read its job. The preloader must answer the PID only once the worker leads its own group:
    a kill that came first found no such group, and the parent then waited for an exit that never
    came. The race is forced: the preloader and its forks share one core with a busy loop, so the
    fresh child waits for the core while the parent, on the other core, kills at once."""
    import shutil
    import subprocess
    import sys
    import tempfile
    import threading

    if len(os.sched_getaffinity(0)) < 2 or not shutil.which("taskset"):
        pytest.skip("forcing the race needs two cores and taskset (util-linux)")
    cores = sorted(os.sched_getaffinity(0))
    python = tmp_path / "python"  # the preloader, pinned to the busy core
    python.write_text(f"#!/bin/sh\nexec taskset -c {cores[0]} {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    spec = backends.get("numpy")
    busy = subprocess.Popen(["taskset", "-c", str(cores[0]), sys.executable, "-c", "while True: pass"])
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cores[1]})
    try:
        with Preloaders() as preloaders, tempfile.TemporaryFile("w+") as err:
            for _ in range(5):
                forked = preloaders.start(str(python), launch.worker_environ(spec), spec.target, err, 60)
                done = threading.Thread(target=launch.kill, args=(forked,), daemon=True)
                done.start()
                done.join(20)
                assert not done.is_alive(), "the killed worker was never reaped"
                assert forked.returncode == -9
    finally:
        os.sched_setaffinity(0, mine)
        busy.kill()
        busy.wait()


def test_numpy_engines_workers_keep_their_arrays_in_the_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference's and Chainer's workers start with glibc's mmap and trim thresholds raised
    (``registry._numpy_env``: each step's arrays reused from the heap, not mapped and faulted in
    afresh; 36% of the reference's cifar10 training, docs/backends.md "Knobs"); a preloaded worker
    has them from its preloader, which glibc read them in as it started."""
    kept = {"MALLOC_MMAP_THRESHOLD_": "2000000000", "MALLOC_TRIM_THRESHOLD_": "2000000000"}
    for var in kept:  # the suite sets them for all its processes (conftest): here only the backend may
        monkeypatch.delenv(var, raising=False)
    for name in ("numpy", "chainer"):
        assert kept.items() <= launch.worker_environ(backends.get(name)).items(), name
    assert not kept.keys() & launch.worker_environ(backends.get("torch")).keys()  # measured: no gain there
    import tempfile

    server = Preloader(launch.python_for(backends.get("numpy")), launch.worker_environ(backends.get("numpy")),
                       "benchbackend.backends.numpy.reference:NumpyBackend")
    with tempfile.TemporaryFile("w") as err:
        worker = server.start(err, 60)
        environ = dict(item.split("=", 1) for item in
                       Path(f"/proc/{worker.pid}/environ").read_bytes().decode().split("\0") if "=" in item)
        assert kept.items() <= environ.items()
        worker.stdin.close()  # no job: the worker ends
        worker.stdout.close()
    server.close()

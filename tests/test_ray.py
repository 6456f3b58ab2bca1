"""The Ray executor on a local one-node cluster: same rows as the local executor, faults cost one cell."""
from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

from benchbackend import results
from benchbackend.backends import registry as backends
from benchbackend.backends.registry import BackendSpec, Mode
from benchbackend.data import arrays
from benchbackend.run import plan as planning
from benchbackend.run import progress, runner
from benchbackend.run.executors.local import LocalExecutor
from benchbackend.spec import workload
from conftest import cli

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                                    reason="Ray is not installed (pip install 'benchbackend[ray]')")]


@pytest.fixture(scope="module")
def cluster():
    """One local cluster for the module (starting Ray costs seconds), started as ``--executor ray``
    without ``--address`` starts it; the executors of the tests find it running."""
    import ray

    _ray_executor(num_cpus=2).connect()
    yield ray
    ray.shutdown()


def test_the_local_cluster_runs_its_tasks_at_the_normal_priority(cluster):
    @cluster.remote(num_cpus=1)
    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, 0)

    assert cluster.get(niceness.remote()) == 0  # not Ray's worker_niceness, 15


def _plan(tmp_path: Path, name: str, backend: str = "numpy", limit: int = 256, epochs: int = 1, repeats: int = 2,
          device: str = "cpu") -> planning.RunPlan:
    w = workload.load("mnist").with_overrides(limit=limit, epochs=epochs)
    return planning.RunPlan(workloads=[w], choices=planning.resolve([backend], [], []), repeats=repeats,
                            device=device, data_source="synthetic")


def _run(tmp_path: Path, name: str, plan: planning.RunPlan, executor) -> list:
    """The cells of ``plan`` run by ``executor``, written to ``tmp_path / name.csv``."""
    return runner.Runner(plan, executor, results.CsvWriter(tmp_path / f"{name}.csv")).run()


def _ray_executor(**kwargs):
    from benchbackend.run.executors.ray import RayExecutor

    return RayExecutor(**kwargs)


COMPARED = ["repeat", "phase", "epoch", "samples", "status", "loss", "accuracy", "val_loss", "val_accuracy",
            "parity_max_abs", "parity_max_rel", "params", "backend", "mode", "precision", "threads", "data_sha256",
            "attempt"]


def test_ray_rows_match_the_local_executor_but_for_timings_and_hosts(cluster, tmp_path):
    local = _run(tmp_path, "local", _plan(tmp_path, "local"), LocalExecutor())
    remote = _run(tmp_path, "ray", _plan(tmp_path, "ray"), _ray_executor())
    assert [(c.repeat, c.status) for c in remote] == [(c.repeat, c.status) for c in local]
    a, b = results.read(tmp_path / "local.csv"), results.read(tmp_path / "ray.csv")
    key = ["repeat", "phase", "epoch"]
    a, b = a.sort_values(key).reset_index(drop=True), b.sort_values(key).reset_index(drop=True)
    assert len(a) == len(b) and (a.phase == "train_epoch").sum() == 2
    assert a[COMPARED].equals(b[COMPARED])  # identical losses and accuracies, not merely close
    assert set(b["host"]) == {cluster.nodes()[0]["NodeManagerHostname"]}  # the node that measured them


def test_a_worker_killed_mid_cell_costs_that_cell_only(cluster, tmp_path, monkeypatch):
    mark = tmp_path / "killed"
    path = os.pathsep.join([str(ROOT / "tests"), str(ROOT)])
    spec = BackendSpec("killer", "support.killer_backend:KillerNumpyBackend", ("numpy",), "numpy", "(test only)",
                       "the NumPy reference; its first worker kills its Ray worker in epoch 2",
                       modes=(Mode("reference", "NumPy, batch by batch"),),
                       env=lambda device: {"KILLER_MARK": str(mark), "PYTHONPATH": path})
    monkeypatch.setitem(backends.BACKENDS, "killer", spec)
    # 32 SGD steps over 2 epochs: enough for the surviving repeat to clear the chance check.
    cells = _run(tmp_path, "fault", _plan(tmp_path, "fault", "killer", limit=512, epochs=2), _ray_executor())
    assert mark.exists()  # the fault did strike
    assert [(c.repeat, c.status) for c in cells] == [(1, "crashed"), (2, "ok")]
    assert "Ray" in cells[0].message and "WorkerCrashedError" in cells[0].message
    df = results.read(tmp_path / "fault.csv")
    first = df[df.repeat == 1]
    assert first[first.phase == "train_epoch"]["epoch"].tolist() == [1]  # streamed before the kill: kept
    assert set(first["status"]) == {"crashed"}
    assert df[(df.repeat == 2) & (df.phase == "train_epoch")]["epoch"].tolist() == [1, 2]


def test_a_group_no_node_can_take_is_unavailable_and_says_why(cluster, tmp_path, monkeypatch):
    # The interpreter makes the driver's install check pass; only the cluster lacks the env.
    spec = BackendSpec("ghost", "benchbackend.backends.numpy.reference:NumpyBackend", ("numpy",), "numpy",
                       "(test only)",
                       "the NumPy reference in an isolated env no node has",
                       modes=(Mode("reference", "NumPy, batch by batch"),), isolated_env="ghost",
                       python=sys.executable)
    monkeypatch.setitem(backends.BACKENDS, "ghost", spec)
    plan = _plan(tmp_path, "ghost", "ghost")
    plan.choices += planning.resolve(["numpy"], [], [])
    plan.repeats = 1
    cells = _run(tmp_path, "ghost", plan, _ray_executor())
    ghost, numpy = sorted(cells, key=lambda c: c.backend)
    assert (ghost.backend, ghost.status) == ("ghost", "unavailable")
    assert "benchbackend-env-ghost" in ghost.message and "ray start --resources" in ghost.message
    df = results.read(tmp_path / "ghost.csv")
    assert df[df.backend == "ghost"]["status"].tolist() == ["unavailable"]
    assert numpy.backend == "numpy" and numpy.status not in ("unavailable", "crashed")  # the other group ran
    assert (df[df.backend == "numpy"].phase == "train_epoch").sum() == 1


@pytest.mark.parametrize("device", ["gpu", "cuda", "cuda:0"])
def test_gpu_cells_on_a_cluster_without_gpus_are_unavailable(cluster, tmp_path, device):
    """Every form of a GPU device asks Ray for a GPU (``cuda`` once did not, and its cell ran with
    the GPU hidden from it); a cluster without one says so."""
    cells = _run(tmp_path, "gpu", _plan(tmp_path, "gpu", device=device), _ray_executor())
    assert [c.status for c in cells] == ["unavailable"]
    assert "GPU" in cells[0].message


def test_an_unreachable_address_is_one_line_cluster_error(tmp_path):
    from benchbackend.errors import BenchError, ClusterError

    for address, says in [("127.0.0.1:1", "cannot reach the Ray cluster at 127.0.0.1:1"),
                          ("no-port-here", "expected HOST:PORT")]:
        with pytest.raises(ClusterError) as info:
            _ray_executor(address=address).connect()
        assert says in str(info.value) and "\n" not in str(info.value)
        assert isinstance(info.value, BenchError)


def test_a_cluster_that_asks_for_its_token_says_how_to_send_it(tmp_path):
    """``ray start`` enables token authentication where a token exists (any local ``ray.init`` made
    one in ~/.ray), and Ray sends a token to a named address only in RAY_AUTH_MODE=token."""
    import socket
    import subprocess

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ray_cli = str(Path(sys.executable).parent / "ray")
    # Not this process's RAY_AUTH_MODE (a local ray.init sets it): "" is Ray's "not token", as unset.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | {"HOME": str(tmp_path),
                                                                                "RAY_AUTH_MODE": ""}
    subprocess.run([ray_cli, "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    token = {**env, "RAY_AUTH_MODE": "token"}
    head = subprocess.Popen([ray_cli, "start", "--head", "--block", "--port", str(port), "--num-cpus", "1",
                             "--include-dashboard", "false"], env=token, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while subprocess.run([ray_cli, "status", "--address", f"127.0.0.1:{port}"], env=token,
                             capture_output=True).returncode != 0:
            assert head.poll() is None and time.monotonic() < deadline, "the head did not start"
            time.sleep(1)
        args = ["run", "mnist", "-b", "numpy", "--inference-only", "--executor", "ray", "--address",
                f"127.0.0.1:{port}", "--data", "synthetic", "--limit", "256", "--repeats", "1", "--no-plots"]
        refused = cli(*args, "-o", str(tmp_path / "refused.csv"), env=env)
        assert refused.returncode == 2 and not (tmp_path / "refused.csv").exists(), refused.stderr[-2000:]
        assert refused.stderr.strip().splitlines() == [refused.stderr.strip()], refused.stderr  # one line
        assert "cannot join the Ray cluster" in refused.stderr and "set RAY_AUTH_MODE=token" in refused.stderr
        sent = cli(*args, "-o", str(tmp_path / "sent.csv"), env=token)
        assert sent.returncode == 0, sent.stderr[-2000:]
        assert set(results.read(tmp_path / "sent.csv")["status"]) == {"ok"}
    finally:
        head.terminate()
        head.wait(60)


def test_a_join_gives_the_gcs_a_few_tries_unless_the_user_set_rays_budget(monkeypatch):
    """The refused join above waited out Ray's 20 tries of the head's GCS (one a second) before it
    said why; the driver now gives a head that answers on its port ``JOIN_TRIES``, and a user's own
    ``RAY_gcs_server_port_wait_time_s`` is left as it is."""
    from benchbackend.run.executors import ray_join

    name = ray_join._GCS_TRIES
    monkeypatch.delenv(name, raising=False)
    with ray_join._default_env(name, str(ray_join.JOIN_TRIES)):
        assert os.environ[name] == str(ray_join.JOIN_TRIES) and ray_join.JOIN_TRIES < 20
    assert name not in os.environ
    monkeypatch.setenv(name, "60")
    with ray_join._default_env(name, str(ray_join.JOIN_TRIES)):
        assert os.environ[name] == "60"
    assert os.environ[name] == "60"


def test_cells_per_node_shares_a_node_cpus():
    from benchbackend.run.executors.ray import RayExecutor, _Session

    node = {"Resources": {"CPU": 16.0}}
    share = {n: _Session(RayExecutor(cells_per_node=n), tasks=[])._cpus(node) for n in (None, 1, 3, 32)}
    assert share == {None: 16.0, 1: 16.0, 3: 5.0, 32: 0.5}
    with pytest.raises(ValueError):
        RayExecutor(cells_per_node=0)


def test_timeout_applies_per_cell_on_the_node(cluster, tmp_path):
    # A worker forked from a preloaded one can finish a 256-sample epoch inside 0.5 s (CI saw it
    # once): 30 epochs of 2,048 samples cannot, on any machine, so the kill is what ends the cell.
    plan = _plan(tmp_path, "timeout", limit=2048, epochs=30, repeats=2)
    cells = _run(tmp_path, "timeout", plan, _ray_executor(timeout=0.5))
    assert [(c.repeat, c.status) for c in cells] == [(1, "timeout"), (2, "timeout")]
    assert "--timeout 0.5s" in cells[0].message


def test_ctrl_c_cancels_the_tasks_and_keeps_what_arrived(cluster, tmp_path):
    class Interrupting(progress.Display):
        def note(self, text: str) -> None:
            if "epoch 1/" in text:
                raise KeyboardInterrupt  # as Ctrl-C would, while the driver handles a streamed row

    r = runner.Runner(_plan(tmp_path, "int", epochs=3), _ray_executor(), results.CsvWriter(tmp_path / "int.csv"),
                      Interrupting())
    with pytest.raises(KeyboardInterrupt):
        r.run()
    assert [(c.repeat, c.status) for c in r.results] == [(1, "interrupted")]
    df = results.read(tmp_path / "int.csv")
    assert set(df["status"]) == {"interrupted"} and set(df["repeat"]) == {1}
    assert df[df.phase == "train_epoch"]["epoch"].tolist() == [1]
    # The cancelled task has ended (its worker killed first) and given its node's CPUs back.
    deadline = time.monotonic() + 10  # the cluster's resource view lags the raylet by a moment
    while cluster.available_resources().get("CPU") != cluster.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, "the cancelled task still holds its CPUs"
        time.sleep(0.2)


def test_two_cells_per_node_run_side_by_side_with_half_the_threads_each(cluster, tmp_path):
    plan = _plan(tmp_path, "shared", repeats=2)
    cells = _run(tmp_path, "shared", plan, _ray_executor(cells_per_node=2, allow_mixed_hosts=True))
    assert sorted(c.repeat for c in cells) == [1, 2]
    df = results.read(tmp_path / "shared.csv")
    assert set(df["threads"]) == {cluster.cluster_resources()["CPU"] // 2}


def test_synthetic_data_is_made_on_the_node_checked_and_cached(cluster, tmp_path):
    from benchbackend.run.executors.ray_node import node_cache

    plan = _plan(tmp_path, "made", limit=512, epochs=2)  # enough SGD steps to clear the chance check
    expected = arrays.prepare(plan.workloads[0], "synthetic", None, tmp_path / "here.npz").sha256
    node_cache(expected).unlink(missing_ok=True)  # this cluster shares the suite's cache folder
    cells = _run(tmp_path, "made", plan, _ray_executor())
    assert [c.status for c in cells] == ["ok", "ok"]
    df = results.read(tmp_path / "made.csv")
    assert set(df["data_sha256"]) == {expected} and set(df["data_origin"]) == {"generated"}
    assert node_cache(expected).is_file()
    _run(tmp_path, "again", _plan(tmp_path, "again", limit=512, epochs=2, repeats=1), _ray_executor())
    assert set(results.read(tmp_path / "again.csv")["data_origin"]) == {"node-cache"}


def test_data_a_node_cannot_make_or_see_is_fetched_once_then_cached_and_always_checked(cluster, tmp_path,
                                                                                      monkeypatch):
    from benchbackend.run.executors.ray_node import DataSource, materialize, node_cache

    monkeypatch.setenv("BENCHBACKEND_CACHE", str(tmp_path / "cache"))
    w = workload.load("mnist").with_overrides(limit=64)
    here = tmp_path / "arrays.npz"
    sha = arrays.prepare(w, "synthetic", None, here).sha256
    stored = [cluster.put(here.read_bytes())]
    # Not synthetic (a user's .npz, say), and the driver's file is not on this node:
    far = DataSource(sha, str(tmp_path / "on-the-driver-only.npz"), None, stored)
    path, how = materialize(far, tmp_path)
    assert (how, path, arrays.checksum(path)) == ("fetched", node_cache(sha), sha)
    assert materialize(far, tmp_path) == (node_cache(sha), "node-cache")
    node_cache(sha).write_bytes(here.read_bytes()[:200])  # a truncated cache entry is not trusted
    assert materialize(far, tmp_path)[1] == "fetched"
    # Synthetic data the node makes differently (another generator) is not used: it is fetched.
    other = DataSource(sha, "", w.with_overrides(seed=w.seed + 1), stored)
    node_cache(sha).unlink()
    assert materialize(other, tmp_path)[1] == "fetched"
    # A shared file system: the driver's own file, once its checksum is right.
    node_cache(sha).unlink()
    assert materialize(DataSource(sha, str(here), None, stored), tmp_path) == (here, "shared-path")
    with pytest.raises(ValueError, match="do not match their checksum"):
        materialize(DataSource("0" * 64, str(here), None, stored), tmp_path)

"""End-to-end runs through the real CLI and real worker processes (PyTorch and TensorFlow on CPU)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from benchbackend import results
from benchbackend.cli import main
from conftest import ROOT, cli, ctrl_c_reaches_it, requires_tf, requires_torch

pytestmark = pytest.mark.slow


def variant(tmp_path: Path, name: str, **training) -> str:
    spec = yaml.safe_load((ROOT / "workloads" / "mnist.yaml").read_text())
    spec["name"] = name
    spec["training"].update(training)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


@requires_torch
@requires_tf
def test_smoke_run_both_backends_ok(tmp_path):
    out_csv = tmp_path / "smoke.csv"
    # mnist only: cifar10's cells on both frameworks are test_parity's and test_fast_modes' (its
    # parameter count is test_cli's), and they took two thirds of this test's 80 s
    out = cli("run", "mnist", "-b", "torch", "-b", "tensorflow", "--data", "synthetic", "--limit", "512",
              "--epochs", "2", "--repeats", "2", "-o", str(out_csv))
    assert out.returncode == 0, out.stderr[-3000:]
    df = results.read(out_csv)
    assert list(df.columns[:len(results.COLUMNS)]) == results.COLUMNS
    assert set(df["status"]) == {"ok"}
    for wl in ("mnist",):
        for be in ("torch", "tensorflow"):
            cell = df[(df.workload == wl) & (df.backend == be)]
            assert sorted(cell["repeat"].unique()) == [1, 2]
            epochs = cell[cell.phase == "train_epoch"]
            assert len(epochs) == 4 and (epochs["seconds"] > 0).all()
            assert (cell[cell.phase == "inference"].shape[0]) == 2 * 5
            assert (cell[cell.phase == "parity"]["parity_max_rel"] < 1e-4).all()
            assert cell[cell.phase == "build"]["params"].iloc[0] == (16938 if wl == "mnist" else 2168362)
            assert cell["backend_version"].iloc[0] != ""
    assert "summary" in out.stdout and str(out_csv) in out.stdout
    assert "epoch 2/2" in out.stderr  # per-epoch progress
    assert (tmp_path / "smoke-plots").is_dir()


def run_here(monkeypatch, *args: str):
    """``benchbackend run ARGS`` through click's runner, its cells in this process (the checks and
    the CSV are what these tests look at, not the worker process)."""
    from support import inprocess

    inprocess.use(monkeypatch)
    return CliRunner().invoke(main, ["run", *args, "--no-plots", "--quiet"])


@pytest.mark.parametrize("backend", [pytest.param("torch", marks=requires_torch),
                                     pytest.param("tensorflow", marks=requires_tf)])
def test_absurd_learning_rate_ends_nan_loss(tmp_path, monkeypatch, backend):
    out_csv = tmp_path / "nan.csv"
    out = run_here(monkeypatch, variant(tmp_path, "mnist_nan", lr=1.0e12), "-b", backend, "--data", "synthetic",
                   "--limit", "256", "--epochs", "3", "--repeats", "1", "-o", str(out_csv))
    assert out.exit_code == 1, out.output[-2000:]
    df = results.read(out_csv)
    assert set(df["status"]) == {"nan_loss"}
    epochs = df[df.phase == "train_epoch"]
    assert len(epochs) >= 1 and not pytest.approx(0) == epochs["loss"].iloc[-1]
    assert epochs["loss"].isna().any() or (epochs["loss"].abs() == float("inf")).any()
    assert "nan_loss" in out.stdout


@pytest.mark.parametrize("backend", [pytest.param("torch", marks=requires_torch),
                                     pytest.param("tensorflow", marks=requires_tf)])
def test_model_that_cannot_learn_ends_chance_accuracy(tmp_path, monkeypatch, backend):
    out_csv = tmp_path / "chance.csv"
    out = run_here(monkeypatch, variant(tmp_path, "mnist_still", lr=1.0e-12), "-b", backend, "--data",
                   "synthetic", "--limit", "512", "--epochs", "1", "--repeats", "1", "-o", str(out_csv))
    assert out.exit_code == 1, out.output[-2000:]
    df = results.read(out_csv)
    assert set(df["status"]) == {"chance_accuracy"}
    assert "not significantly above chance" in df[df.phase == "run"]["message"].iloc[0]


@requires_torch
def test_timeout_is_a_row_and_the_run_goes_on(tmp_path):
    out_csv = tmp_path / "t.csv"
    # 30 epochs of 2,048 samples: no worker, forked from a preloaded one or not, ends inside 0.5 s
    out = cli("run", "mnist", "-b", "torch", "-b", "numpy", "--data", "synthetic", "--limit", "2048",
              "--epochs", "30", "--repeats", "1", "--timeout", "0.5", "-o", str(out_csv), "--no-plots")
    assert out.returncode == 1
    df = results.read(out_csv)
    assert set(df[df.phase == "run"]["status"]) == {"timeout"}
    assert set(df["backend"]) == {"torch", "numpy"}  # the second backend still ran (and timed out too)
    assert "past --timeout 0.5s" in df[df.phase == "run"]["message"].iloc[0]


def test_a_timeout_says_after_which_row_it_came() -> None:
    """A timed-out gpt2-124m TVM cell read "worker ran past --timeout 900s; stderr: ... Warning: Fast mode
    segfaults when there are out-of-bounds indices": stderr's tail, not what was running. Now the
    message names the last row the worker sent, before that tail."""
    from benchbackend.run import launch

    state = launch._State()
    assert launch._State().outcome(None, 5, "").message == "worker ran past --timeout 5s (before its first row)"
    for line in ('{"type": "row", "phase": "parity"}', '{"type": "row", "phase": "inference", "pass": 1}'):
        assert launch._parse(None, line, state) is not None
    out = state.outcome(None, 900, "; stderr: Warning: Fast mode segfaults")
    assert (out.status, out.message) == ("timeout", "worker ran past --timeout 900s (after its inference pass 1 "
                                                     "row); stderr: Warning: Fast mode segfaults")


FAKE_WORKER = """#!/bin/sh
cat > /dev/null
echo '{"type": "info", "backend_version": "9.9", "device": "cpu", "mode": "fake", "python": "3"}'
echo '{"type": "row", "phase": "build", "epoch": 0, "seconds": 0.5, "params": 16938}'
echo '{"type": "row", "phase": "train_epoch", "epoch": 1, "samples": 64, "seconds": 1.0, "loss": 2.0, '\
'"accuracy": 0.2, "val_loss": 2.0, "val_accuracy": 0.2}'
echo "fatal: simulated segfault in kernel" >&2
kill -9 $$
"""


def run_with_fake_interpreter(tmp_path, monkeypatch, script: str, repeats: int):
    """A real Runner whose workers are started by ``script`` instead of Python."""
    from benchbackend.run import plan as planning
    from benchbackend.run import runner
    from benchbackend.run.executors import local
    from benchbackend.spec import workload

    fake = tmp_path / "fakepython"
    fake.write_text(script)
    fake.chmod(0o755)
    monkeypatch.setattr(local, "python_for", lambda spec: str(fake))
    w = workload.load("mnist").with_overrides(limit=64, epochs=1)
    plan = planning.RunPlan(workloads=[w], choices=planning.resolve(["numpy"], [], []), repeats=repeats,
                            data_source="synthetic")
    return runner.Runner(plan, local.LocalExecutor(), results.CsvWriter(tmp_path / "c.csv")).run()


def test_crashed_worker_keeps_rows_and_stderr_tail(tmp_path, monkeypatch):
    cells = run_with_fake_interpreter(tmp_path, monkeypatch, FAKE_WORKER, repeats=2)
    assert [c.status for c in cells] == ["crashed", "crashed"]
    df = results.read(tmp_path / "c.csv")
    assert len(df[df.phase == "train_epoch"]) == 2  # the measured epochs survive the crash
    msg = df[df.phase == "run"]["message"].iloc[0]
    assert "exited with code -9" in msg and "simulated segfault" in msg
    assert set(df["status"]) == {"crashed"}


def test_sigterm_stops_the_worker_writes_what_was_measured_and_exits_143(tmp_path):
    # A scheduler's or a container's stop: the run must not leave its worker running on (it
    # would load the machine under the next benchmark) nor its rows pending.
    out_csv = tmp_path / "term.csv"
    proc = subprocess.Popen([sys.executable, "-m", "benchbackend", "run", "mnist", "-b", "numpy", "--data",
                             "synthetic", "--limit", "2048", "--epochs", "50", "--repeats", "1", "-o", str(out_csv),
                             "--no-plots"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline:
        if out_csv.exists() and "train_epoch" in out_csv.read_text():
            break
        time.sleep(0.5)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert workers, "the run's worker process was not found"
    proc.terminate()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    assert "interrupted" in err and "Traceback" not in err
    for pid in workers:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text(), \
            f"worker {pid} still runs"
    df = results.read(out_csv)
    assert (df.phase == "train_epoch").sum() >= 1
    assert set(df["status"]) == {"interrupted"}
    assert "stopped by SIGTERM" in df.loc[df.phase == "run", "message"].iloc[0]

@requires_tf
def test_ctrl_c_writes_what_was_measured_and_exits_130(tmp_path):
    out_csv = tmp_path / "int.csv"
    proc = subprocess.Popen([sys.executable, "-m", "benchbackend", "run", "mnist", "-b", "tensorflow", "--data",
                             "synthetic", "--limit", "2048", "--epochs", "50", "--repeats", "1", "-o", str(out_csv),
                             "--no-plots"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=ctrl_c_reaches_it)
    deadline = time.time() + 240
    while time.time() < deadline:
        if out_csv.exists() and "train_epoch" in out_csv.read_text():
            break
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "summary" in out and "interrupted" in out and str(out_csv) in out  # the summary still comes
    df = results.read(out_csv)
    assert (df.phase == "train_epoch").sum() >= 1
    assert "interrupted" in err and "Traceback" not in err
    assert set(df["status"]) == {"interrupted"}  # the running cell, every row of it, and nothing else


@requires_torch
def test_unavailable_backend_gets_a_row_while_others_run(tmp_path, monkeypatch):
    out_csv = tmp_path / "u.csv"
    monkeypatch.setenv("BENCHBACKEND_ENVS", str(tmp_path / "none"))
    # 32 SGD steps at the workload's lr 0.01: fewer cannot reliably clear the chance check.
    out = run_here(monkeypatch, "mnist", "-b", "plaidml", "-b", "torch", "--data", "synthetic", "--limit", "1024",
                   "--epochs", "1", "--repeats", "1", "-o", str(out_csv))
    assert out.exit_code == 1
    df = results.read(out_csv)
    assert df[df.backend == "plaidml"]["status"].tolist() == ["unavailable"]
    assert "benchbackend setup plaidml" in df[df.backend == "plaidml"]["message"].iloc[0]
    assert set(df[df.backend == "torch"]["status"]) == {"ok"}


@requires_torch
def test_gpu_request_without_gpu_is_unavailable(tmp_path, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present here")
    out_csv = tmp_path / "g.csv"
    out = run_here(monkeypatch, "mnist", "-b", "torch", "--device", "gpu", "--data", "synthetic", "--limit", "64",
                   "--epochs", "1", "--repeats", "2", "-o", str(out_csv))
    assert out.exit_code == 1
    df = results.read(out_csv)
    assert df["status"].tolist() == ["unavailable"]  # one row: the other repeat would say the same
    assert "no CUDA GPU" in df["message"].iloc[0]


def test_an_interpreter_that_dies_at_once_is_a_crashed_row(tmp_path, monkeypatch):
    script = "#!/bin/sh\necho 'no such module: benchbackend' >&2\nexit 3\n"
    cells = run_with_fake_interpreter(tmp_path, monkeypatch, script, repeats=1)
    assert [c.status for c in cells] == ["crashed"]
    assert "exited with code 3" in cells[0].message and "no such module" in cells[0].message


def test_exploding_loss_is_diverged_not_chance(tmp_path, monkeypatch):
    out_csv = tmp_path / "div.csv"
    # SGD at lr 100 on the reference: the loss stays finite but explodes (1e5 in epoch 1; deterministic, unlike
    # a framework whose kernels may overflow to NaN first); it must not read as chance_accuracy
    # (which the old checks said) nor as nan_loss.
    out = run_here(monkeypatch, variant(tmp_path, "mnist_div", lr=100.0), "-b", "numpy", "--data", "synthetic",
                   "--limit", "256", "--epochs", "2", "--repeats", "1", "-o", str(out_csv))
    df = results.read(out_csv)
    losses = df[df.phase == "train_epoch"]["loss"]
    assert out.exit_code == 1
    assert set(df["status"]) == {"diverged"}, (list(losses), out.output[-1500:])
    assert "exploded" in df[df.phase == "run"]["message"].iloc[0]


@requires_tf
def test_an_exported_keras_backend_cannot_pick_another_framework(tmp_path):
    out_csv = tmp_path / "kb.csv"
    out = cli("run", "mnist", "-b", "tensorflow", "--data", "synthetic", "--limit", "1024", "--epochs", "1",
              "--repeats", "1", "-o", str(out_csv), "--no-plots", env={"KERAS_BACKEND": "jax"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert set(results.read(out_csv)["status"]) == {"ok"}


def test_errors_before_measuring_leave_no_results_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nmodel: [\n")
    for args in (["run", str(bad)], ["run", "nope"], ["run", "mnist", "-b", "numpy", "--data", "real",
                                                      "--data-dir", str(tmp_path / "empty"), "-q"]):
        out = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "r.csv"), "--no-plots"])
        assert out.exit_code == 2 and len(out.output.strip().splitlines()) == 1, out.output
        assert not (tmp_path / "r.csv").exists()


def test_a_failed_run_writes_an_ordinary_readable_csv(tmp_path, monkeypatch):
    out_csv = tmp_path / "chance.csv"
    out = run_here(monkeypatch, variant(tmp_path, "mnist_still", lr=1.0e-12), "-b", "numpy", "--data", "synthetic",
                   "--limit", "256", "--epochs", "1", "--repeats", "1", "-o", str(out_csv))
    assert out.exit_code == 1
    ok_csv = tmp_path / "ok.csv"
    run_here(monkeypatch, "mnist", "-b", "numpy", "--inference-only", "--data", "synthetic", "--limit", "256",
             "--repeats", "1", "-o", str(ok_csv))
    assert (out_csv.stat().st_mode & 0o777) == (ok_csv.stat().st_mode & 0o777) != 0o600


def test_a_parent_killed_outright_leaves_its_running_cell_pending_not_ok(tmp_path):
    out_csv = tmp_path / "kill.csv"
    proc = subprocess.Popen([sys.executable, "-m", "benchbackend", "run", "mnist", "-b", "numpy", "--data",
                             "synthetic", "--limit", "1024", "--epochs", "30", "--repeats", "1", "-o", str(out_csv),
                             "--no-plots"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and not (out_csv.exists() and "train_epoch" in out_csv.read_text()):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the parent and its worker, no chance to finalize anything
    proc.communicate(timeout=60)
    df = results.read(out_csv)
    assert (df.phase == "train_epoch").sum() >= 1
    assert set(df["status"]) == {"pending"}


def test_workload_names_are_plain_and_match_their_file(tmp_path):
    spec = yaml.safe_load((ROOT / "workloads" / "mnist.yaml").read_text())
    for name, needle in (("../../x", "letters, digits and ._- only"), ("other", "must match the file name")):
        spec["name"] = name
        path = tmp_path / "evil.yaml"
        path.write_text(yaml.safe_dump(spec))
        out = CliRunner().invoke(main, ["run", str(path), "-b", "numpy", "--data", "synthetic"])
        assert out.exit_code == 2 and needle in out.output and len(out.output.strip().splitlines()) == 1, out.output


def test_diverged_is_judged_against_a_uniform_guess_not_the_first_epoch():
    from benchbackend.run import checks

    # TensorFlow's mnist at lr 1e6: the loss explodes inside epoch 1 and stays huge.
    assert checks.diverged([1.31e20, 4.77e5, 4.61e5], 10, 1e3)
    assert checks.diverged([2.3, 2.1, 1.9e4], 10, 1e3)
    assert checks.diverged([2.3, 1.2, 0.4], 10, 1e3) is None
    assert checks.diverged([2.3, float("nan")], 10, 1e3) is None  # nan_loss's business

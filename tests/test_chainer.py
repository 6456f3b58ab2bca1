"""Chainer: its isolated env (``envs.setup``) and real worker runs, define-by-run against static-graph.

The env is built once into ``$BENCHBACKEND_ENVS`` when set, else into pytest's cache
(``.pytest_cache/d/benchbackend-envs``, reused by later sessions), as the PlaidML tests do. Tests
skip with the reason when pip cannot install the pins here (no index, no wheel for this Python).
"""
from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any, Optional
from unittest import mock

import numpy as np
import pytest

from benchbackend.backends import envs
from benchbackend.run import checks
from benchbackend.spec import workload
from benchbackend.spec.workload import Workload
from conftest import FORKS, built_env, make_job

pytestmark = [pytest.mark.chainer, pytest.mark.slow]

TARGET = "benchbackend.backends.chainer.adapter:ChainerBackend"
PROBE = envs.Probe("chainer", TARGET, {})


# --- the environment -------------------------------------------------------------------------
@pytest.fixture(scope="session")
def chainer_env(envs_root: Path) -> envs.EnvStatus:
    return built_env(envs_root, "chainer", PROBE, "Chainer")


def test_setup_builds_the_pinned_stack_and_then_reuses_it(chainer_env: envs.EnvStatus, envs_root: Path) -> None:
    assert chainer_env.versions["chainer"] == "7.8.1"  # installed by the '#! pip install' step
    assert chainer_env.versions["numpy"].startswith("1.") and chainer_env.devices[0] == "cpu"
    marker = json.loads((chainer_env.path / envs.MARKER).read_text())
    assert marker["created_by"] == "benchbackend" and marker["name"] == "chainer" and marker["built"]
    logged: list[str] = []
    with mock.patch.dict(os.environ, {"BENCHBACKEND_ENVS": str(envs_root)}):
        st = envs.setup("chainer", PROBE, log=logged.append)
        assert envs.is_ready("chainer") and envs.package_version("chainer", "chainer") == "7.8.1"
    assert st.ready and any("reusing" in line for line in logged), logged


# --- real worker runs --------------------------------------------------------------------------
def small(name: str = "mnist", limit: int = 512, epochs: int = 1, **training: Any) -> Workload:
    w = workload.load(name).with_overrides(limit=limit, epochs=epochs)
    upd: dict[str, Any] = {"inference": w.inference.model_copy(update={"repeats": 1})}
    if training:
        upd["training"] = w.training.model_copy(update=training)
    return w.model_copy(update=upd)


def with_dropout(optimizer: str = "adam", lr: float = 1e-3) -> Workload:
    """MNIST-sized, with a dropout layer after a pool (4-D mask) and one after a dense layer (2-D)."""
    w = small(limit=256, optimizer=optimizer, lr=lr)
    layers = [{"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": "same", "activation": "relu"},
              {"type": "maxpool2d", "pool_size": 2}, {"type": "dropout", "rate": 0.25}, {"type": "flatten"},
              {"type": "dense", "units": 16, "activation": "relu"}, {"type": "dropout", "rate": 0.5},
              {"type": "dense", "units": 10, "activation": "softmax"}]
    return Workload.model_validate({**w.to_dict(), "name": "mnist-dropout", "model": layers})


def run_cell(env: envs.EnvStatus, w: Workload, tmp: Path, mode: str, device: str = "cpu",
             parity_steps: int = 0) -> tuple[list[dict[str, Any]], str]:
    """The worker's messages (stdout, each line JSON) and its stderr."""
    job = make_job(tmp, w, "chainer", mode=mode, device=device, repeat=0, parity_steps=parity_steps)
    proc = FORKS.run(env.python, envs.worker_env(), job, 900)
    msgs = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]  # every line is protocol
    errors = [m for m in msgs if m.get("type") == "error"]
    assert proc.returncode == 0 and not errors, (errors or proc.stderr[-3000:])
    return msgs, proc.stderr


def rows(msgs: list[dict[str, Any]], phase: str) -> list[dict[str, Any]]:
    return [m for m in msgs if m.get("type") == "row" and m.get("phase") == phase]


def unavailable(msgs: list[dict[str, Any]]) -> Optional[str]:
    return next((m["message"] for m in msgs if m.get("type") == "unavailable"), None)


def cell_status(msgs: list[dict[str, Any]], w: Workload) -> tuple[str, str]:
    forward = [r for r in rows(msgs, "parity") if not r.get("steps")]
    trajectory = [checks.trajectory(r, w) for r in rows(msgs, "parity") if r.get("steps")]
    return checks.cell_status(rows(msgs, "build") + forward + trajectory + rows(msgs, "train_epoch"), w)


@pytest.fixture(scope="module")
def mnist_runs(chainer_env: envs.EnvStatus, tmp_path_factory: pytest.TempPathFactory):
    w = small(limit=512, epochs=2)
    tmp = tmp_path_factory.mktemp("mnist")
    return w, {mode: run_cell(chainer_env, w, tmp, mode, parity_steps=16) for mode in ("define-by-run", "static-graph")}


@pytest.mark.parametrize("mode", ["define-by-run", "static-graph"])
def test_both_modes_train_ok_with_parity(mnist_runs, mode: str) -> None:
    w, runs = mnist_runs
    msgs, _ = runs[mode]
    info = next(m for m in msgs if m.get("type") == "info")
    assert info["mode"] == mode and info["backend_version"] == "7.8.1" and info["device"] == "cpu"
    assert rows(msgs, "build")[0]["params"] == 16938
    forward = next(r for r in rows(msgs, "parity") if not r.get("steps"))
    assert forward["parity_max_rel"] < w.checks.parity_rtol, forward
    trajectory = checks.trajectory(next(r for r in rows(msgs, "parity") if r.get("steps")), w)
    assert trajectory["steps"] == 16 and trajectory["parity_step"] is None, trajectory
    epochs = rows(msgs, "train_epoch")
    assert [r["epoch"] for r in epochs] == [1, 2] and epochs[1]["loss"] < epochs[0]["loss"]
    # the loss audit (run/loss_audit.py): epoch 1's 16 trajectory steps, epoch 2's first step
    assert [(r["loss_audited"], r.get("audit_step")) for r in epochs] == [(16, None), (1, None)], epochs
    assert cell_status(msgs, w) == ("ok", "")
    assert msgs[-1] == {"type": "done"}


def test_static_graph_trains_exactly_as_define_by_run(mnist_runs) -> None:
    _, runs = mnist_runs
    eager, static = (rows(runs[m][0], "train_epoch") for m in ("define-by-run", "static-graph"))
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        np.testing.assert_allclose([r[key] for r in static], [r[key] for r in eager], rtol=1e-5, err_msg=key)


def test_static_graph_chatter_stays_off_the_protocol(mnist_runs) -> None:
    _, runs = mnist_runs
    msgs, stderr = runs["static-graph"]
    assert "end of build_schedule()" in stderr  # static_graph really traced (it prints that)
    assert all(isinstance(m, dict) and "type" in m for m in msgs)
    assert "build_schedule" not in runs["define-by-run"][1]


@pytest.mark.parametrize("mode", ["define-by-run", "static-graph"])
def test_dropout_and_adam_follow_the_reference(chainer_env: envs.EnvStatus, tmp_path: Path, mode: str) -> None:
    w = with_dropout()
    msgs, _ = run_cell(chainer_env, w, tmp_path, mode, parity_steps=8)
    trajectory = checks.trajectory(next(r for r in rows(msgs, "parity") if r.get("steps")), w)
    assert trajectory["parity_step"] is None, trajectory
    assert np.isfinite(rows(msgs, "train_epoch")[0]["loss"])


DROPOUT_PROBE = textwrap.dedent("""
    import json, sys
    import numpy as np
    from benchbackend.backends.chainer.adapter import ChainerBackend
    from benchbackend.spec.model import initial_weights
    from benchbackend.spec.workload import Workload
    w = Workload.model_validate(json.loads(sys.stdin.read()))
    b = ChainerBackend(w, "cpu", sys.argv[1])
    b.build(initial_weights(w))
    rng = np.random.default_rng(0)
    x = rng.random((4, 28, 28, 1), dtype=np.float32)
    y = np.arange(4) % 10
    b.set_data(x, y)
    print(json.dumps([float(b.train_epoch(np.arange(4))[0]) for _ in range(4)]))
""")


@pytest.mark.parametrize("mode", ["define-by-run", "static-graph"])
def test_dropout_draws_a_new_mask_every_step(chainer_env: envs.EnvStatus, mode: str) -> None:
    """With a learning rate of ~0 each step sees the same weights and batch: only fresh dropout
    masks make the losses differ. F.dropout under static_graph would replay its first mask."""
    w = with_dropout(optimizer="sgd", lr=1e-30)
    proc = subprocess.run([str(chainer_env.python), "-c", DROPOUT_PROBE, mode], input=json.dumps(w.to_dict()),
                          text=True, capture_output=True, timeout=300, env=envs.worker_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = json.loads(proc.stdout.splitlines()[-1])
    assert len(set(losses)) == len(losses), losses


@pytest.mark.parametrize("mode,lr,status", [("static-graph", 1e12, "nan_loss"), ("define-by-run", 1e12, "nan_loss"),
                                            ("static-graph", 1e-12, "chance_accuracy")])
def test_broken_training_is_caught(chainer_env: envs.EnvStatus, tmp_path: Path, mode: str, lr: float,
                                   status: str) -> None:
    w = small(limit=256, epochs=2, lr=lr)
    msgs, _ = run_cell(chainer_env, w, tmp_path, mode)
    assert cell_status(msgs, w)[0] == status, rows(msgs, "train_epoch")


def test_ideep_mode_is_unavailable_with_the_reason(chainer_env: envs.EnvStatus, tmp_path: Path) -> None:
    if any("iDeep" in d for d in chainer_env.devices):
        pytest.skip("ideep4py is installed in this Chainer env; the mode runs")
    msgs, _ = run_cell(chainer_env, small(limit=64), tmp_path, "ideep")
    msg = unavailable(msgs)
    assert msg and "ideep4py" in msg and "Python 3." in msg, msgs
    assert not rows(msgs, "build")


def test_gpu_without_cupy_is_unavailable(chainer_env: envs.EnvStatus, tmp_path: Path) -> None:
    if any(d.startswith("cuda") for d in chainer_env.devices):
        pytest.skip("this Chainer env sees a CUDA GPU")
    msgs, _ = run_cell(chainer_env, small(limit=64), tmp_path, "define-by-run", device="gpu")
    msg = unavailable(msgs)
    assert msg and "CuPy" in msg and "--device cpu" in msg, msgs


# --- the whole product: CLI and runner ---------------------------------------------------------
def test_cli_static_graph_run_is_ok_and_quiet(chainer_env: envs.EnvStatus, envs_root: Path, tmp_path: Path) -> None:
    from benchbackend import results
    from benchbackend.backends import registry as backends
    from conftest import cli

    if "chainer" not in backends.BACKENDS:
        pytest.skip("the chainer backend is not in the registry (benchbackend/backends/__init__.py)")
    out_csv = tmp_path / "chainer.csv"
    out = cli("run", "mnist", "-b", "chainer", "--mode", "chainer:define-by-run", "--mode", "chainer:static-graph",
              "--data", "synthetic", "--limit", "1024", "--epochs", "1", "--repeats", "1", "-o", str(out_csv),
              "--no-plots", env={"BENCHBACKEND_ENVS": str(envs_root)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "build_schedule" not in out.stdout + out.stderr
    df = results.read(out_csv)
    assert set(df["status"]) == {"ok"} and set(df["mode"]) == {"define-by-run", "static-graph"}
    assert set(df["backend_version"]) == {"7.8.1"}

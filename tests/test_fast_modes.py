"""Fast modes and reduced precisions of the torch and tensorflow adapters, through the worker.

Each cell is a tiny mnist run (512 samples, 1 epoch, 5 trajectory steps) through
``worker.run_job`` in this process. Every mode must pass forward parity and the trajectory check
at its precision's tolerances (bf16's own, measured: ``checks.trajectory_tolerance``), and must
train to the same epoch loss as the default mode (the fast paths change the speed, not the numbers).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchbackend import paths
from benchbackend.backends import registry as backends
from benchbackend.run import checks
from benchbackend.run.launch import Job
from benchbackend.run.worker import run_job
from benchbackend.spec import workload as W
from conftest import job_arrays, requires_tf, requires_torch

pytestmark = pytest.mark.slow  # every test here starts a framework's worker or trains one
WORKLOAD = W.load("mnist").with_overrides(limit=512, epochs=1)
_RUNS: dict[tuple[str, str, str], list[dict[str, Any]]] = {}


@pytest.fixture(scope="module")
def arrays(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(job_arrays(tmp_path_factory.mktemp("fast"), WORKLOAD))


def job(arrays: Path, backend: str, mode: str, precision: str, **fields: Any) -> Job:
    return Job.for_spec(backends.get(backend), WORKLOAD, mode=mode, precision=precision, data=str(arrays), **fields)


def cell(arrays: Path, backend: str, mode: str, precision: str) -> list[dict[str, Any]]:
    """The messages of one cell, run once per test session and shared by the tests below."""
    key = (backend, mode, precision)
    if key not in _RUNS:
        msgs: list[dict[str, Any]] = []
        run_job(job(arrays, backend, mode, precision, repeat=0, parity_steps=5), msgs.append)
        _RUNS[key] = msgs
    return _RUNS[key]


def forward_parity(msgs: list[dict[str, Any]]) -> dict[str, Any]:
    return next(m for m in msgs if m.get("phase") == "parity" and not m.get("steps"))


def trajectory(msgs: list[dict[str, Any]], precision: str = "fp32") -> dict[str, Any]:
    return checks.trajectory(next(m for m in msgs if m.get("phase") == "parity" and m.get("steps")), WORKLOAD,
                             precision)


def epoch_loss(msgs: list[dict[str, Any]]) -> float:
    return next(m["loss"] for m in msgs if m.get("phase") == "train_epoch")


def assert_cell_ok(msgs: list[dict[str, Any]], precision: str) -> None:
    assert not [m for m in msgs if m["type"] in ("unavailable", "error")], msgs
    tol = WORKLOAD.checks.tolerance(precision)
    par = forward_parity(msgs)
    assert checks.parity_mismatch(par["parity_max_abs"], par["parity_max_rel"], tol.rtol, tol.atol) is None, par
    traj = trajectory(msgs, precision)
    assert traj["parity_step"] is None, traj["notes"]
    if precision != "fp32":
        # Reduced precision really ran: the outputs are off the float64 reference by far more
        # than fp32 rounding (~1e-7 here).
        assert par["parity_max_rel"] > 1e-5, par
    rows = [traj if m.get("steps") else m for m in msgs if m["type"] == "row"]
    assert checks.cell_status(rows, WORKLOAD, precision) == ("ok", "")
    assert [m["phase"] for m in rows].count("inference") == WORKLOAD.inference.repeats


TORCH_CELLS = [(m, p) for m in ("eager", "channels_last") for p in ("fp32", "bf16")]
TF_CELLS = [(m, p) for m in ("tf.function", "xla") for p in ("fp32", "bf16")]


@requires_torch
@pytest.mark.parametrize("mode,precision", TORCH_CELLS)
def test_torch_mode_precision_passes_checks(arrays: Path, mode: str, precision: str) -> None:
    assert_cell_ok(cell(arrays, "torch", mode, precision), precision)


@requires_tf
@pytest.mark.parametrize("mode,precision", TF_CELLS)
def test_tensorflow_mode_precision_passes_checks(arrays: Path, mode: str, precision: str) -> None:
    assert_cell_ok(cell(arrays, "tensorflow", mode, precision), precision)


@requires_torch
def test_torch_compile_passes_checks_and_trains_like_eager(arrays: Path) -> None:
    msgs = cell(arrays, "torch", "compile", "fp32")  # the one compile cell: compiling is slow
    assert_cell_ok(msgs, "fp32")
    assert epoch_loss(msgs) == pytest.approx(epoch_loss(cell(arrays, "torch", "eager", "fp32")), rel=1e-4)


@requires_torch
def test_torch_compile_keeps_inductors_cache_in_the_cells_own_folder_and_eager_keeps_none(arrays: Path) -> None:
    info = next(m for m in cell(arrays, "torch", "compile", "fp32") if m["type"] == "info")
    folder = paths.compile_cache_dir() / "torchinductor" / f"{WORKLOAD.hash()}-compile-fp32"
    assert info["compile_cache"] == "warm" and any(p.is_file() for p in folder.rglob("*")), info
    eager = next(m for m in cell(arrays, "torch", "eager", "fp32") if m["type"] == "info")
    assert eager["compile_cache"] == "" and eager["compile_cache_hit"] is None


@requires_torch
def test_torch_channels_last_trains_like_eager(arrays: Path) -> None:
    eager = epoch_loss(cell(arrays, "torch", "eager", "fp32"))
    assert math.isfinite(eager)
    assert epoch_loss(cell(arrays, "torch", "channels_last", "fp32")) == pytest.approx(eager, rel=1e-4)


@requires_tf
def test_xla_trains_like_tf_function(arrays: Path) -> None:
    graph = epoch_loss(cell(arrays, "tensorflow", "tf.function", "fp32"))
    assert math.isfinite(graph)
    assert epoch_loss(cell(arrays, "tensorflow", "xla", "fp32")) == pytest.approx(graph, rel=1e-4)


@pytest.mark.parametrize("backend,mode,reason", [
    pytest.param("torch", "eager", "CUDA", marks=requires_torch),
    pytest.param("tensorflow", "tf.function", "fp16", marks=requires_tf),
])
def test_fp16_on_cpu_is_unavailable(arrays: Path, backend: str, mode: str, reason: str) -> None:
    msgs: list[dict[str, Any]] = []
    run_job(job(arrays, backend, mode, "fp16"), msgs.append)
    assert [m["type"] for m in msgs] == ["unavailable"]
    assert reason in msgs[0]["message"]


@requires_tf
def test_tensorflow_bf16_computes_in_bfloat16_with_float32_output() -> None:
    from benchbackend.backends.tensorflow.adapter import TensorFlowBackend
    from benchbackend.spec.model import initial_weights

    w = W.load("cifar10")
    b = TensorFlowBackend(w, "cpu", "tf.function", "bf16")
    b.build(initial_weights(w))
    computing = [layer for layer in b.model.layers if layer.weights]  # not the functional model's InputLayer
    assert computing[0].compute_dtype == "bfloat16"
    assert all(v.dtype == "float32" for v in b.model.trainable_variables)  # fp32 master weights
    assert b.model.layers[-1].compute_dtype == "float32"  # the softmax, as Keras advises
    out = b.scores(b.to_device(np.zeros((2, *w.input_shape), np.float32)), 2)
    assert out.dtype.name == "float32" and np.allclose(b.to_host(out).sum(1), 1.0, atol=1e-6)


@requires_torch
def test_torch_bf16_resnet20_trajectory_passes_its_bound(tmp_path: Path) -> None:
    """Issue 42's GPU run: correct bf16 training of resnet20 (torch on an H100, and on a CPU) parts
    from the float64 reference by 2.9e-2 at step 2, past the default bf16 bound (measured on
    cifar10: 1.25e-2 there), so every bf16 resnet20 cell read parity_mismatch. resnet20 declares its
    own bf16 bound (workloads/resnet20.yaml, measured over torch, TensorFlow and JAX)."""
    resnet = W.load("resnet20").with_overrides(limit=256, epochs=1, seed=1)
    resnet = resnet.model_copy(update={"data": resnet.data.model_copy(update={"validation": 32, "test": 32}),
                                       "inference": resnet.inference.model_copy(update={"repeats": 1})})
    data = Path(job_arrays(tmp_path, resnet))
    msgs: list[dict[str, Any]] = []
    run_job(Job.for_spec(backends.get("torch"), resnet, mode="eager", precision="bf16", data=str(data), repeat=0,
                         parity_steps=2), msgs.append)
    raw = next(m for m in msgs if m.get("phase") == "parity" and m.get("steps"))
    traj = checks.trajectory(raw, resnet, "bf16")
    assert traj["parity_step"] is None, traj["notes"]
    assert traj["parity_max_rel"] > 1e-3, traj  # bf16 really ran: step 2 is past resnet20's step-1 bound
    # The bound is resnet20's own. Whether the default bf16 bound (1.25e-2 at step 2) would fail this
    # correct run depends on the CPU's bf16 arithmetic: 2.9e-2 on a CPU without AMX, 9.7e-3 on a Xeon
    # with AMX (seed 1; 8.1e-3 and 1.6e-2 at seeds 2 and 3). Without resnet20's own entry, the default
    # bound is the one applied, and step 2 is where it fails whenever the run parts by more than it.
    default = resnet.model_copy(update={"checks": resnet.checks.model_copy(update={"trajectory_tolerance": {}})})
    step_2 = default.checks.trajectory("bf16", 2)[1]  # the default bound at step 2 (1.25e-2)
    expected = 2 if traj["parity_max_rel"] > step_2 else None  # step 1 is within 1e-3, so the max is step 2's
    assert checks.trajectory(raw, default, "bf16")["parity_step"] == expected
    # Forward parity, both rows (inference mode; training mode with batch statistics), against
    # resnet20's own bf16 tolerance: the second H100 run read 1.45e-2 in training mode, past the
    # default rtol (1e-2), on a correct run; so does this batch on the CPU (1.89e-2).
    forward = [m for m in msgs if m.get("phase") == "parity" and not m.get("steps")]
    assert len(forward) == 2
    own, default_tol = resnet.checks.tolerance("bf16"), W.DEFAULT_TOLERANCES["bf16"]
    assert all(checks.parity_mismatch(m["parity_max_abs"], m["parity_max_rel"], own.rtol, own.atol) is None
               for m in forward), forward
    assert checks.parity_mismatch(forward[1]["parity_max_abs"], forward[1]["parity_max_rel"],
                                  default_tol.rtol, default_tol.atol), forward[1]

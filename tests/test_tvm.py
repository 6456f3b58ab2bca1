"""Apache TVM backend (inference only): forward parity in both modes, the cached tuning database,
and a parity check that fails when the kernels are laid out wrongly.

Tuning searches a one-layer network (flatten, dense, softmax: three tasks) with a trial budget of
three and a per-module cache folder, so the search runs once per session, in a worker: about 20 s
here (the worker's start, a build, one build and run per trial, the recompile). The mnist CNN's
seven tasks at eight trials took three minutes of CI.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

import numpy as np
import pytest

from benchbackend import checks
from benchbackend import workload as W
from benchbackend.plan import Options
from conftest import requires, run_cell, spawn_cell

pytestmark = [requires("tvm"), pytest.mark.slow]
TRIALS = 3  # one measured trial per task of TINY: enough to exercise the search
#: The network the tuning tests search: mnist's data through one dense layer.
TINY = {"name": "tiny", "seed": 0, "data": {"dataset": "mnist", "train": 256, "validation": 0, "test": 64},
        "model": [{"type": "flatten"}, {"type": "dense", "units": 10, "activation": "softmax"}],
        "training": {"optimizer": "sgd", "lr": 0.01, "batch_size": 32, "epochs": 1},
        "inference": {"batch_size": 32, "repeats": 2}}


def _load(name: str) -> W.Workload:
    return W.parse(TINY) if name == "tiny" else W.load(name)


def _run(tmp: Path, name: str, mode: str, limit: int = 256, test: int = 0, **options: Any) -> list[dict[str, Any]]:
    w = _load(name).with_overrides(limit=limit, epochs=1)
    if test:  # --limit keeps 256 test samples; fewer here, and two passes
        w = w.model_copy(update={"data": w.data.model_copy(update={"test": test}),
                                 "inference": w.inference.model_copy(update={"repeats": 2})})
    return run_cell(tmp, w, "tvm", mode=mode, repeat=0, options=Options(**options))[0]


def _phase(rows: list[dict[str, Any]], phase: str) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("type") == "row" and r["phase"] == phase]


def _assert_parity(rows: list[dict[str, Any]], name: str) -> None:
    assert not [r for r in rows if r["type"] in ("error", "unavailable")], rows
    (parity,) = _phase(rows, "parity")
    tol = _load(name).checks.tolerance("fp32")
    found = checks.parity_mismatch(parity["parity_max_abs"], parity["parity_max_rel"], tol.rtol, tol.atol)
    assert found is None, parity


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("tvm-cache")
    with mock.patch.dict(os.environ, {"BENCHBACKEND_CACHE": str(root)}):
        yield root


@pytest.fixture(scope="module")
def tuned_rows(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    # In a worker process, as a user's run: MetaSchedule's first TuneContext imports TVM's tensor
    # intrinsics, whose @prim_func decorators each call inspect.stack(); every frame of that stack
    # looks its module up over all of sys.modules. In this pytest process (deep stack, torch,
    # TensorFlow and JAX loaded by other tests) that import took 60 s alone and 260 s in CI.
    w = _load("tiny").with_overrides(limit=256, epochs=1)
    rows, outcome, _ = spawn_cell(tmp_path_factory.mktemp("tuned"), w, "tvm", mode="tuned", repeat=0,
                                  options=Options(tune_trials=TRIALS))
    assert outcome.status == "done", outcome
    return [{"type": "row", **r} for r in rows]


@pytest.mark.parametrize("name", ["mnist", "cifar10"])
def test_default_mode_matches_the_reference(tmp_path: Path, name: str) -> None:
    # Untuned Relax kernels on CPU are plain loops (cifar10: ~20 samples/s on two cores), so
    # cifar10 gets a tiny test split: one full batch and a padded one.
    rows = _run(tmp_path, name, "default", **({"test": 40} if name == "cifar10" else {}))
    _assert_parity(rows, name)
    (build,) = _phase(rows, "build")
    assert "target llvm -mcpu=" in build["notes"] and "-num-cores=" in build["notes"]
    assert not _phase(rows, "tune"), "default mode searches nothing"
    inference = _phase(rows, "inference")
    n_test = len(np.load(next(tmp_path.glob(f"{name}-*.npz")))["y_test"])  # the arrays job_arrays wrote
    assert inference and all(r["samples"] == n_test and r["seconds"] > 0 for r in inference)


def test_scores_drop_the_padding_of_a_short_last_batch() -> None:
    from benchbackend.backends import reference
    from benchbackend.backends.tvm import TVMBackend
    from benchbackend.model import initial_weights

    w = W.load("mnist").with_overrides(limit=64)
    weights = initial_weights(w)
    backend = TVMBackend(w, "cpu", "default", options={"threads": 1})
    backend.build(weights)
    x = np.random.default_rng(1).random((45, *w.input_shape), dtype=np.float32)  # 32 + 13
    out = backend.to_host(backend.scores(backend.to_device(x), 1024))
    ref = reference.forward(w, weights, x.astype(np.float64), dtype=np.float64)
    assert out.shape == (45, w.num_classes)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-6)


def test_a_wrong_kernel_layout_fails_parity(tmp_path: Path) -> None:
    from benchbackend.backends import tvm as tvm_backend

    real = tvm_backend.device_params

    def swapped_hw(weights: Any, dev: Any) -> list[Any]:  # HWIO read as WHIO: same shape, wrong numbers
        return real([np.swapaxes(k, 0, 1) if k.ndim == 4 else k for k in weights], dev)

    with mock.patch.object(tvm_backend, "device_params", swapped_hw):
        rows = _run(tmp_path, "mnist", "default")
    (parity,) = _phase(rows, "parity")
    tol = W.load("mnist").checks.tolerance("fp32")
    assert checks.parity_mismatch(parity["parity_max_abs"], parity["parity_max_rel"], tol.rtol, tol.atol)


def test_gpu_is_unavailable() -> None:
    from benchbackend.backends.tvm import TVMBackend
    from benchbackend.errors import BackendUnavailable

    with pytest.raises(BackendUnavailable, match="host CPU"):
        TVMBackend(W.load("mnist"), "gpu", "default")


def test_tuned_mode_searches_writes_the_database_and_matches_the_reference(tuned_rows: list[dict[str, Any]],
                                                                          cache: Path) -> None:
    _assert_parity(tuned_rows, "tiny")
    (tune,) = _phase(tuned_rows, "tune")
    (folder,) = (cache / "tvm").iterdir()
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["trials"] == TRIALS and 0 < summary["records"] <= TRIALS
    assert tune["notes"].startswith(f"searched {summary['records']} trials (budget {TRIALS}) over ")
    assert tune["seconds"] > 0
    records = (folder / "records.json").read_text().splitlines()
    assert len(records) == summary["records"]
    assert not list((cache / "tvm").glob("*.*")), "no scratch folder is left behind"


def test_a_second_tune_reuses_the_database(tuned_rows: list[dict[str, Any]], cache: Path) -> None:
    from benchbackend.backends.tvm import TVMBackend
    from benchbackend.model import initial_weights

    (folder,) = (cache / "tvm").iterdir()
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    w = _load("tiny").with_overrides(limit=256, epochs=1)
    backend = TVMBackend(w, "cpu", "tuned", options={"tune_trials": TRIALS})
    backend.build(initial_weights(w))
    assert backend.database_dir(TRIALS) == folder
    summary = backend.tune()
    assert summary is not None and summary.startswith(f"reused database {folder}")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    # Another budget is another database.
    assert backend.database_dir(TRIALS * 2) != folder
    # --limit and --epochs change nothing the kernels see: the same database; another batch is another.
    other_size = TVMBackend(w.with_overrides(limit=512, epochs=3), "cpu", "tuned")
    assert other_size.database_dir(TRIALS) == folder
    other_batch = TVMBackend(w.with_overrides(batch_size=64), "cpu", "tuned")
    assert other_batch.database_dir(TRIALS) != folder

"""Apache TVM backend (inference only): forward parity in both modes, the default mode's CPU
schedule (parallel, vectorized, same results as TVM's unscheduled loops), the cached tuning
database, and a parity check that fails when the kernels are laid out wrongly.

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

from benchbackend.run import checks
from benchbackend.run.plan import Options
from benchbackend.spec import workload as W
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
    # cifar10 gets a tiny test split: one full batch and a padded one.
    rows = _run(tmp_path, name, "default", **({"test": 40} if name == "cifar10" else {}))
    _assert_parity(rows, name)
    (build,) = _phase(rows, "build")
    assert "target llvm -mcpu=" in build["notes"] and "-num-cores=" in build["notes"]
    assert not _phase(rows, "tune"), "default mode searches nothing"
    inference = _phase(rows, "inference")
    n_test = len(np.load(next(tmp_path.glob(f"{name}-*.npz")))["y_test"])  # the arrays job_arrays wrote
    assert inference and all(r["samples"] == n_test and r["seconds"] > 0 for r in inference)


def _loop_kinds(mod: Any) -> dict[str, set[str]]:
    """Each kernel's loop kinds as TVMScript prints them (``serial``, ``parallel``, ...)."""
    import re

    import tvm

    return {gv.name_hint: set(re.findall(r" in T\.(\w+)\(", f.script()))
            for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}


def test_default_schedule_runs_every_kernel_in_parallel_and_vectorized() -> None:
    # TVM's CPU pipeline schedules nothing (scalar loops on one thread: ResNet-50 took hours):
    # every kernel of a ResNet after our rule has a parallel loop and a vector loop.
    import tvm
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    from benchbackend.backends.tvm.adapter import host_target, relax_module
    from benchbackend.backends.tvm.schedule import schedule_pass

    target = host_target(2)
    with target:
        fused = tvm.transform.Sequential([*cpu.library_dispatch_passes(target),
                                          *cpu.legalize_passes(target)])(relax_module(W.load("resnet8"), 4))
        before = _loop_kinds(fused)  # now: the pass schedules the module's functions in place
        after = _loop_kinds(schedule_pass()(fused))
    assert after.keys() == before.keys() and len(after) >= 10, "conv, pool, mean, dense, softmax kernels"
    assert all(kinds <= {"grid", "serial"} for kinds in before.values()), before
    for name, kinds in after.items():
        assert {"parallel", "vectorized"} <= kinds, (name, kinds)
    assert all("unroll" in kinds for name, kinds in after.items() if "conv" in name), "a register tile"


@pytest.mark.parametrize("name", ["resnet8", "cifar10"])
def test_default_schedule_gives_the_unscheduled_loops_results_bit_for_bit(name: str) -> None:
    # Loops reordered only: each output element sums its reduction in the same order.
    import tvm
    from tvm import relax

    from benchbackend.backends.tvm.adapter import device_params, host_target, relax_module
    from benchbackend.backends.tvm.schedule import default_pipeline
    from benchbackend.spec.model import initial_weights

    w = W.load(name)
    target, dev = host_target(2), tvm.cpu(0)
    x = np.random.default_rng(2).random((4, *w.input_shape), dtype=np.float32)
    params = device_params(initial_weights(w), dev)
    outs = []
    for pipeline in (relax.get_default_pipeline(target), default_pipeline(target)):
        with target:
            vm = relax.VirtualMachine(tvm.compile(relax_module(w, 4), target, relax_pipeline=pipeline), dev)
        outs.append(vm["main"](tvm.runtime.tensor(x, dev), *params).numpy())
    np.testing.assert_array_equal(outs[0], outs[1])


def test_scores_drop_the_padding_of_a_short_last_batch() -> None:
    from benchbackend.backends.numpy import reference
    from benchbackend.backends.tvm.adapter import TVMBackend
    from benchbackend.spec.model import initial_weights

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
    from benchbackend.backends.tvm import adapter as tvm_backend

    real = tvm_backend.device_params

    def swapped_hw(weights: Any, dev: Any) -> list[Any]:  # HWIO read as WHIO: same shape, wrong numbers
        return real([np.swapaxes(k, 0, 1) if k.ndim == 4 else k for k in weights], dev)

    with mock.patch.object(tvm_backend, "device_params", swapped_hw):
        rows = _run(tmp_path, "mnist", "default")
    (parity,) = _phase(rows, "parity")
    tol = W.load("mnist").checks.tolerance("fp32")
    assert checks.parity_mismatch(parity["parity_max_abs"], parity["parity_max_rel"], tol.rtol, tol.atol)


def test_gpu_is_unavailable() -> None:
    from benchbackend.backends.tvm.adapter import TVMBackend
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
    from benchbackend.backends.tvm.adapter import TVMBackend
    from benchbackend.spec.model import initial_weights

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


def test_tuned_kernels_keep_their_searched_schedule_and_the_rest_get_the_rule(tuned_rows: list[dict[str, Any]],
                                                                            cache: Path) -> None:
    # TVM's compile_relax leaves a kernel the database has no record of as scalar loops; ours
    # schedules it with the default rule, and leaves the searched ones as the search wrote them.
    import tvm
    from tvm.relax.backend.cpu_generic import pipeline as cpu
    from tvm.relax.transform import MetaScheduleApplyDatabase
    from tvm.s_tir import meta_schedule as ms

    from benchbackend.backends.tvm.adapter import host_target, relax_module
    from benchbackend.backends.tvm.schedule import schedule_pass

    (folder,) = (cache / "tvm").iterdir()
    database = ms.database.JSONDatabase(str(folder / "workloads.json"), str(folder / "records.json"))
    target = host_target(os.cpu_count() or 1)  # the target the search ran for (the worker's default threads)
    scripts = {}
    for name in ("tiny", "mnist"):  # tiny: the searched network; mnist: kernels the database never saw
        with target, database, tvm.transform.PassContext(opt_level=3):
            mod = tvm.transform.Sequential([*cpu.library_dispatch_passes(target), *cpu.legalize_passes(target),
                                            MetaScheduleApplyDatabase()])(relax_module(_load(name), 32))
            searched = {gv.name_hint: f.script() for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}
            scripts[name] = (searched, {gv.name_hint: f.script() for gv, f in schedule_pass()(mod).functions.items()
                                        if isinstance(f, tvm.tirx.PrimFunc)})
    searched, final = scripts["tiny"]
    assert final == searched and any("T.parallel" in s or "T.vectorized" in s for s in final.values())
    _, final = scripts["mnist"]
    assert all("T.parallel" in s for s in final.values()), "the rule's schedule where the search has none"

"""Apache TVM backend (inference only): forward parity in both modes, the default mode's CPU
schedule (parallel, vectorized, same results as TVM's unscheduled loops), the tuned mode's choices,
the cached tuning database, and a parity check that fails when the kernels are laid out wrongly.

Tuning searches a one-layer network (flatten, dense, softmax: three tasks) with a trial budget of
two and a per-module cache folder, so the search runs once per session, in a worker. ``tuned`` is
never slower than ``default`` by construction, and the tests plant what would break that: a search
that returns scalar kernels it believes take 1 ns (each is measured against the default rule's and
dropped), and a per-task measurement fooled into keeping them (the tuned executable then runs a batch
slower than the default one, which stays).
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
TRIALS = 2  # all to the heaviest task of TINY (under MIN_TRIALS): enough to exercise the search
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
    fresh = {"BENCHBACKEND_CACHE": str(root), "BENCHBACKEND_COMPILE_CACHE": str(root)}  # a search
    with mock.patch.dict(os.environ, fresh):
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
    assert f"searched schedule kept for {summary['searched']} " in tune["notes"]
    assert tune["seconds"] > 0
    # The whole budget went to the task with the largest share of the runtime (under MIN_TRIALS).
    tasks = summary["per_task"]
    (searched,) = [t for t in tasks if t["trials"]]
    # (among the kernels with something to search: an element-wise one can measure larger on a busy machine)
    assert searched["trials"] == TRIALS and searched["share"] == max(t["share"] for t in tasks if t["tunable"])
    assert abs(sum(t["share"] for t in tasks) - 1) < 1e-9
    assert searched["duel_default_s"] > 0 and searched["duel_searched_s"] > 0
    assert searched["chosen"] == ("searched" if searched["duel_searched_s"] < searched["duel_default_s"]
                                  else "default")
    assert len((folder / "search" / "records.json").read_text().splitlines()) == summary["records"]
    chosen = (folder / "records.json").read_text().splitlines()
    assert len(chosen) == summary["searched"], "the database compiled with holds the winners only"
    assert not list((cache / "tvm").glob("*.*")), "no scratch folder is left behind"


def test_a_second_tune_reuses_the_database(tuned_rows: list[dict[str, Any]], cache: Path) -> None:
    from tvm.s_tir import meta_schedule as ms

    from benchbackend.backends.tvm import tuning
    from benchbackend.backends.tvm.adapter import TVMBackend
    from benchbackend.spec.model import initial_weights

    (folder,) = (cache / "tvm").iterdir()
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    w = _load("tiny").with_overrides(limit=256, epochs=1)
    backend = TVMBackend(w, "cpu", "tuned", options={"tune_trials": TRIALS})
    backend.build(initial_weights(w))
    assert backend.database_dir(TRIALS) == folder

    def no_trial(*_: Any, **__: Any) -> None:
        raise AssertionError("a reused database runs no trial")

    with mock.patch.object(tuning, "search", no_trial), mock.patch.object(ms.tune, "tune_tasks", no_trial):
        summary = backend.tune()
    assert summary is not None and summary.startswith(f"reused database {folder}")
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
    # Another budget is another database.
    assert backend.database_dir(TRIALS * 2) != folder
    # --limit and --epochs change nothing the kernels see: the same database; another batch is another.
    other_size = TVMBackend(w.with_overrides(limit=512, epochs=3), "cpu", "tuned")
    assert other_size.database_dir(TRIALS) == folder
    other_batch = TVMBackend(w.with_overrides(batch_size=64), "cpu", "tuned")
    assert other_batch.database_dir(TRIALS) != folder


def test_trials_go_where_the_time_goes() -> None:
    from benchbackend.backends.tvm.tuning import MIN_TRIALS, allocate

    assert allocate([3.0, 1.0, 0.0], 40) == [30, 10, 0]
    assert MIN_TRIALS == 4
    assert allocate([0.5, 0.3, 0.15, 0.05], 64) == [34, 20, 10, 0]
    # A share worth fewer than MIN_TRIALS trials gets none, and the others share the budget.
    assert allocate([0.6, 0.39, 0.01], 20, minimum=4) == [12, 8, 0]
    assert allocate([0.2, 0.5, 0.3], 3, minimum=4) == [0, 3, 0], "under the minimum: all to the largest share"
    for budget in (4, 16, 64, 200):
        assert sum(allocate([0.33, 0.32, 0.16, 0.12, 0.05, 0.01, 0.01], budget)) == budget
    assert allocate([float("inf"), 1.0], 8) == [0, 8], "a kernel that failed to measure is not searched"


def _plant_unscheduled(tasks: Any, trials: Any, _work_dir: Path, _threads: int, _seed: int, database: Any) -> list[int]:
    """A "search" that found each task's kernel unscheduled (scalar loops, one thread) and believed it
    the fastest of all (1 ns): a searched schedule slower than the default rule's."""
    from tvm import s_tir
    from tvm.s_tir import meta_schedule as ms

    for task, n in zip(tasks, trials):
        if n:
            mod = task.dispatched[0]
            sch = s_tir.Schedule(mod)
            sch.get_child_blocks(sch.get_sblock("root"))  # a database keeps no record of an empty trace
            database.commit_tuning_record(ms.database.TuningRecord(
                sch.trace, database.commit_workload(mod), [1e-9], task.target,
                ms.arg_info.ArgInfo.from_entry_func(mod)))
    return [1 if n else 0 for n in trials]


@pytest.fixture
def mnist_tuned(tmp_path: Path) -> Iterator[Any]:
    """mnist's tuned backend, built, under a fresh cache (each test plants its own search). One thread:
    on a busy machine a 2-thread parallel loop stalls at its barriers, and the default rule's conv read 19
    ms against the planted scalar kernel's 10 ms (0.18 against 5.2 quiet); one thread: 0.7 against 8.5."""
    from benchbackend.backends.tvm.adapter import TVMBackend
    from benchbackend.spec.model import initial_weights

    w = W.load("mnist").with_overrides(limit=256)
    fresh = dict.fromkeys(("BENCHBACKEND_CACHE", "BENCHBACKEND_COMPILE_CACHE"), str(tmp_path))
    with mock.patch.dict(os.environ, fresh):
        backend = TVMBackend(w, "cpu", "tuned", options={"tune_trials": 8, "threads": 1})
        backend.build(initial_weights(w))
        yield backend


def test_a_searched_schedule_slower_than_the_default_is_not_kept(mnist_tuned: Any) -> None:
    # The search's own record says 1 ns; measured side by side with the default rule's schedule,
    # the scalar kernel loses, and the database compiled with holds nothing for it.
    from benchbackend.backends.tvm import tuning

    default_vm = mnist_tuned._vm
    with mock.patch.object(tuning, "search", _plant_unscheduled):
        notes = mnist_tuned.tune()
    folder = mnist_tuned.database_dir(8)
    summary = json.loads((folder / "summary.json").read_text())
    planted = [t for t in summary["per_task"] if t["trials"]]
    assert planted, summary
    for t in planted:  # the rule, task by task: a searched schedule is kept only where it measured faster
        assert (t["chosen"] == "searched") == (t["duel_searched_s"] < t["duel_default_s"]), t
    # The largest kernel's scalar loops lose by far (5.2 ms against 0.37 ms measured, one thread): the default
    # stays. A tiny kernel's duel can go either way on a busy machine (a parallel test run saw one), by the same rule.
    biggest = max(planted, key=lambda t: t["duel_default_s"])
    assert biggest["chosen"] == "default", planted
    kept = sum(t["chosen"] == "searched" for t in planted)
    assert summary["searched"] == kept and bool((folder / "records.json").read_text().strip()) == bool(kept)
    if not kept:
        assert notes.endswith("every kernel keeps the default schedule, as tvm:default"), notes
    assert mnist_tuned._vm is default_vm


def test_a_tuned_module_slower_than_the_default_is_not_kept(mnist_tuned: Any) -> None:
    # Past the per-task choice (here fooled: the measurement says the planted scalar kernels win),
    # the tuned executable is compiled with them, runs a batch slower than the default one, and the
    # default executable stays.
    from benchbackend.backends.tvm import tuning

    real = tuning.measure

    def searched_wins(mods: Any, target: Any, threads: int, repeats: int = 1) -> list[float]:
        secs = real(mods, target, threads, repeats)
        if repeats == 1:  # the shares, before the search
            return secs
        return [1.0 if k % 2 == 0 else 0.5 for k in range(len(mods))]  # (default, searched) pairs

    default_vm = mnist_tuned._vm
    with mock.patch.object(tuning, "search", _plant_unscheduled), mock.patch.object(tuning, "measure", searched_wins):
        notes = mnist_tuned.tune()
    summary = json.loads((mnist_tuned.database_dir(8) / "summary.json").read_text())
    assert summary["searched"] > 0 and f"kept for {summary['searched']} " in notes
    assert notes.endswith("default executable kept"), notes
    assert mnist_tuned._vm is default_vm


def test_the_kept_searched_schedules_are_compiled_and_the_rest_get_the_rule(tmp_path: Path) -> None:
    # TVM's compile_relax leaves a kernel the database has no record of as scalar loops; ours
    # schedules it with the default rule, and leaves a kept searched one as the search wrote it.
    import tvm
    from tvm.relax.transform import MetaScheduleApplyDatabase
    from tvm.s_tir import meta_schedule as ms

    from benchbackend.backends.tvm import tuning
    from benchbackend.backends.tvm.adapter import host_target, relax_module
    from benchbackend.backends.tvm.schedule import schedule_pass

    target = host_target(2)
    mod = relax_module(W.load("mnist"), 32)
    tasks = ms.relax_integration.extract_tasks(tuning.fused_module(mod, target), target)
    conv = next(t for t in tasks if "conv" in t.task_name)
    database = ms.database.JSONDatabase(str(tmp_path / "w.json"), str(tmp_path / "r.json"))
    _plant_unscheduled([conv], [1], tmp_path, 2, 0, database)
    with target, database, tvm.transform.PassContext(opt_level=3):
        final = schedule_pass()(MetaScheduleApplyDatabase()(tuning.fused_module(mod, target)))
    scripts = {gv.name_hint: f.script() for gv, f in final.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}
    assert conv.task_name in scripts and len(scripts) > 2
    for name, script in scripts.items():
        assert ("T.parallel" in script) == (name != conv.task_name), name


def test_the_searched_register_tiles_give_the_default_rules_results_bit_for_bit() -> None:
    # The search varies only the register tile's sizes: loops reordered, each output element still
    # sums its reduction in the same order as the default rule's kernel (and TVM's plain loops).
    import tvm
    from tvm import s_tir
    from tvm.s_tir import meta_schedule as ms

    from benchbackend.backends.tvm import tuning
    from benchbackend.backends.tvm.adapter import host_target, relax_module
    from benchbackend.backends.tvm.schedule import schedule_loops

    target, dev = host_target(2), tvm.cpu(0)
    mod = relax_module(W.load("mnist"), 32)
    every = ms.relax_integration.extract_tasks(tuning.fused_module(mod, target), target)
    tasks = [t for t in every if "conv" in t.task_name or "matmul" in t.task_name]
    assert len(tasks) >= 3 and all(tuning.tunable(t, target) for t in tasks)
    # A kernel with no register tile (a reshape; a softmax's row reductions) has one schedule: no
    # trial goes to it.
    others = [t for t in every if t.task_name in ("reshape", "softmax")]
    assert others and not any(tuning.tunable(t, target) for t in others)
    rng = np.random.default_rng(0)
    for task in tasks:
        args = [np.asarray(rng.standard_normal([int(d) for d in a.shape]), np.float32)
                for a in ms.arg_info.ArgInfo.from_entry_func(task.dispatched[0])]

        def run(scheduled: tvm.IRModule) -> np.ndarray:
            tensors = [tvm.runtime.tensor(a, dev) for a in args]
            tvm.tirx.build(scheduled, target=target)["main"](*tensors)
            return tensors[-1].numpy()

        expected = run(tuning.default_schedule(task, target))
        tiles = set()
        for seed in range(1, 5):
            sch = s_tir.Schedule(task.dispatched[0], seed=seed)
            assert schedule_loops(sch, target, tunable=True)
            tiles.add(str(sch.trace.decisions))
            np.testing.assert_array_equal(run(sch.mod), expected, err_msg=f"{task.task_name} seed {seed}")
        assert len(tiles) > 1 or "matmul" in task.task_name, f"{task.task_name}: the tile sizes are not sampled"

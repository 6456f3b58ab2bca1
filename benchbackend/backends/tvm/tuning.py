"""``tvm:tuned``'s search: MetaSchedule where the time goes, and a searched schedule only where it wins.

One ``search`` call, per module (``tune``):

1. **Tasks and their share.** MetaSchedule's tasks are the fused kernels. Each is scheduled with the
   default rule (``schedule.CPUDefault``) and measured with MetaSchedule's own builder and runner; its
   share of the runtime is that time x its weight (how often the module calls it).
2. **The budget where the time goes.** Trials go to the tasks in proportion to their share (largest
   remainder), a task that would get fewer than ``MIN_TRIALS`` gets none and its share goes to the
   others; each task is then searched with its own budget (``tune_tasks`` on that task alone, one
   cost model shared across the tasks), in ``rule_space``: the default rule with the sizes of its
   register tile left to the search. MetaSchedule's gradient scheduler cannot do this at small
   budgets: it first gives every task a round of ``num_trials_per_iter`` (round-robin warm-up), so
   at 16-64 trials over cifar10's 10 tasks, a 1% softmax got as many trials as a 33% convolution,
   and nothing was left for its gradient to spend.
3. **Keep the best, per task.** The best searched schedule of each task and the default rule's are
   measured again side by side, by the same runner. The searched one enters the database the module
   is compiled with only where it measured faster; every other kernel gets the rule at compile time
   (``schedule.default_pipeline``). So each kernel of ``tuned`` is the faster of the two measured.

The database (the winners), the search's own database (every trial) and ``summary.json`` (the
per-task shares, trials, times and choices) are written into a scratch folder that is renamed into
place at the end, so an interrupted search never leaves a folder a later run would take as complete.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import tvm
from tvm import s_tir
from tvm.ir.utils import derived_object
from tvm.relax.backend.cpu_generic import pipeline as cpu
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.builder.local_builder import _serialize_params, _worker_func
from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

from .schedule import CPUDefault, schedule_loops

#: The fewest trials worth a task's search: below it, its share goes to the heavier tasks.
MIN_TRIALS = 4
#: Measured trials (over all tasks) before the XGBoost cost model's predictions replace random ones.
WARMUP_SAMPLES = 16
#: Repeats of each side-by-side measurement (each one of the runner's timed loops, >= 100 ms).
DUEL_REPEATS = 3
#: Chosen schedule per task, as summary.json and the row's notes write it.
SEARCHED, DEFAULT = "searched", "default"


@dataclass
class TaskResult:
    """One task's line of summary.json."""

    name: str
    weight: int
    default_s: float  # the default rule's kernel time, before the search (its share of the runtime)
    share: float
    trials: int = 0  # the budget it was given
    measured: int = 0  # trials measured (a search stops early when its space runs out)
    duel_default_s: Optional[float] = None  # the side-by-side measurement
    duel_searched_s: Optional[float] = None
    tunable: bool = True  # its space holds more than one schedule (else it gets no trials)
    chosen: str = DEFAULT


def fused_module(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """The module as ``schedule.default_pipeline`` has it when it applies the database: legalized and
    fused by the CPU backend's passes, so the tasks' workloads are the kernels that get compiled."""
    with target:
        return tvm.transform.Sequential([*cpu.library_dispatch_passes(target), *cpu.legalize_passes(target)])(mod)


def default_schedule(task: Any, target: tvm.target.Target) -> tvm.IRModule:
    """The task's kernel under the default rule (unchanged where the rule reads no loop nest)."""
    mod = task.dispatched[0]
    sch = CPUDefault().apply(mod["main"], target, False)
    return mod if sch is None else sch.mod


def measure(mods: Sequence[tvm.IRModule], target: tvm.target.Target, threads: int,
            repeats: int = 1) -> list[float]:
    """Seconds per call of each module's ``main``: MetaSchedule's builder and runner, as its trials are
    measured (median of ``repeats`` timed loops); ``inf`` where it does not build or run."""
    if not mods:
        return []
    builder = PooledBuilder(threads)
    runner = local_runner(ms.runner.EvaluatorConfig(repeat=repeats))
    built = builder.build([ms.builder.BuilderInput(m, target) for m in mods])
    ok = [i for i, b in enumerate(built) if b.error_msg is None]
    futures = runner.run([ms.runner.RunnerInput(built[i].artifact_path, "cpu",
                                                ms.arg_info.ArgInfo.from_entry_func(mods[i])) for i in ok])
    secs = [float("inf")] * len(mods)
    for i, future in zip(ok, futures):
        result = future.result()
        if result.error_msg is None and result.run_secs:
            secs[i] = statistics.median(float(s) for s in result.run_secs)
    return secs


#: Seconds a kernel's build may take (LocalBuilder's default).
BUILD_TIMEOUT_S = 30.0
_POOLS: dict[int, Any] = {}


@derived_object
class PooledBuilder(ms.builder.PyBuilder):
    """MetaSchedule's ``LocalBuilder`` (``build_trial`` in worker processes), on one pool of workers
    kept for the process. ``LocalBuilder`` starts a pool of fresh Pythons that import TVM (2.5 s each
    here) for every ``build`` call and one more in its constructor: a search of 2 trials started
    seven pools, most of a 23 s search on two cores. TVM restarts its pools against a leak in
    long-lived workers; here a worker is replaced after ``maximum_process_uses`` builds."""

    def __init__(self, workers: int):
        super().__init__()
        self.workers = workers

    def build(self, build_inputs: list[Any]) -> list[Any]:
        if self.workers not in _POOLS:
            _POOLS[self.workers] = PopenPoolExecutor(max_workers=self.workers, timeout=BUILD_TIMEOUT_S,
                                                     maximum_process_uses=64)
        jobs = [(build_trial, None, b.mod, b.target, _serialize_params(b.params)) for b in build_inputs]
        results = []
        for done in _POOLS[self.workers].map_with_error_catching(lambda job: _worker_func(*job), jobs):
            if done.status == StatusKind.COMPLETE:
                results.append(ms.builder.BuilderResult(done.value, None))
            elif done.status == StatusKind.TIMEOUT:
                results.append(ms.builder.BuilderResult(None, f"build timed out after {BUILD_TIMEOUT_S:g} s"))
            else:
                results.append(ms.builder.BuilderResult(None, f"build failed: {done.value}"))
        return results


_RUNNERS: dict[Optional[str], Any] = {}


def local_runner(config: Any) -> Any:
    """MetaSchedule's ``LocalRunner``, one per process and thread count, set to time with ``config``.

    Its pool's worker is a fresh Python that imports TVM (2.5 s here) and reads ``TVM_NUM_THREADS``
    (which the adapter sets) when it starts: a runner per measurement paid that three times a search.
    MetaSchedule itself keeps one runner for a whole search; the timing loop is read per call."""
    key = os.environ.get("TVM_NUM_THREADS")
    if key not in _RUNNERS:
        _RUNNERS[key] = ms.runner.LocalRunner()
    runner = _RUNNERS[key]
    runner.evaluator_config = config
    return runner


def allocate(shares: Sequence[float], budget: int, minimum: int = MIN_TRIALS) -> list[int]:
    """Trials per task in proportion to its share of the runtime (largest remainder). A task whose
    part falls under ``minimum`` gets none, and the others share the budget; when the budget is under
    ``minimum``, all of it goes to the largest share."""
    trials = [0] * len(shares)
    alive = [i for i, s in enumerate(shares) if s > 0 and s != float("inf")]
    if not alive or budget <= 0:
        return trials
    if budget < minimum:
        trials[max(alive, key=lambda i: shares[i])] = budget
        return trials
    while True:  # the smallest share out, one at a time, until every part reaches the minimum
        total = sum(shares[i] for i in alive)
        exact = {i: budget * shares[i] / total for i in alive}
        if min(exact.values()) >= minimum:
            break
        alive.remove(min(alive, key=lambda i: shares[i]))
    parts = {i: int(exact[i]) for i in alive}
    for i in sorted(alive, key=lambda i: exact[i] - parts[i], reverse=True)[: budget - sum(parts.values())]:
        parts[i] += 1
    for i, n in parts.items():
        trials[i] = n
    return trials


@contextlib.contextmanager
def no_tensor_intrinsics() -> Iterator[None]:
    """MetaSchedule's ``TuneContext`` imports ``tvm.s_tir.tensor_intrin``, which parses every vendor's
    tensor intrinsics: 18 s of a 43 s two-trial search measured here (py-spy), paid once per process.
    ``rule_space`` tensorizes nothing, so while a search builds its contexts that import finds an empty
    module; the name is released afterwards, and a later real import loads the real one."""
    name = "tvm.s_tir.tensor_intrin"
    if name in sys.modules:
        yield
        return
    stub = sys.modules[name] = types.ModuleType(name)
    try:
        yield
    finally:
        if sys.modules.get(name) is stub:
            del sys.modules[name]


def search(tasks: Sequence[Any], trials: Sequence[int], work_dir: Path, threads: int, seed: int,
           database: Any) -> list[int]:
    """MetaSchedule's evolutionary search of each task with its own budget, into ``database``; the
    trials measured per task."""
    with no_tensor_intrinsics():
        return _search(tasks, trials, work_dir, threads, seed, database)


def _search(tasks: Sequence[Any], trials: Sequence[int], work_dir: Path, threads: int, seed: int,
            database: Any) -> list[int]:
    # XGBoost's model predicts at random until it holds num_warmup_samples (100 by default): at
    # these budgets it never would, and its training (~12 s a round here) bought nothing.
    cost_model = (ms.cost_model.XGBModel(num_tuning_cores=threads, num_warmup_samples=WARMUP_SAMPLES)
                  if _has_xgboost() else ms.cost_model.RandomModel())
    builder = PooledBuilder(threads)
    runner = local_runner(ms.runner.EvaluatorConfig())
    measured = [0] * len(tasks)
    for i, (task, n) in enumerate(zip(tasks, trials)):
        if n <= 0:
            continue
        # The evolutionary search's population scales with the budget (512 is TVM's default): a
        # population of 512 costs minutes on two cores for a handful of trials.
        strategy = ms.search_strategy.EvolutionarySearch(population_size=min(512, max(32, 8 * n)))
        (context,), (weight,) = ms.relax_integration.extracted_tasks_to_tune_contexts(
            [task], work_dir=str(work_dir), space=rule_space(task.target), strategy=strategy, num_threads=threads,
            seed=seed + i)
        before = len(database)
        # Two rounds (of at most 32): the cost model learns from the first before the second; each
        # round costs a population's evolution and a builder pool's start.
        ms.tune.tune_tasks(tasks=[context], task_weights=[weight], work_dir=str(work_dir), builder=builder,
                           runner=runner, max_trials_global=n, max_trials_per_task=n,
                           num_trials_per_iter=min(32, max(MIN_TRIALS, -(-n // 2))), database=database,
                           cost_model=cost_model)
        measured[i] = len(database) - before  # its records: the tasks are searched one at a time
    return measured


def best_searched(database: Any, task: Any, target: tvm.target.Target) -> Optional[tvm.IRModule]:
    """The task's kernel under its best searched schedule, or ``None`` when the search has none."""
    sch = database.query_schedule(task.dispatched[0], target, task.task_name)
    return None if sch is None else sch.mod


def keep_best(tasks: Sequence[Any], results: Sequence[TaskResult], searched_db: Any, chosen_db: Any,
              target: tvm.target.Target, threads: int) -> None:
    """Each task's best searched schedule against the default rule's, measured side by side; the
    searched one's record goes into ``chosen_db`` only where it measured faster."""
    pairs = []
    for task, result in zip(tasks, results):
        candidate = best_searched(searched_db, task, target)
        if candidate is not None:
            pairs.append((task, result, candidate))
    mods = [m for task, _, candidate in pairs for m in (default_schedule(task, target), candidate)]
    secs = measure(mods, target, threads, repeats=DUEL_REPEATS)
    for k, (task, result, _) in enumerate(pairs):
        result.duel_default_s, result.duel_searched_s = secs[2 * k], secs[2 * k + 1]
        if result.duel_searched_s < result.duel_default_s:
            result.chosen = SEARCHED
            record = searched_db.query_tuning_record(task.dispatched[0], target, task.task_name)
            workload = chosen_db.commit_workload(task.dispatched[0])
            chosen_db.commit_tuning_record(ms.database.TuningRecord(
                record.trace, workload, [result.duel_searched_s], target, record.args_info))


def tune(mod: tvm.IRModule, target: tvm.target.Target, folder: Path, budget: int, threads: int,
         seed: int) -> dict[str, Any]:
    """Search ``mod``'s kernels and write the chosen schedules' database and ``summary.json`` to
    ``folder`` (see the module's docstring); the summary."""
    started = time.perf_counter()
    tasks = ms.relax_integration.extract_tasks(fused_module(mod, target), target)
    defaults = measure([default_schedule(t, target) for t in tasks], target, threads)
    shares = [s * t.weight for s, t in zip(defaults, tasks)]
    total = sum(s for s in shares if s != float("inf")) or 1.0
    # A kernel whose space holds one schedule (no register tile: element-wise, a reshape, a softmax) has
    # nothing to search: its share goes to the others.
    able = [tunable(t, target) for t in tasks]
    trials = allocate([share if a else 0.0 for a, share in zip(able, shares)], budget)
    results = [TaskResult(t.task_name, int(t.weight), s, share / total, n, tunable=a)
               for t, s, share, n, a in zip(tasks, defaults, shares, trials, able)]
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        (scratch / "search").mkdir()
        searched_db = ms.database.JSONDatabase(str(scratch / "search" / "workloads.json"),
                                               str(scratch / "search" / "records.json"))
        chosen_db = ms.database.JSONDatabase(str(scratch / "workloads.json"), str(scratch / "records.json"))
        if any(trials):
            for result, n in zip(results, search(tasks, trials, scratch / "search", threads, seed, searched_db)):
                result.measured = n
            keep_best(tasks, results, searched_db, chosen_db, target, threads)
        summary = {"trials": budget, "tasks": len(tasks), "records": sum(r.measured for r in results),
                   "searched": sum(r.chosen == SEARCHED for r in results),
                   "seconds": time.perf_counter() - started, "cost_model": "xgb" if _has_xgboost() else "random",
                   "target": str(target), "tvm": tvm.__version__, "per_task": [asdict(r) for r in results]}
        (scratch / "summary.json").write_text(json.dumps(summary, indent=1))
        shutil.rmtree(scratch / "search" / "logs", ignore_errors=True)
        if folder.exists():  # a concurrent run finished first; theirs is as good
            shutil.rmtree(scratch)
        else:
            scratch.rename(folder)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return summary


def chosen_database(folder: Path) -> Any:
    """The database ``tune`` wrote into ``folder``: the searched schedules that won."""
    return ms.database.JSONDatabase(str(folder / "workloads.json"), str(folder / "records.json"),
                                    allow_missing=False)


def tunable(task: Any, target: tvm.target.Target) -> bool:
    """Whether ``rule_space`` holds more than one schedule of the task's kernel (any decision)."""
    sch = s_tir.Schedule(task.dispatched[0])
    return schedule_loops(sch, target, tunable=True) and bool(sch.trace.decisions)


def rule_space(target: tvm.target.Target) -> Any:
    """The search space: the default rule with its register tile's sizes left to the search
    (``schedule.schedule_loops(tunable=True)``), varied by MetaSchedule's tile-size mutator.

    MetaSchedule's own CPU space (multi-level tiling, inlining, parallel/vectorize/unroll rules)
    lost to the rule on every task at 16 and 64 trials on cifar10 (docs/tvm.md): its random start
    needs thousands of trials to reach a schedule the rule writes directly.
    """
    def space(sch: Any) -> None:
        schedule_loops(sch, target, tunable=True)

    return ms.space_generator.ScheduleFn(space, sch_rules=[], postprocs=[],
                                         mutator_probs={ms.mutator.MutateTileSize(): 1.0})


def build_trial(mod: tvm.IRModule, target: tvm.target.Target, params: Any) -> Any:
    """MetaSchedule's default trial build, without its ``import tvm.s_tir.tensor_intrin``.

    That import parses every vendor's tensor intrinsics (tens of seconds) in each fresh builder
    process (MetaSchedule starts one per round), which runs past the builder's 30 s timeout on a
    busy machine, so every trial fails. Trials arrive already scheduled (tensorized or not), so
    building them needs no intrinsic registry.
    """
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    return tvm.tirx.build(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod), target=target)


def _has_xgboost() -> bool:
    return importlib.util.find_spec("xgboost") is not None

"""Drives a plan: prepares the data, hands the cells to an executor, records what comes back.

The runner consumes the executor's typed messages (``messages``), one cell at a time: each row is
written to the CSV the moment it arrives, as ``pending``; when the cell ends, ``checks`` decides
its status and the cell's ``run`` row carries it (``results.CsvWriter``). A crash, a timeout,
Ctrl-C (``interrupted``, only for the cells that were running) or a parent killed outright loses
nothing already measured, and never leaves a partial cell marked ``ok``.
"""
from __future__ import annotations

import contextlib
import signal
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence

from .. import results
from ..analysis.busy import busy_note
from ..backends import registry as backends
from ..backends.spec import BackendSpec
from ..data import arrays
from ..spec import model, replicas
from ..spec.workload import Workload
from . import checks, peaks, progress, resume
from .launch import Job
from .messages import Ended, Heartbeat, Info, Message, Outcome, Peak, Row, Started
from .plan import Cell, Choice, GroupId, Options, RunPlan, cells


class Terminated(KeyboardInterrupt):
    """SIGTERM during a run (see :func:`sigterm_interrupts`): handled as Ctrl-C is."""


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (``kill``, a scheduler's stop, a container's shutdown) ends a run as Ctrl-C does: the
    running cell's worker is killed, its rows are marked ``interrupted`` and the file is finalized.
    Python's default would exit at once, leaving the worker running on and its rows ``pending``."""
    def stop(signum: int, frame: object) -> None:
        raise Terminated("SIGTERM")

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread (a caller's thread): leave SIGTERM alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class CellResult:
    """What the end-of-run summary says of one cell (``progress.summary_line``)."""

    cell: Cell
    device: str
    status: str = results.PENDING
    message: str = ""
    epoch_seconds: list[float] = field(default_factory=list)
    val_accuracy: Optional[float] = None
    inference_seconds: list[float] = field(default_factory=list)
    #: The cell generates (``--generate``): its summary line gives its generation figures.
    generates: bool = False
    #: ``--scenario``: the line (``progress.scenario_line``) of its LoadGen run that the summary gives:
    #: the last one, or in a peak search (``--slo-ms``) the peak, the highest rate found valid.
    scenario: str = ""
    peak_qps: Optional[float] = None

    @property
    def backend(self) -> str:
        return self.cell.choice.backend

    @property
    def repeat(self) -> int:
        return self.cell.repeat


@dataclass(frozen=True)
class Task:
    """One cell for an executor: the worker's job, the backend's registry entry, and what the job's
    arrays are (their checksum, ``arrays.checksum``; their source: ``synthetic`` can be made anywhere)."""

    cell: Cell
    job: Job
    spec: BackendSpec
    data_sha256: str = ""
    data_source: str = ""


class Executor(Protocol):
    #: Whether cells run on other machines (then whether a backend is installed shows on the node).
    remote: bool

    def run(self, tasks: Sequence[Task]) -> Iterator[Message]:
        """Run the tasks (in their order, where it can) and yield every message of every cell."""
        ...


def definition(w: Workload, source: str) -> str:
    """What defines the measured work, readably (``workload_hash`` is its digest): compare labels
    groups of one workload by the fields that differ."""
    d, t = w.data, w.training
    target = f" target_acc={w.checks.target_accuracy:g}" if w.checks.target_accuracy is not None else ""
    g = w.generation  # set by --generate (or the YAML): what a generation measures
    generate = "" if g is None else (f" prompt={','.join(map(str, g.prompt_tokens))} new_tokens={g.new_tokens} "
                                     f"gen_batch={g.batch_size} passes={g.passes} cache={g.cache}")
    lg = w.loadgen  # set by --scenario (or the YAML): what a LoadGen run measures
    scenario = "" if lg is None or not lg.scenario else (
        f" scenario={lg.scenario} min_duration={lg.min_duration_s:g}s min_queries={lg.queries(lg.scenario)}"
        + {"multi-stream": f" samples_per_query={lg.multistream_samples}",
           "server": f" latency_bound={lg.server_latency_ms:g}ms" + (f" slo={lg.slo_ms:g}ms" if lg.slo_ms else "")
           + (f" target_qps={lg.server_target_qps:g}" if lg.server_target_qps else "")}.get(lg.scenario, ""))
    return (f"train={d.train} val={d.validation} test={d.test} epochs={t.epochs} batch={t.batch_size} "
            f"infer_batch={w.inference.batch_size} seed={w.seed} data={source}{target}{generate}{scenario}")


def _quality(w: Workload) -> dict[str, Any]:
    """The quality gate's declaration, on every row (``analysis.quality`` judges it when the run
    ends): metric, target and the validation samples (tokens, for a language model) it reads."""
    tokens = w.input_shape[0] if w.next_token else 1
    return {"quality_metric": w.quality.metric, "quality_target": w.quality.text(),
            "quality_samples": w.data.validation * tokens}


@dataclass
class _Open:
    """A running cell: the columns every row of it carries, its rows so far, its peak's cache key."""

    result: CellResult
    base: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    peak_key: str = ""
    #: None until a row showed the peak too low; then whether the cached probe was dropped.
    peak_dropped: Optional[bool] = None


class Runner:
    """Runs a :class:`RunPlan` through ``executor``, writing rows with ``writer`` and telling ``display``."""

    def __init__(self, plan: RunPlan, executor: Executor, writer: results.CsvWriter,
                 display: Optional[progress.Display] = None, previous: Optional[resume.Previous] = None,
                 ready: Optional[Callable[[], None]] = None):
        self.plan, self.executor, self.writer = plan, executor, writer
        #: Called once the data is ready and before the first cell (``run`` looks at the machine then).
        self.ready = ready
        #: ``run --resume``: the file's finished cells are not run again (``writer`` appends to that file);
        #: ``resumed`` holds the statuses of the plan's cells that had finished.
        self.previous = previous
        self.resumed: list[str] = []
        self.display = display or progress.Display()
        self.run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
        self.env = results.environment()
        self.results: list[CellResult] = []
        self.sources: dict[str, str] = {}
        self.checksums: dict[str, str] = {}  # of each workload's arrays (``arrays.checksum``)
        self.open: dict[int, _Open] = {}
        self.attempts: dict[int, int] = {}  # cell order -> attempts started (``--retries`` runs one again)
        self.niced: set[str] = set()  # the hosts whose cells run at a niceness Ray gave them, said once
        self.waiting: dict[GroupId, int] = {}

    def run(self) -> list[CellResult]:
        with tempfile.TemporaryDirectory(prefix="benchbackend-") as tmp:
            # All data first: a missing file fails the run before anything is measured.
            files = {w.hash(): self._prepare(w, Path(tmp)) for w in self.plan.workloads}
            tasks, refused = self._tasks(files)
            if self.previous is not None:
                self._resume(tasks, refused)
            if self.ready is not None and tasks:
                self.ready()
            self.display.begin([t.cell for t in tasks] + [cell for cell, _ in refused])
            try:
                for message in [m for cell, why in refused for m in self._refusal(cell, why)]:
                    self.handle(message)
                for message in self.executor.run(tasks):
                    self.handle(message)
            except KeyboardInterrupt as exc:
                why = "SIGTERM" if isinstance(exc, Terminated) else "Ctrl-C"
                self.display.interrupted()
                for state in list(self.open.values()):
                    self._end(state, Outcome("interrupted", f"stopped by {why} while this cell ran"))
                raise
            finally:
                self.writer.close()
                self.display.close()
        return self.results

    # --- the plan ---------------------------------------------------------------------------
    def _prepare(self, w: Workload, tmp: Path) -> Path:
        """The run's arrays and per-epoch orders, once per workload: every backend gets these."""
        path = tmp / f"{w.name}-{w.hash()}.npz"
        made = arrays.prepare(w, self.plan.data_source, self.plan.data_dir, path, progress=self._download_progress)
        self.sources[w.hash()], self.checksums[w.hash()] = made.source, made.sha256
        train, val, test = made.sizes
        self.display.note(f"[{w.name}] {made.source} data: {train} train, {val} validation, {test} test")
        return path

    def _download_progress(self, name: str, done: int, total: int) -> None:
        if total and (done == total or done % (8 << 20) < 65536):
            self.display.note(f"  downloading {name}: {done / total:.0%} of {total / 1e6:.1f} MB")

    def _tasks(self, files: dict[str, Path]) -> tuple[list[Task], list[tuple[Cell, str]]]:
        """The cells to run, and the groups that cannot run here (their first cell, and why)."""
        tasks, refused, seen = [], [], set()
        for cell in cells(self.plan):
            ended = self.previous.finished.get(self._key(cell)) if self.previous is not None else None
            if ended is not None:
                self.resumed.append(ended)
                continue
            spec = backends.get(cell.choice.backend)
            # On a cluster, whether a node has the backend shows in its worker's own `unavailable` row.
            why = cell.choice.problem or ("" if self.executor.remote else backends.problem(spec))
            if why:
                if cell.group not in seen:
                    refused.append((cell, why if cell.choice.problem else f"not installed ({why}): {spec.install}"))
                seen.add(cell.group)
                continue
            job = Job.for_spec(spec, cell.workload, mode=cell.choice.mode, precision=cell.choice.precision,
                               device=self.plan.device, repeat=cell.repeat, data=str(files[cell.workload.hash()]),
                               trains=not self.plan.inference_only, parity_steps=self.plan.parity_steps,
                               generate=self.plan.generate, options=self._options(cell.choice))
            digest = cell.workload.hash()
            tasks.append(Task(cell, job, spec, self.checksums[digest], self.sources[digest]))
            self.waiting[cell.group] = self.waiting.get(cell.group, 0) + 1
        return tasks, refused

    def _options(self, choice: Choice) -> Options:
        """The run's options for a cell: its threads (``--threads``, a sweep), split between its
        replicas (``replicas``), and where LoadGen's logs go (``--scenario``: ``<csv stem>-loadgen``)."""
        n, threads = choice.replicas, choice.threads or self.plan.options.threads
        logs = str(self.writer.path.with_name(self.writer.path.stem + "-loadgen").resolve())
        return replace(self.plan.options, replicas=n, threads=replicas.threads_per_replica(threads, n),
                       loadgen_dir=logs)

    def _key(self, cell: Cell) -> resume.CellKey:
        c, w = cell.choice, cell.workload
        threads = self._options(c).threads if c.threads else None  # each replica's, as the rows record them
        return resume.CellKey(w.hash(), self.sources[w.hash()], c.backend, c.mode, c.precision, self.plan.device,
                              self._inference_only(c.backend), cell.repeat, c.replicas,
                              f"{threads:g}" if threads else "")

    def _inference_only(self, backend: str) -> bool:
        return self.plan.inference_only or not backends.get(backend).trains

    def _resume(self, tasks: list[Task], refused: list[tuple[Cell, str]]) -> None:
        """Drop from the resumed file the rows of the unfinished cells about to run again; append after the rest."""
        assert self.previous is not None
        again = {self._key(t.cell) for t in tasks} | {self._key(cell) for cell, _ in refused}
        self.writer.adopt(resume.prune(self.writer.path, again))
        planned = len(cells(self.plan))
        rest = "nothing left to run" if len(self.resumed) == planned else "running the rest"
        self.display.announce(f"resuming {self.writer.path}: {len(self.resumed)} of {planned} cells had finished; "
                              f"{rest}")

    @staticmethod
    def _refusal(cell: Cell, why: str) -> list[Message]:
        return [Started(cell), Ended(cell, Outcome("unavailable", why))]

    # --- messages ---------------------------------------------------------------------------
    def handle(self, message: Message) -> None:
        """One message of the executor, as it arrives."""
        if isinstance(message, Started):
            self._start(message)
            return
        state = self.open[message.cell.order]
        if isinstance(message, Info):
            state.base.update(message.columns())
            state.result.device = message.device
            self.display.note(f"{progress.tag(message.cell)} {message.cell.choice.backend} {message.backend_version} "
                              f"on {message.device} ({message.threads} threads)")
        elif isinstance(message, Peak):
            state.base.update(peak_flops=message.flops, peak_source=message.source)
            state.peak_key = message.cache_key
            self.display.note(f"{progress.tag(message.cell)} peak {message.flops / 1e12:.3g} TFLOP/s "
                              f"({message.source})")
        elif isinstance(message, Row):
            self._row(state, dict(message.fields))
        elif isinstance(message, Heartbeat):
            self.display.note(f"{progress.tag(message.cell)} still running ({message.seconds:.0f}s)")
        elif isinstance(message, Ended):
            self._end(state, message.outcome)

    def _start(self, message: Started) -> None:
        cell, w = message.cell, message.cell.workload
        c = cell.choice
        source = self.sources.get(w.hash(), "")
        attempt = self.attempts[cell.order] = self.attempts.get(cell.order, 0) + 1
        base = {"run_id": self.run_id, "cell_order": cell.order, "attempt": attempt, "workload": w.name,
                "workload_hash": w.hash(), "backend": c.backend, "mode": c.mode, "precision": c.precision,
                "device": self.plan.device, "repeat": cell.repeat, "data_origin": "local", **self.env,
                **message.environment, "flops_per_sample": model.flops_per_sample(w), "params": model.param_count(w),
                "requested_device": self.plan.device, "data_source": source,
                "data_sha256": self.checksums.get(w.hash(), ""), "inference_only": self._inference_only(c.backend),
                "definition": definition(w, source), "limit": w.data.train, "epochs": w.training.epochs,
                "batch_size": w.training.batch_size, "inference_batch_size": w.inference.batch_size, "seed": w.seed,
                "replicas": c.replicas, "threads": self._options(c).threads, "scale_lr": self.plan.options.scale_lr,
                "scaling": self.plan.options.scaling if c.replicas > 1 else "strong",
                "peak_datasheet_flops": self.plan.options.peak_tflops * 1e12 if self.plan.options.peak_tflops else None,
                "scenario": w.loadgen.scenario if w.loadgen is not None else None, **_quality(w)}
        self.open[cell.order] = _Open(CellResult(cell, self.plan.device, generates=self.plan.generate), base)
        if attempt == 1:
            self.display.cell_started(cell)
        where = f" on {message.environment['host']}" if message.environment.get("host") else ""
        nice = message.environment.get("nice")
        if nice and where not in self.niced:
            self.niced.add(where)
            self.display.announce(f"warning: cells{where} run at niceness {nice} (Ray's worker_niceness), behind "
                                  "every process of normal priority there: start that Ray node with "
                                  "RAY_worker_niceness=0, or run as a user who may lower a niceness")
        again = f" (attempt {attempt})" if attempt > 1 else ""
        self.display.note(f"{progress.tag(cell)} starting worker{where}{again}")

    def _row(self, state: _Open, row: dict[str, Any]) -> None:
        cell = state.result.cell
        if row.get("losses") is not None:
            row = checks.trajectory(row, cell.workload, cell.choice.precision)
        done = peaks.achieved(row.get("phase"), row.get("samples_per_s"), state.base["flops_per_sample"])
        if done is not None:
            b = state.base
            row.update(achieved_flops=done, **results.mfu_values(done, b.get("peak_flops"), b.get("peak_source", ""),
                                                                 cell.choice.precision, b.get("peak_datasheet_flops")))
            if b.get("peak_flops") and done > b["peak_flops"]:
                self._peak_too_low(state, done / b["peak_flops"])
        for key in ("loadgen_log", "accuracy_log"):  # beside the CSV: named from its folder, to move together
            if row.get(key):
                with contextlib.suppress(ValueError):
                    row[key] = str(Path(row[key]).relative_to(self.writer.path.resolve().parent))
        if cell.workload.next_token and row.get("samples_per_s"):  # a sequence is `context` tokens
            row["tokens_per_s"] = row["samples_per_s"] * cell.workload.input_shape[0]
        full = {**state.base, **row, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        self.writer.write(full)
        state.rows.append(full)
        result = state.result
        if row.get("phase") == "train_epoch":
            result.epoch_seconds.append(row["seconds"])
            result.val_accuracy = row.get("val_accuracy")
            self.display.epoch(cell, row["epoch"], cell.workload.training.epochs)
        elif row.get("phase") == "inference":
            result.inference_seconds.append(row["seconds"])
        line = progress.row_line(row, cell.workload, result.inference_seconds)
        if row.get("phase") == "scenario" and line:
            progress.keep_scenario_line(result, row, line)
        if line:
            self.display.note(f"{progress.tag(cell)} {line}")

    def _peak_too_low(self, state: _Open, mfu: float) -> None:
        """A row above 100% MFU (its own left out: ``mfu_missing``): say so once per cell, and drop
        the cached probe so that the next cell on the device measures again."""
        if state.peak_dropped is not None:
            return
        state.peak_dropped = bool(state.peak_key) and peaks.forget(state.peak_key)
        self.display.note(f"{progress.tag(state.result.cell)} "
                          f"{peaks.too_low(mfu, str(state.base.get('peak_source')), state.peak_dropped)}")

    def _end(self, state: _Open, outcome: Outcome) -> None:
        """The cell has ended: decide its status and append its ``run`` row, which carries it. An
        attempt the executor runs again (``retried``) only closes its rows: the next one measures the cell."""
        result, w = state.result, state.result.cell.workload
        if outcome.status == "done":
            result.status, result.message = checks.cell_status(state.rows, w, result.cell.choice.precision)
        else:
            result.status, result.message = outcome.status, outcome.message
        values: dict[str, Any] = {}
        busy = busy_note(state.rows)
        if busy:  # on the run row, and said; compare reads the rows' shares itself
            values["notes"] = busy
            self.display.note(f"{progress.tag(result.cell)} {busy}")
        target = w.checks.target_accuracy
        if target is not None and outcome.status == "done" and not state.base["inference_only"]:
            values["time_to_accuracy_s"] = reached = checks.time_to_accuracy(state.rows, target)
            values["epochs_to_target"] = checks.epochs_to_target(state.rows, target)
            self.display.note(f"{progress.tag(result.cell)} time to accuracy {target:g}: "
                              + (f"{reached:.2f}s of training" if reached != float("inf") else "not reached"))
        self.writer.end_cell({**state.base, **values, "message": result.message,
                              "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, result.status)
        del self.open[result.cell.order]
        if result.status != "ok":
            self.display.note(f"{progress.tag(result.cell)} {result.status}: {result.message}")
        if result.status == results.RETRIED:
            return
        self.results.append(result)
        self.display.cell_ended(result.cell, result.status)
        group = result.cell.group
        self.waiting[group] = self.waiting.get(group, 1) - 1
        if result.status == "unavailable" and self.waiting[group] > 0:
            self.waiting.pop(group)
            self.display.skipped(group)  # the other repeats would say the same

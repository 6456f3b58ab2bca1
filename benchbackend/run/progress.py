"""What a person sees while a run goes: cells done out of the total, the current cell and epoch,
the time elapsed and the time left (estimated per workload and backend: ``Display``).

``display(quiet, stream)`` picks one of three: on a terminal a live line that redraws in place
under the log (``rich``), in CI or when piped plain lines (each finished cell says ``[k/N]`` with
the elapsed and estimated time), and with ``--quiet`` only what the run as a whole does
(``Display.announce``). The runner calls the same
methods on each; nothing here knows about rows, CSVs or frameworks.
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence, TextIO

if TYPE_CHECKING:
    from .plan import Cell


def kind(cell: "Cell") -> tuple[str, str]:
    """What the time-left estimate pools: a workload (``mnist b128`` in a batch sweep) and a backend."""
    return _names(cell)[0], cell.choice.backend


def _names(cell: "Cell") -> tuple[str, str]:
    """(``mnist``, ``mnist b128`` in a batch sweep or ``mnist server`` with ``--scenario``;
    ``torch:eager/fp32``, ``torch:eager/fp32 x2``
    for 2 replicas, ``torch:eager/fp32 t1`` for ``--threads 1``): how the log lines and the summary
    name a cell's experiment and choice."""
    c = cell.choice
    sweep = f" b{cell.workload.training.batch_size}" if cell.sweep else ""
    many = f" x{c.replicas}" if c.replicas > 1 else ""
    threads = f" t{c.threads}" if c.threads else ""
    lg = cell.workload.loadgen
    scenario = f" {lg.scenario}" if lg is not None and lg.scenario else ""
    return cell.workload.name + sweep + scenario, f"{c.backend}:{c.mode}/{c.precision}{many}{threads}"


def tag(cell: "Cell") -> str:
    """``[mnist/torch:eager/fp32 r1/3]`` (``... x2 r1/3`` for 2 replicas): how every line names its cell."""
    name, choice = _names(cell)
    return f"[{name}/{choice} r{cell.repeat}/{cell.repeats}]"


def clock(seconds: float) -> str:
    """``0:42``, ``12:05``, ``1:02:03``."""
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Display:
    """The quiet display, and the bookkeeping every display shares: counts and the estimate.

    The time left is estimated per kind of cell (workload and backend: a cifar10 cell says nothing
    of an mnist one, nor torch of TensorFlow): each cell still to run takes the mean time of the
    finished cells of its kind; a kind none of whose cells has finished is projected from the
    running cell's first epochs (their time so far, times its epochs), and until then the estimate
    says ``estimating``. An interrupted run shows no time left."""

    def __init__(self, stream: Optional[TextIO] = None) -> None:
        #: Where :meth:`announce` prints with ``--quiet`` (None: nowhere).
        self.stream = stream
        self.total = 0
        self.done = 0
        self.started_at = time.monotonic()
        self.cell_started_at = self.started_at
        #: The cells not ended yet (by their place in the run), and each kind's finished cells' seconds.
        self.pending: dict[int, "Cell"] = {}
        self.seconds: dict[tuple[str, str], list[float]] = {}
        self.current: Optional["Cell"] = None
        self.epochs_done = self.epochs = 0
        self.epoch_text = ""
        self.stopped = False

    # --- what the runner calls --------------------------------------------------------------
    def begin(self, cells: Sequence["Cell"]) -> None:
        """The cells the run is about to run."""
        self.pending = {c.order: c for c in cells}
        self.total, self.started_at = len(cells), time.monotonic()

    def note(self, text: str) -> None:
        """One line of the log (a cell's progress, a warning)."""

    def announce(self, text: str) -> None:
        """A line that prints even with ``--quiet``: what the run as a whole does (``resuming ...:
        nothing left to run``)."""
        if self.stream is not None:
            print(text, file=self.stream, flush=True)

    def cell_started(self, cell: "Cell") -> None:
        self.current, self.cell_started_at, self.epoch_text, self.epochs_done = cell, time.monotonic(), "", 0

    def epoch(self, cell: "Cell", epoch: int, epochs: int) -> None:
        self.epoch_text = f"epoch {epoch}/{epochs}"
        self.epochs_done, self.epochs = epoch, epochs

    def cell_ended(self, cell: "Cell", status: str) -> None:
        self.done += 1
        self.pending.pop(cell.order, None)
        if status not in ("unavailable", "interrupted"):  # a cell that ran to its end
            self.seconds.setdefault(kind(cell), []).append(time.monotonic() - self.cell_started_at)
        self.current = None

    def skipped(self, group: object) -> None:
        """The cells of ``group`` that will not run after all (it is unavailable): the total shrinks."""
        gone = [order for order, c in self.pending.items() if c.group == group and c is not self.current]
        for order in gone:
            del self.pending[order]
        self.total = max(self.done, self.total - len(gone))

    def interrupted(self) -> None:
        """Ctrl-C or SIGTERM: the cells left will not run, so no time is left to show."""
        self.stopped = True

    def close(self) -> None:
        """The run has ended (or was interrupted)."""

    # --- shared -----------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.started_at

    def _cell_seconds(self, cell: "Cell") -> Optional[float]:
        """How long a cell of this kind takes: the mean of the finished ones, else the running one's
        epochs so far projected to all its epochs, else None (not known yet)."""
        finished = self.seconds.get(kind(cell))
        if finished:
            return sum(finished) / len(finished)
        now = self.current
        if now is not None and kind(now) == kind(cell) and self.epochs_done:
            ran = time.monotonic() - self.cell_started_at
            return ran / self.epochs_done * max(self.epochs_done, self.epochs)
        return None

    def left(self) -> Optional[float]:
        """Seconds left: each cell not ended at its kind's time (the running one less its time so
        far); None when the run was interrupted or a kind's time is not known yet."""
        if self.stopped:
            return None
        total = 0.0
        for cell in self.pending.values():
            each = self._cell_seconds(cell)
            if each is None:
                return None
            ran = time.monotonic() - self.cell_started_at if cell is self.current else 0.0
            total += max(0.0, each - ran)
        return total

    def status(self) -> str:
        """``3/12 cells, 0:42 elapsed, ~1:30 left`` (``estimating time left`` until a cell of each
        kind still to run has finished)."""
        left = self.left()
        shown = (f", ~{clock(left)} left" if left is not None else
                 "" if self.stopped or not self.pending else ", estimating time left")
        return f"{self.done}/{self.total} cells, {clock(self.elapsed())} elapsed{shown}"


class PlainDisplay(Display):
    """Plain lines (CI, a pipe, a file): the log, and the counts at the end of each cell."""

    def __init__(self, stream: TextIO):
        super().__init__(stream)

    def note(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def announce(self, text: str) -> None:
        self.note(text)

    def cell_ended(self, cell: "Cell", status: str) -> None:
        super().cell_ended(cell, status)
        self.note(f"{tag(cell)} {status} [{self.status()}]")


class LiveDisplay(Display):
    """A terminal: the log scrolls, and one line under it redraws in place with the counts, the
    current cell and epoch, and the times."""

    def __init__(self, stream: TextIO):
        super().__init__()
        from rich.console import Console
        from rich.live import Live

        self.console = Console(file=stream, highlight=False, soft_wrap=True)
        self.live = Live(self._render(), console=self.console, auto_refresh=True, refresh_per_second=2,
                         transient=True, get_renderable=self._render)

    def _render(self) -> Any:
        from rich.text import Text

        now = f" | {tag(self.current)} {self.epoch_text}".rstrip() if self.current is not None else ""
        return Text(f"{self.status()}{now}", style="bold")

    def begin(self, cells: Sequence["Cell"]) -> None:
        super().begin(cells)
        self.live.start()

    def note(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False)

    def announce(self, text: str) -> None:
        self.note(text)

    def cell_ended(self, cell: "Cell", status: str) -> None:
        super().cell_ended(cell, status)
        self.note(f"{tag(cell)} {status}")

    def close(self) -> None:
        self.live.stop()
        self.note(f"{'stopped' if self.stopped else 'done'}: {self.status()}")


def display(quiet: bool = False, stream: Optional[TextIO] = None) -> Display:
    """The display for this terminal: none with ``quiet``; live on an interactive terminal outside
    CI; plain lines otherwise."""
    stream = stream or sys.stderr
    if quiet:
        return Display(stream)
    interactive = stream.isatty() and not os.environ.get("CI") and os.environ.get("TERM") != "dumb"
    return LiveDisplay(stream) if interactive else PlainDisplay(stream)


#: A generation pass being logged, per cell (see :func:`_generation_line`): its time to first token,
#: and the seconds and steps of its decode rows so far.
_passes: dict[int, list[float]] = {}


def _generation_line(row: dict[str, Any], workload: Any, cell: int) -> Optional[str]:
    """One line per generation pass (``--generate``), on its last decode row: the time to first token
    and the mean time per output token, not a line per step. A pass's rows come together (the worker
    writes them after the pass: its prefill, then its decode steps in order), so the pass is held
    from its prefill row to the row of its last step; ``cell`` tells concurrent cells' passes apart."""
    if row["phase"] == "prefill":
        _passes[cell] = [row["seconds"], 0.0, 0.0]
        return None
    held = _passes.get(cell)
    if held is None:
        return None
    steps = int(row.get("steps") or 1)
    held[1] += row["seconds"]
    held[2] += steps
    if int(row.get("step") or 1) + steps < int(row.get("new_tokens") or 0):
        return None  # not the pass's last step yet
    ttft, seconds, count = _passes.pop(cell)
    passes = workload.generating.passes
    warm = " (warm-up)" if row.get("pass") == 1 and passes > 1 else ""
    tpot = seconds / count
    rate = f", {(row.get('samples') or 1) / tpot:,.0f} tokens/s" if tpot > 0 else ""
    return (f"generation pass {row.get('pass')}/{passes}{warm}, prompt {row.get('prompt_tokens')}: "
            f"TTFT {ttft * 1e3:.2f} ms, TPOT mean {tpot * 1e3:.3f} ms over {count:g} steps{rate}")


def row_line(row: dict[str, Any], workload: Any, inference_seconds: list[float]) -> Optional[str]:
    """The log line of one measured row (None for rows that say nothing worth a line).
    ``inference_seconds`` is the cell's own list of inference pass times (the runner's), which also
    names the cell while a generation pass is being logged."""
    phase = row.get("phase")
    if phase in ("prefill", "decode") and row.get("seconds") is not None:
        return _generation_line(row, workload, id(inference_seconds))
    if phase == "train_epoch" and row.get("tokens_per_s"):  # a language model: its loss, perplexity, tokens/s
        return (f"epoch {row['epoch']}/{workload.training.epochs}  loss {row['loss']:.4f}  val_loss "
                f"{row['val_loss']:.4f}  ppl {math.exp(min(row['val_loss'], 700)):.2f}  {row['seconds']:.2f}s  "
                f"{row['tokens_per_s']:,.0f} tokens/s")
    if phase == "train_epoch":
        return (f"epoch {row['epoch']}/{workload.training.epochs}  loss {row['loss']:.4f}  acc {row['accuracy']:.3f}  "
                f"val_acc {row['val_accuracy']:.3f}  {row['seconds']:.2f}s  "
                f"{row.get('samples_per_s') or 0:.0f} samples/s")
    if phase == "build":
        extra = f" ({row['notes']})" if row.get("notes") else ""
        return f"built {row.get('params')} params in {row['seconds']:.2f}s{extra}"
    if phase == "tune":
        return f"tuned in {row['seconds']:.1f}s: {row.get('notes')}"
    if phase == "parity" and row.get("steps"):
        return f"trajectory: {row.get('notes')}"
    if phase == "parity":  # the second forward check of a batchnorm network is its training mode: say so
        mode = f" ({row['notes']})" if row.get("notes") else ""
        return (f"parity vs NumPy reference{mode}: max abs {row['parity_max_abs']:.2g}, "
                f"max rel {row['parity_max_rel']:.2g}")
    if phase == "scenario":
        return scenario_line(row)
    if phase == "inference" and len(inference_seconds) == workload.inference.repeats:
        steady = inference_seconds[1:] or inference_seconds
        return (f"inference x{len(inference_seconds)}: first {inference_seconds[0]:.3f}s, "
                f"steady median {statistics.median(steady):.3f}s")
    return None


@dataclass(frozen=True)
class Generated:
    """One prompt length's figures of a generation cell for its summary line, as ``compare`` reduces
    a repeat (``analysis.generation.per_repeat``): over the passes after the first, the median time
    to first token, the time per output token's p50 and p99 over every decode step, and the batch
    over the mean time per output token."""

    prompt_tokens: int
    ttft_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    decode_tps: float

    def text(self) -> str:
        return (f"p{self.prompt_tokens}: TTFT {self.ttft_s * 1e3:.3g}ms  TPOT p50 {self.tpot_p50_s * 1e3:.3g}ms "
                f"p99 {self.tpot_p99_s * 1e3:.3g}ms  {self.decode_tps:,.0f} tok/s")


def summary_line(result: Any, generated: Sequence[Generated] = ()) -> str:
    """One cell in the end-of-run summary (a ``runner.CellResult``): status, steady epoch time (the
    median of the epochs after the first; none with one epoch, as ``compare`` says; a cell stopped
    before its last epoch says after which), final
    validation accuracy, steady inference time; for a generation cell instead, per prompt length,
    its ``generated`` figures (``generation n/a`` where none were measured)."""
    cell = result.cell
    steady = result.epoch_seconds[1:]  # the first epoch holds tracing and compilation: never steady
    ran, epochs = len(result.epoch_seconds), cell.workload.training.epochs
    stopped = f"stopped after epoch {ran} of {epochs}" if 0 < ran < epochs else ""  # Ctrl-C, --timeout, a crash
    epoch = (f"epoch {statistics.median(steady):.3f}s" + (f" ({stopped})" if stopped else "") if steady else
             f"epoch n/a ({stopped or 'only one epoch'}, so no steady epoch time)" if ran else "epoch n/a")
    acc = f"val_acc {result.val_accuracy:.3f}" if result.val_accuracy is not None else "val_acc n/a"
    passes = result.inference_seconds[1:] or result.inference_seconds
    inf = f"infer {statistics.median(passes):.3f}s" if passes else "infer n/a"
    name, choice = _names(cell)
    head = f"{name:<10} {choice:<28} {result.device:<8} r{cell.repeat}"
    tail = f"  {result.message}" if result.message and result.status != "ok" else ""
    if result.scenario:  # a LoadGen scenario replaced the inference passes
        return f"{head}  {result.status:<16} {result.scenario}{tail}"
    if generated or getattr(result, "generates", False):
        figures = "; ".join(g.text() for g in generated) or "generation n/a"
        return f"{head}  {result.status:<16} {figures}{tail}"
    return f"{head}  {result.status:<16} {epoch}  {acc}  {inf}{tail}"


def keep_scenario_line(result: Any, row: dict[str, Any], line: str) -> None:
    """The LoadGen run whose ``line`` the cell's summary gives (``result.scenario``): the last one; in a
    peak search (``--slo-ms``), the peak, the highest rate LoadGen called valid with its audit passed
    (the last probe, until one is), not the search's last probe, which is usually past the peak."""
    if row.get("probe") is None:
        result.scenario = line
        return
    valid = row.get("loadgen_valid") == "valid" and row.get("audit_sample") is None
    if valid and row["target_qps"] > (result.peak_qps or 0.0):
        result.scenario, result.peak_qps = line, row["target_qps"]
    elif result.peak_qps is None:
        result.scenario = line


def scenario_line(row: dict[str, Any]) -> str:
    """A LoadGen run's line: its percentiles or rate, LoadGen's verdict, the label of a short run."""
    def ms(key: str) -> str:
        return "-" if row.get(key) is None else f"{row[key]:.3g}ms"

    probe = f" probe {row['probe']:g} at {row['target_qps']:.4g} QPS" if row.get("probe") is not None else (
        f" at {row['target_qps']:.4g} QPS" if row.get("target_qps") else "")
    rate = row.get("samples_per_s")
    short = ", below MLPerf's minimum" if row.get("below_mlperf_minimum") else ""
    return (f"{row.get('scenario')}{probe}: p50 {ms('latency_p50_ms')} p90 {ms('latency_p90_ms')} p99 "
            f"{ms('latency_p99_ms')}, {rate or 0:,.0f} samples/s, LoadGen {str(row.get('loadgen_valid')).upper()}"
            f"{short}")

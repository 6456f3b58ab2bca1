"""The results CSV: a versioned long-format schema, an appending writer, a validating reader.

One row per measurement. ``schema_version`` is bumped on any incompatible change; the reader
refuses newer versions with a clear message and reads older ones.

Over 400 lines: the file's three stages stay together because each reads what the other wrote: the
appending writer, the final rewrite (every row's cell status, and the one MFU denominator per
device with ``compare``'s rule, ``best_peaks`` and ``mfu_values``), and the validating reader with
its migrations.
"""
from __future__ import annotations

import contextlib
import csv
import glob
import math
import os
import platform
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

from .columns import DECLARED
from .errors import ResultsError

SCHEMA_VERSION = 14
#: A training sample costs this many forward passes of FLOPs: the forward, the gradient of the
#: activations and the gradient of the weights. ``achieved_flops`` and ``mfu`` count training so.
TRAIN_FLOPS_FACTOR = 3

#: The columns, in the file's order: declared once, with their types and meanings, in ``columns``
#: (README "CSV columns" is generated from there). What each schema version changed in older files
#: is ``_migrate``'s docstring.
COLUMNS = [c.name for c in DECLARED]
REQUIRED = ["schema_version", "workload", "backend", "device", "repeat", "phase", "epoch", "seconds", "status"]
PHASES = ("build", "tune", "parity", "train_epoch", "inference", "scenario", "prefill", "decode", "greedy", "run")
#: Cell statuses, best first; "worst" is the highest index. ``pending``: the cell had not ended
#: when the row was written (a parent killed outright leaves it so). ``retried``: an attempt lost
#: with its node and run again (``--retries``); its rows are kept for the record and feed nothing.
STATUSES = ("ok", "parity_mismatch", "audit_failed", "generation_mismatch", "future_leak", "chance_accuracy",
            "not_judged", "diverged", "nan_loss", "unavailable", "timeout", "interrupted", "crashed", "retried",
            "pending")
PENDING = "pending"
RETRIED = "retried"
NUMERIC = [c.name for c in DECLARED if c.kind == "number" and c.name != "schema_version"]
#: The definition's fields as columns (schema 3), and the key of each in the ``definition`` text
#: that older files carry (read once, when such a file is read: see ``_migrate``).
DEFINITION_COLUMNS = {"limit": "train", "epochs": "epochs", "batch_size": "batch",
                      "inference_batch_size": "infer_batch", "seed": "seed"}
#: A cell's attempt: its run, its place in that run's order (schema 3), the attempt (schema 5; older: 1).
CELL_KEY = ("run_id", "cell_order", "attempt")
#: What a cell's ``run`` row says for every row of the cell.
CELL_LEVEL = ("status", "time_to_accuracy_s", "epochs_to_target")
#: What names a device for MFU's denominator: ``run.peaks.key``'s fields as the rows hold them, and
#: the replicas a data-parallel cell's peak is multiplied by. One peak per key in a file.
PEAK_KEYS = ("host", "cpu", "gpu", "device", "precision", "threads", "replicas")
#: ``peak_source`` of a row whose ``peak_flops`` is the user's figure: before schema 12 ``--peak-tflops``
#: replaced the probe (such a row keeps its figure); since, it has a column of its own.
DATASHEET = "--peak-tflops"


def canonical_device(name: Any) -> str:
    """One name for one device, whichever backend ran on it.

    Frameworks name one device differently: the host CPU is ``cpu`` to torch and JAX, ``cpu:0`` to
    TensorFlow (``/CPU:0``), ``llvm_cpu.0`` to PlaidML; the first CUDA GPU is ``cuda:0`` to torch,
    JAX, ONNX Runtime and CuPy, ``gpu:0`` to TensorFlow. The canonical forms are ``cpu`` (one per
    host: an index names nothing more, and threads are their own column) and ``gpu:N`` (the form
    ``--device`` takes for every GPU-capable backend; which GPU model it is, is the ``gpu``
    column). Any other device (``tpu:0``, a PlaidML OpenCL id) keeps its own name, lowercased.
    """
    text = str(name or "").strip().strip("/").lower()
    kind, sep, index = text.replace(".", ":").partition(":")
    if kind in ("cpu", "llvm_cpu") and (not sep or index.isdigit()):
        return "cpu"
    if kind in ("gpu", "cuda") and (not sep or index.isdigit()):
        return f"gpu:{index or 0}"
    return text


def worst_status(statuses: Iterable[str]) -> str:
    rank = {s: i for i, s in enumerate(STATUSES)}
    return max(statuses, key=lambda s: rank.get(s, len(STATUSES)), default="ok")


def _cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def environment() -> dict[str, str]:
    """Fingerprint of the parent's environment (the worker adds python and gpu)."""
    return {"host": socket.gethostname(), "os": platform.platform(terse=True),
            "python": platform.python_version(), "cpu": f"{_cpu_name()} x{os.cpu_count()}"}


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if not math.isfinite(value):
            return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"
        return repr(float(value))  # float(): NumPy 2 scalars repr as 'np.float64(...)'
    return str(value)


class CsvWriter:
    """Appends rows as they arrive (flushed each time), so nothing measured is lost.

    While a run goes, rows are only appended: a cell's rows as ``pending``, then its ``run`` row
    with its final status (``end_cell``), which a reader joins to the cell's other rows by
    ``CELL_KEY``. ``close`` rewrites the file once, atomically, with every row's final status, so
    that a user opening it sees no ``pending`` for a cell that ended. The cost is linear in the
    rows, and the writer keeps no rows in memory (the file is the spool).

    The file is created with the first row: a run that fails before measuring anything (missing
    data, say) leaves no empty CSV behind. Raises ``OSError`` at once when the folder is not writable.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.rows = 0
        check_writable(self.path)

    def write(self, row: Mapping[str, Any]) -> None:
        """Append ``row`` (its known columns; ``status`` defaults to ``pending``) to the file now."""
        full = {c: row.get(c) for c in COLUMNS}
        full["schema_version"] = SCHEMA_VERSION
        full["status"] = full["status"] or PENDING
        full["device"] = canonical_device(full["device"]) if full["device"] else full["device"]
        new = self.rows == 0
        with open(self.path, "w" if new else "a", newline="") as fh:
            out = csv.writer(fh)
            if new:
                out.writerow(COLUMNS)
            out.writerow([_cell(full[c]) for c in COLUMNS])
        self.rows += 1

    def adopt(self, rows: int) -> None:
        """Go on appending to this existing file of ``rows`` rows, under its header (``run --resume``)."""
        self.rows = rows

    def end_cell(self, row: Mapping[str, Any], status: str) -> None:
        """Append the cell's ``run`` row (``row`` holds its key columns and any cell-level values):
        its final status, which the reader and ``close`` give every other row of the cell."""
        self.write({**row, "phase": "run", "status": status})

    def close(self) -> None:
        """Rewrite the file once with every row's final status (a no-op before the first row)."""
        if self.rows:
            finalize(self.path)


def check_writable(path: Path) -> None:
    """Raise ``OSError`` unless a results file can be created at ``path`` (its folder is made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        raise IsADirectoryError(21, "Is a directory")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise PermissionError(13, "Permission denied")


def cell_id(row: Mapping[str, str]) -> tuple[str, str, str]:
    """``CELL_KEY``'s values of a row as read from the file (text); an older row's attempt is 1."""
    return row["run_id"], row.get("cell_order") or "", row.get("attempt") or "1"


def cell_values(path: Path) -> dict[tuple[str, str, str], dict[str, str]]:
    """Each ended cell attempt's ``CELL_LEVEL`` values (its final status, ...), from its ``run`` row."""
    out: dict[tuple[str, str, str], dict[str, str]] = {}
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            if row.get("phase") == "run" and row.get("cell_order") and row.get("status") != PENDING:
                out[cell_id(row)] = {c: row[c] for c in CELL_LEVEL if row.get(c)}
    return out


def best_peaks(rows: Iterable[tuple[tuple[str, ...], Any, Any]]) -> dict[tuple[str, ...], tuple[float, str]]:
    """The one MFU denominator per device (``PEAK_KEYS``) of ``(key, peak_flops, peak_source)``
    rows: the best GEMM probe any of them was measured against (``run.peaks``: a run whose
    backends probe for the first time sees the best rise between its cells)."""
    best: dict[tuple[str, ...], tuple[float, str]] = {}
    for key, peak, source in rows:
        flops, source = _number(peak), str(source or "")
        if flops is not None and flops > 0 and not source.startswith(DATASHEET) and flops > best.get(key, (0.0,))[0]:
            best[key] = (flops, source)
    return best


def _number(value: Any) -> Optional[float]:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def mfu_values(achieved: Any, peak: Any, source: str, precision: str, datasheet: Any) -> dict[str, Any]:
    """A timed row's ``mfu`` (against ``peak``, the probe), ``mfu_datasheet`` (against ``--peak-tflops``)
    and ``mfu_missing`` (why either is empty). An MFU above 1 is never given: the peak under-read
    (a probe taken while the machine was busy, a framework's slow path for the precision, a low
    ``--peak-tflops``), and the row says so instead. ``{}`` for a row without achieved FLOP/s."""
    done = _number(achieved)
    if done is None:
        return {}
    out: dict[str, Any] = {"mfu": None, "mfu_datasheet": None}
    why = []
    for col, figure, what in (("mfu", _number(peak), source or "GEMM probe"),
                              ("mfu_datasheet", _number(datasheet), DATASHEET)):
        if not figure or figure <= 0:
            if col == "mfu":
                why.append("no GEMM probe on this device and precision")
            continue
        value = done / figure
        if value <= 1:
            out[col] = value
        else:
            name = "MFU" if col == "mfu" else "datasheet MFU"
            hint = "" if col == "mfu_datasheet" else " (a probe taken on a busy machine or a slow path)"
            why.append(f"{name} {value:.0%} against {figure / 1e12:.3g} TFLOP/s {precision or 'fp32'} ({what}) "
                       f"is above 100%, so that peak is too low{hint}")
    out["mfu_missing"] = "; ".join(why)
    return out


def finalize(path: Path) -> None:
    """Give every row of an ended cell its cell's final status and cell-level values, and every
    timed row the one peak per device (``best_peaks``, as ``compare`` re-divides) with its MFU
    (``mfu_values``: never above 1); rewrite ``path`` atomically, one pass to read the cells'
    ``run`` rows and the peaks and one to copy the rows."""
    final = cell_values(path)
    with open(path, newline="") as fh:
        best = best_peaks((tuple(row.get(c) or "" for c in PEAK_KEYS), row.get("peak_flops"), row.get("peak_source"))
                          for row in csv.DictReader(fh) if row.get("phase") != "run")

    def rows(header: list[str], reader: Iterator[list[str]]) -> Iterator[list[str]]:
        index = {c: i for i, c in enumerate(header)}
        run_id, order, attempt = index["run_id"], index.get("cell_order"), index.get("attempt")
        for row in reader:
            if order is not None:
                key = (row[run_id], row[order], (row[attempt] if attempt is not None else "") or "1")
                for col, value in final.get(key, {}).items():
                    row[index[col]] = value
            _one_peak(row, index, best)
            yield row

    rewrite(path, rows)


def _one_peak(row: list[str], index: dict[str, int], best: dict[tuple[str, ...], tuple[float, str]]) -> None:
    """``row`` (as text, in the file's column ``index``) against its device's best peak, its MFU again."""
    if "achieved_flops" not in index or not row[index["achieved_flops"]]:
        return
    get = {c: row[i] for c, i in index.items()}.get
    if (get("peak_source") or "").startswith(DATASHEET):
        return  # schema < 12: the user's figure stood in for the probe, its MFU as written
    found = best.get(tuple(get(c) or "" for c in PEAK_KEYS))
    if found is not None:
        row[index["peak_flops"]], row[index["peak_source"]] = _cell(found[0]), found[1]
    values = mfu_values(get("achieved_flops"), row[index["peak_flops"]], row[index["peak_source"]],
                        get("precision") or "", get("peak_datasheet_flops"))
    for col, value in values.items():
        if col in index:
            row[index[col]] = _cell(value)


def rewrite(path: Path, rows: Callable[[list[str], Iterator[list[str]]], Iterable[list[str]]]) -> int:
    """Rewrite the CSV ``path`` atomically: its header, then ``rows(header, its rows)``. Returns
    how many rows were written."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".csv")
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # as an ordinary new file, not mkstemp's 0600
    written = 0
    with os.fdopen(fd, "w", newline="") as out, open(path, newline="") as src:
        reader = csv.reader(src)
        header = next(reader)
        writer = csv.writer(out)
        writer.writerow(header)
        for row in rows(header, reader):
            writer.writerow(row)
            written += 1
    os.replace(tmp, path)
    return written


def expand(paths: list[str]) -> list[str]:
    """Expand globs the shell left alone (quoted, or on Windows); directories stay for read_many.
    Raises ``ResultsError`` for a glob that matches nothing."""
    out: list[str] = []
    for raw in paths:
        raw = str(raw)
        if any(c in raw for c in "*?[") and not Path(raw).exists():
            found = sorted(glob.glob(raw))
            if not found:
                raise ResultsError(f"{raw}: no files match")
            out += found
        else:
            out.append(raw)
    return out


def read(path: str | Path) -> "Any":
    """Read and validate one results CSV into a pandas DataFrame.

    Raises :class:`ResultsError` naming the file and the problem: missing, empty, not a CSV,
    missing columns, a newer schema, a truncated last row or non-numeric values.
    """
    import pandas as pd

    p = Path(path)
    if not p.is_file():
        raise ResultsError(f"{p}: no such file")
    try:
        with open(p, "rb") as fh:
            head = fh.readline().decode("utf-8")
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(size - 1, 0))
            last = fh.read(1)
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultsError(f"{p}: cannot read as text ({exc})") from None
    if not head.strip():
        raise ResultsError(f"{p}: empty file, not a benchbackend results CSV")
    header = next(csv.reader([head]))
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise ResultsError(f"{p}: not a benchbackend results CSV (missing columns: {', '.join(missing)})")
    try:
        df = pd.read_csv(p, dtype=str, keep_default_na=False, na_values=[], engine="c")
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as exc:
        raise ResultsError(f"{p}: malformed CSV ({str(exc).strip().splitlines()[-1]})") from None
    # A row with too few fields comes back with NaN in its last columns (keep_default_na=False
    # leaves real empty fields as ""), which is how a truncated file shows.
    short = df.isna().any(axis=1)
    if short.any():
        i = int(short.to_numpy().argmax())
        what = "truncated" if i == len(df) - 1 else "malformed"
        raise ResultsError(f"{p}: line {i + 2} is {what} (fewer fields than the {len(header)} columns)")
    if last != b"\n" and len(df):
        raise ResultsError(f"{p}: truncated (the last line has no line end)")
    versions = set(df["schema_version"])
    for v in versions:
        if not v.isdigit():
            raise ResultsError(f"{p}: bad schema_version {v!r}")
        if int(v) > SCHEMA_VERSION:
            raise ResultsError(f"{p}: schema_version {v} is newer than this benchbackend reads "
                               f"({SCHEMA_VERSION}); upgrade benchbackend")
    for col in COLUMNS:
        if col not in df.columns:
            df[col] = ""
    _migrate(df)
    for col in NUMERIC:
        raw = df[col]
        converted = pd.to_numeric(raw.where(raw != "", None), errors="coerce")
        suspect = converted.isna() & raw.ne("")
        if suspect.any():
            bad = suspect & ~raw[suspect].str.lower().isin(["nan"]).reindex(raw.index, fill_value=False)
            if bad.any():
                i = int(bad.to_numpy().argmax())
                raise ResultsError(f"{p}: line {i + 2}: column {col} is not a number: {raw.iloc[i]!r}")
        df[col] = converted
    df["source"] = str(p)
    return _join_statuses(df)


def _migrate(df: "Any") -> None:
    """Rows of older schemas, as schema 12 says them (see ``columns.DECLARED``):

    - before 12, ``--peak-tflops`` replaced the probe in ``peak_flops`` (``peak_source`` says so; such
      rows keep their figure and MFU, ``best_peaks`` leaves them out); no row had the datasheet's
      columns, ``mfu_missing`` or ``cpu_bf16``: empty;
    - before 12, no row ran a LoadGen scenario (``--scenario``): its columns are empty;
    - before 11, no row generated (``--generate``): its columns are empty;
    - before 10, no row had ``tokens_per_s`` (no language models): empty;
    - before 9, the machine was not watched: its columns are empty (not measured, never "quiet");

    - before 8, every replica cell scaled strongly: ``scaling`` strong (``comm_s`` empty: not recorded);
    - before 7, every cell ran one replica, its learning rate unscaled: ``replicas`` 1, ``scale_lr`` none;
    - before 6, ``data_on_device`` and ``peak_device_mb`` were not recorded: empty (unknown);
    - before 5, a cell had one attempt: ``attempt`` is 1;
    - before 4, ``epoch`` also held an inference row's pass, 0 on build, tune, parity and run
      rows, and the trajectory row's step count (also in ``steps``): the pass moves to ``pass``,
      the others are emptied; ``device`` was each framework's own name (``canonical_device``);
    - before 3, ``message`` also held facts that are no failure's reason (a build row's
      ``cpu_capability AVX512``, a trajectory's "5 steps agree"): on every row but a ``run``
      row it moves to ``notes``, so that a failed cell's reason is only ever its run row's;
    - before 3, the definition is named only in its text (``train=1024 ... batch=32``): the
      definition columns are filled from it, the one place that text is ever read back.
    """
    for col, value in (("attempt", "1"), ("replicas", "1"), ("scale_lr", "none"), ("scaling", "strong")):
        df.loc[df[col] == "", col] = value
    version = df["schema_version"].astype(int)
    old = version < 4
    if old.any():
        inference = old & (df["phase"] == "inference")
        df.loc[inference & (df["pass"] == ""), "pass"] = df.loc[inference & (df["pass"] == ""), "epoch"]
        df.loc[old & (df["phase"] != "train_epoch"), "epoch"] = ""
        df.loc[old, "device"] = df.loc[old, "device"].map(lambda d: canonical_device(d) if d else d)
    noted = (version < 3) & (df["phase"] != "run") & (df["message"] != "")
    if noted.any():
        df.loc[noted & (df["notes"] == ""), "notes"] = df.loc[noted & (df["notes"] == ""), "message"]
        df.loc[noted, "message"] = ""
    missing = [c for c in DEFINITION_COLUMNS if not df[c].astype(bool).any()]
    if not missing or not df["definition"].astype(bool).any():
        return
    parsed = {text: dict(part.partition("=")[::2] for part in text.split() if "=" in part)
              for text in df["definition"].unique()}
    for col in missing:
        df[col] = df["definition"].map({text: fields.get(DEFINITION_COLUMNS[col], "")
                                        for text, fields in parsed.items()})


def _join_statuses(df: "Any") -> "Any":
    """Every row of a cell takes the ``CELL_LEVEL`` values (its final status, ...) of the cell's
    ``run`` row (schema 3: a run that was killed before its last rewrite leaves the other rows
    ``pending``); a cell with no final ``run`` row stays ``pending``, never ``ok``."""
    ended = df[(df["phase"] == "run") & df["cell_order"].notna() & (df["status"] != PENDING)]
    if not len(ended):
        return df
    final = ended.groupby(list(CELL_KEY), sort=False)[list(CELL_LEVEL)].last().add_prefix("final_")
    joined = df[list(CELL_KEY)].merge(final, left_on=list(CELL_KEY), right_index=True, how="left")
    for col in CELL_LEVEL:
        df[col] = joined[f"final_{col}"].fillna(df[col]).to_numpy()
    return df


def read_many(paths: Iterable[str | Path], skip_bad: bool = False) -> tuple["Any", list[str]]:
    """Read files and directories (``*.csv`` inside). Returns (frame, skipped-file messages); the
    frame's ``attrs["files"]`` lists the files read."""
    import pandas as pd

    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(p.glob("*.csv"))
            if not found:
                raise ResultsError(f"{p}: directory holds no .csv files")
            files += found
        else:
            files.append(p)
    if not files:
        raise ResultsError("no results files given")
    frames, skipped, read_ok = [], [], []
    for f in files:
        try:
            frames.append(read(f))
            read_ok.append(str(f))
        except ResultsError as exc:
            if not skip_bad:
                raise
            skipped.append(str(exc))
    if not frames:
        raise ResultsError("no readable results files: " + "; ".join(skipped))
    df = pd.concat(frames, ignore_index=True)
    df.attrs["files"] = read_ok  # a header-only file adds no row, but compare names it
    return df, skipped


def default_path(workloads: list[str], when: Optional[str] = None, folder: str | Path = "results") -> Path:
    import time

    stamp = when or time.strftime("%Y%m%d-%H%M%S")
    names = "-".join(Path(w).stem for w in workloads)[:80]
    return Path(folder) / f"{stamp}-{names}.csv"

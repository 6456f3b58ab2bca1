"""The results CSV: a versioned long-format schema, an appending writer, a validating reader.

One row per measurement. ``schema_version`` is bumped on any incompatible change; the reader
refuses newer versions with a clear message and reads older ones.
"""
from __future__ import annotations

import csv
import math
import os
import platform
import socket
import tempfile
from pathlib import Path
from typing import Any, Iterable, Optional

from .errors import ResultsError

SCHEMA_VERSION = 2

#: Fixed columns, in this order; see README "CSV columns".
BASE_COLUMNS = [
    "schema_version", "run_id", "timestamp", "workload", "workload_hash", "backend", "backend_version",
    "device", "mode", "repeat", "phase", "epoch", "samples", "seconds", "samples_per_s", "loss", "accuracy",
    "val_loss", "val_accuracy", "status", "message", "host", "os", "python", "cpu", "gpu",
]
#: Added columns (schema 1): parity errors, model size, memory.
EXTRA_COLUMNS = ["parity_max_abs", "parity_max_rel", "parity_step", "params", "flops_per_sample",
                 "peak_rss_mb", "steps", "requested_device",
                 # schema 2: the matrix's precision, threads used, data source, inference-only cells
                 "precision", "threads", "data_source", "inference_only", "definition",
                 # MFU: achieved FLOP/s (training: 3x the forward FLOPs per sample) over the peak
                 "achieved_flops", "mfu", "peak_flops", "peak_source",
                 # cell-level: training seconds until checks.target_accuracy (inf: not reached)
                 "time_to_accuracy_s"]
COLUMNS = BASE_COLUMNS + EXTRA_COLUMNS
REQUIRED = ["schema_version", "workload", "backend", "device", "repeat", "phase", "epoch", "seconds", "status"]
PHASES = ("build", "tune", "parity", "train_epoch", "inference", "run")
#: Cell statuses, best first; "worst" is the highest index. ``pending``: the cell had not ended
#: when the row was written (a parent killed outright leaves it so).
STATUSES = ("ok", "parity_mismatch", "chance_accuracy", "diverged", "nan_loss", "unavailable", "timeout",
            "interrupted", "crashed", "pending")
NUMERIC = ["repeat", "epoch", "samples", "seconds", "samples_per_s", "loss", "accuracy", "val_loss",
           "val_accuracy", "parity_max_abs", "parity_max_rel", "parity_step", "params", "flops_per_sample",
           "peak_rss_mb", "steps", "threads", "achieved_flops", "mfu", "peak_flops", "time_to_accuracy_s"]


def worst_status(statuses: Iterable[str]) -> str:
    rank = {s: i for i, s in enumerate(STATUSES)}
    return max(statuses, key=lambda s: rank.get(s, len(STATUSES)), default="ok")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict[str, str]:
    """Fingerprint of the parent's environment (the worker adds python and gpu)."""
    return {"host": socket.gethostname(), "os": platform.platform(terse=True),
            "python": platform.python_version(), "cpu": f"{_cpu_name()} x{os.cpu_count()}"}


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(float(value))  # float(): NumPy 2 scalars repr as 'np.float64(...)'
    return str(value)


class CsvWriter:
    """Appends rows as they arrive (flushed each time), so nothing measured is lost.

    The file is created with the first row: a run that fails before measuring anything (missing
    data, say) leaves no empty CSV behind. ``finalize`` rewrites the file atomically when a
    cell's final verdict is known. Raises ``OSError`` at once when the folder is not writable.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.rows: list[dict[str, Any]] = []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(self.path.parent, os.W_OK) or self.path.is_dir():
            raise PermissionError(13, "Permission denied" if not self.path.is_dir() else "Is a directory")

    def write(self, row: dict[str, Any]) -> dict[str, Any]:
        """Append ``row`` (its known columns) to the file now; returns the stored row."""
        full = {c: row.get(c) for c in COLUMNS}
        full["schema_version"] = SCHEMA_VERSION
        self.rows.append(full)
        if len(self.rows) == 1:
            with open(self.path, "w", newline="") as fh:
                csv.writer(fh).writerow(COLUMNS)
        with open(self.path, "a", newline="") as fh:
            csv.writer(fh).writerow([_cell(full[c]) for c in COLUMNS])
            fh.flush()
        return full

    def finalize(self, rows: list[dict[str, Any]], status: str, **values: Any) -> None:
        """Give ``rows`` (stored rows ``write`` returned: one cell's) the cell's final status, and
        ``values`` (cell-level columns such as ``time_to_accuracy_s``); rewrite the file atomically."""
        update = {"status": status, **values}
        changed = False
        for row in rows:
            if any(row.get(k) != v for k, v in update.items()):
                row.update(update)
                changed = True
        if changed:
            self._rewrite()

    def _rewrite(self) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tmp-", suffix=".csv")
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # as an ordinary new file, not mkstemp's 0600
        with os.fdopen(fd, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(COLUMNS)
            for row in self.rows:
                w.writerow([_cell(row[c]) for c in COLUMNS])
        os.replace(tmp, self.path)


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
    return df


def for_comparison(df: "Any") -> "Any":
    """A copy shaped for comparing backends.

    - ``experiment`` names one experiment definition: rows are pooled and compared only within
      one (see :func:`experiments`).
    - ``device`` becomes what the user asked for (``--device cpu``) where recorded: backends name
      one device differently (torch ``cpu``, TensorFlow ``cpu:0``, PlaidML ``llvm_cpu.0``), and
      comparisons are between backends asked to use the same device.
    - ``mode`` is blanked for a backend that ran in one mode only, so it is named ``torch``
      rather than ``torch:eager``; a backend seen in several modes keeps them apart.
    - a precision other than fp32 is part of the group's name: ``torch@bf16``, ``torch:compile@bf16``
      (schema-1 files, which have no precision, ran fp32).
    """
    out = df.copy()
    out["experiment"] = experiments(out)
    if "precision" in out.columns:
        out["precision"] = out["precision"].astype(str).replace("", "fp32")
    if "requested_device" in out.columns:
        asked = out["requested_device"].astype(str)
        out["device"] = asked.where(asked != "", out["device"])
    if "mode" in out.columns:
        modes = out.groupby("backend")["mode"].transform("nunique")
        out["mode"] = out["mode"].where(modes > 1, "")
        if "precision" in out.columns:
            tagged = out["mode"] + "@" + out["precision"]
            out["mode"] = out["mode"].where(out["precision"] == "fp32", tagged)
    return out


#: How a definition field is named in an experiment's label (``train`` is what ``--limit`` sets).
_FIELD_NAMES = {"train": "limit", "data": "data"}
#: Fields implied by ``train`` (``--limit`` shrinks them in proportion): named only on their own.
_IMPLIED = ("val", "test")


def definition_fields(text: str) -> dict[str, str]:
    """``{"train": "1024", "epochs": "2", ...}`` from a ``definition`` cell (space-separated key=value)."""
    out: dict[str, str] = {}
    for part in str(text or "").split():
        key, sep, value = part.partition("=")
        if sep:
            out[key] = value
    return out


def _derived_fields(df: "Any", keys: list[str]) -> "Any":
    """Readable fields of each definition for files without a ``definition`` column: training
    samples per epoch, test samples per pass, epochs, data source."""
    import pandas as pd

    phase = df["phase"]
    train = df[phase == "train_epoch"].groupby(keys, sort=False)
    infer = df[phase == "inference"].groupby(keys, sort=False)
    fields = pd.DataFrame({"train": train["samples"].max(), "epochs": train["epoch"].max(),
                           "test": infer["samples"].max()})
    return fields.map(lambda v: "" if pd.isna(v) else f"{v:g}")


def experiments(df: "Any") -> "Any":
    """Each row's experiment label: the workload name, qualified by what differs when the rows hold
    several definitions of one workload name, e.g. ``mnist (limit 1024)`` and ``mnist (limit 2000)``.

    A definition is (workload, workload_hash, data_source); the hash covers the model, training
    settings, sizes after ``--limit``, epochs, batch size and seed. What differs is read from the
    ``definition`` column (``train=1024 val=256 test=256 epochs=2 batch=32 seed=0 data=synthetic``)
    where present, else from the rows (samples per epoch and per pass, epochs, data source); when
    nothing readable differs, the label carries the hash: ``mnist (def 3fa2c1)``. Rows of a status
    with no hash or data source (old files) join the workload's only definition when it has one.
    """
    import pandas as pd

    keys = ["workload", "workload_hash", "data_source"]
    frame = pd.DataFrame({k: (df[k].astype(str) if k in df.columns else "") for k in keys}, index=df.index)
    # A status row written before anything was known (a worker that died at once) joins the
    # definition of its run in its file, or the workload's only definition.
    run = [frame["workload"]] + [df[c].astype(str) for c in ("source", "run_id") if c in df.columns]
    for col in ("workload_hash", "data_source"):
        for by in (run, [frame["workload"]]):
            missing = frame[col] == ""
            if not missing.any():
                break
            known = frame[col].where(~missing)
            single = known.groupby(by).transform(lambda s: s.dropna().iloc[0] if s.dropna().nunique() == 1 else "")
            frame[col] = frame[col].where(~missing, single.astype(object).fillna(""))
    defs = frame.drop_duplicates()
    counts = defs.groupby("workload")["workload_hash"].transform("size")
    labels = pd.Series(defs["workload"].to_numpy(), index=pd.MultiIndex.from_frame(defs))
    multi = defs[counts.to_numpy() > 1]
    if len(multi):
        work = df.assign(**{k: frame[k] for k in keys})
        derived = _derived_fields(work, keys)
        written = (work[work["definition"].astype(str) != ""].groupby(keys, sort=False)["definition"].first()
                   if "definition" in work.columns else pd.Series(dtype=str))
        for workload, sub in multi.groupby("workload", sort=False):
            fields = {}
            for key in sub.itertuples(index=False, name=None):
                got = definition_fields(written.get(key, "")) if key in written.index else {}
                if not got and key in derived.index:
                    got = {k: v for k, v in derived.loc[key].items() if v}
                got.setdefault("data", key[2])
                fields[key] = got
            # A field some definitions do not record (older files) is unknown there, not different.
            recorded = [set(got) for key, got in fields.items() if key[1]]
            names = sorted(set.intersection(*recorded)) if recorded else []
            differ = [f for f in names if len({got[f] for got in fields.values()}) > 1]
            if "train" in differ:
                differ = [f for f in differ if f not in _IMPLIED]
            # --batch-size sets both batch sizes: infer_batch is named only when it differs on its own
            if "batch" in differ and all(got.get("infer_batch") == got.get("batch") for got in fields.values()):
                differ = [f for f in differ if f != "infer_batch"]
            for key, got in fields.items():
                parts = [f"{_FIELD_NAMES.get(f, f)} {got[f]}" for f in differ if f in got]
                labels[key] = (f"{workload} ({', '.join(parts)})" if parts and key[1] else
                               workload if key[1] else f"{workload} (def unknown)")
            taken = pd.Series([labels[k] for k in fields]).value_counts()
            for key in fields:  # readable fields do not tell these apart: the hash does
                if taken[labels[key]] > 1:
                    tag = f"def {key[1][:6] or 'unknown'}"
                    labels[key] = f"{labels[key][:-1]}, {tag})" if labels[key] != workload else f"{workload} ({tag})"
    index = pd.MultiIndex.from_frame(frame)
    return pd.Series(labels.reindex(index).to_numpy(), index=df.index, name="experiment")


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

"""``run --resume FILE``: which cells of a results file have finished, and the file made ready for the rest.

A cell has finished when its ``run`` row carries a final status: ``ok``, or a failure the run
decided (``parity_mismatch`` ... ``crashed``, ``timeout``). A cell that was ``interrupted``
(Ctrl-C, SIGTERM) or is still ``pending`` (its parent was killed outright) has not, and runs
again; so does an ``unavailable`` one, which measured nothing: its backend may have been
installed since (if not, it is ``unavailable`` again). Cells are matched across runs by what
they measure (:class:`CellKey`: the workload's definition hash, data source, backend, mode,
precision, requested device, whether it trains, and the repeat), never by run id or place in the run order.

Before the resumed run appends its rows, the rows of the cells it is about to run again are
removed, in one atomic rewrite: their partial epochs are superseded, so that no repeat is in the
file twice. Rows of unfinished cells that this run does not plan are kept as they are.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Mapping

from .. import results
from ..errors import ResultsError
from ..spec.workload import Workload

#: Statuses of a cell attempt that did not finish: unless another attempt did, the cell runs again.
UNFINISHED = ("interrupted", results.RETRIED, results.PENDING, "unavailable")


@dataclass(frozen=True)
class CellKey:
    """What one cell measures: a resumed run runs a cell of its plan unless a finished cell of the
    file has the same key."""

    workload_hash: str
    data_source: str
    backend: str
    mode: str
    precision: str
    device: str
    inference_only: bool
    repeat: int
    #: Data-parallel replicas (schema 7; rows of older files: 1).
    replicas: int = 1
    #: The threads of each replica where the run asked for them (``--threads``, a sweep), else "":
    #: a run that asks for none resumes a cell whatever threads it ran on.
    threads: str = ""

    @classmethod
    def of(cls, row: Mapping[str, object], threads: bool = False) -> "CellKey":
        """The key of a results row (as written, or as read back as text); with ``threads``, the
        threads it ran on are part of it."""
        only = row.get("inference_only")
        ran = str(row.get("threads") or "")
        return cls(str(row.get("workload_hash") or ""), str(row.get("data_source") or ""), str(row["backend"]),
                   str(row.get("mode") or ""), str(row.get("precision") or ""),
                   str(row.get("requested_device") or row.get("device") or ""),
                   only is True or str(only).lower() in ("true", "1"), int(float(str(row["repeat"] or 0))),
                   int(float(str(row.get("replicas") or 1))),
                   f"{float(ran):g}" if threads and ran and ran.lower() != "nan" else "")

    @classmethod
    def both(cls, row: Mapping[str, object]) -> tuple["CellKey", "CellKey"]:
        """A row's key as a run without ``--threads`` names it, and as one with them does."""
        return cls.of(row), cls.of(row, threads=True)


@dataclass
class Previous:
    """What a results file holds, as far as resuming goes."""

    path: Path
    #: The cells with a final status, and that status.
    finished: dict[CellKey, str] = field(default_factory=dict)
    #: Workload name -> the definition hashes measured under it.
    definitions: dict[str, set[str]] = field(default_factory=dict)
    #: The workloads the file holds rows of.
    workloads: set[str] = field(default_factory=set)


def read(path: Path) -> Previous:
    """Read (and validate, as ``compare`` does) a results file to resume. Raises ``ResultsError``
    naming the file: missing, not a results CSV, truncated, or of an older schema (its rows could
    not be appended to under one header)."""
    path = Path(path)
    df = results.read(path)  # every row already carries its cell's final status (``_join_statuses``)
    with open(path, newline="") as fh:
        header = next(csv.reader(fh), [])
    if header != results.COLUMNS:
        raise ResultsError(f"{path}: written by another version of benchbackend (its columns differ from schema "
                           f"{results.SCHEMA_VERSION}'s), so a resumed run cannot append to it: run into a new file")
    out = Previous(path, workloads={str(name) for name in df["workload"] if name})
    for name, digest in df[["workload", "workload_hash"]].drop_duplicates().itertuples(index=False):
        if digest:
            out.definitions.setdefault(name, set()).add(digest)
    ended = df[(df["phase"] == "run") & ~df["status"].isin(UNFINISHED)]
    out.finished = {key: str(row["status"]) for row in ended.to_dict("records") for key in CellKey.both(row)}
    return out


def check_definitions(previous: Previous, workloads: Iterable[Workload]) -> None:
    """A file that holds runs of a workload the command does not plan is an error (it is another
    run's file: the resumed rows would be appended to it, and its report redrawn with them), and so
    is a workload of the plan that the file measured under another definition: the resumed cells
    would not be comparable with the finished ones."""
    planned: dict[str, set[str]] = {}
    for w in workloads:
        planned.setdefault(w.name, set()).add(w.hash())
    others = sorted(previous.workloads - set(planned))
    if others:
        raise ResultsError(f"{previous.path}: holds runs of {', '.join(others)}, not this command's workloads "
                           f"({', '.join(planned)}): resume with the command that wrote it, or run into a new file")
    for name, hashes in planned.items():
        other = sorted(previous.definitions.get(name, set()) - hashes)
        if other:
            raise ResultsError(f"{previous.path}: {name} was measured with another definition (hash {other[0][:8]}); "
                               "the workload or --limit, --epochs, --batch-size or --seed changed since: "
                               "run it into a new file, or resume with the same options")


def prune(path: Path, rerun: set[CellKey]) -> int:
    """Remove the rows of the file's unfinished cells whose key is in ``rerun`` (atomically);
    return how many rows the file holds after."""
    path = Path(path)
    ended = {cell for cell, values in results.cell_values(path).items() if values.get("status") not in UNFINISHED}

    def rows(header: list[str], reader: Iterator[list[str]]) -> Iterator[list[str]]:
        for values in reader:
            row = dict(zip(header, values))
            if results.cell_id(row) not in ended and row["repeat"] and not rerun.isdisjoint(CellKey.both(row)):
                continue
            yield values

    return results.rewrite(path, rows)

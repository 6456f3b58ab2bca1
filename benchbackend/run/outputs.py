"""Where a run writes: its results CSV and its plots folder, checked before any worker starts.

An existing results file is never overwritten unless asked (``force``): the run writes beside it,
``name-2.csv``, ``name-3.csv``, ..., and says so. A path that cannot be written (under a file,
in a read-only or virtual folder such as ``/proc``, a folder itself) is an ``OutputError`` naming
the path and the reason, raised before anything is measured.
"""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import OutputError


@dataclass(frozen=True)
class Outputs:
    """The results CSV, its plots folder (None: no plots) and, when the CSV is not the path asked
    for, why (a line for the user)."""
    csv: Path
    plots: Optional[Path]
    note: str = ""


def plots_folder(csv: Path) -> Path:
    """The report folder beside a results CSV: ``<stem>-plots``."""
    return csv.with_name(csv.stem + "-plots")


def _free(path: Path) -> Path:
    """``path``, or the first ``<stem>-N<suffix>`` (N = 2, 3, ...) that holds neither a file nor a plots folder."""
    n = 2
    candidate = path
    while candidate.exists() or plots_folder(candidate).exists():
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
        n += 1
    return candidate


def _folder(file: Path, what: str) -> None:
    """Make the folder of ``file`` (and its parents), or raise an ``OutputError`` that says why not."""
    for parent in file.parents:
        if parent.exists():
            if not parent.is_dir():
                raise OutputError(f"{file}: cannot write {what}: {parent} is a file, not a folder")
            break
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{file}: cannot write {what}: {exc.strerror or exc}") from None


def _probe(path: Path) -> None:
    """Create ``path`` (then remove it) to learn whether it can be written: the permission bits
    do not tell (root may write anywhere that is a real file system, and nowhere in /proc)."""
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise OutputError(f"{path}: cannot write results: {exc.strerror or exc}") from None
    if not existed:
        path.unlink()


def choose(requested: Optional[Path], default: Path, *, force: bool, plots: bool) -> Outputs:
    """The results CSV (``requested``, or ``default`` when None) and plots folder of a run, checked.

    Without ``force`` an existing file (or its plots folder) is left alone and the next free
    ``<stem>-N`` is used, with a note; with ``force`` the file is overwritten."""
    path = Path(requested) if requested is not None else default
    if path.is_dir():
        raise OutputError(f"{path}: cannot write results: it is a folder (give a file name, e.g. {path / 'run.csv'})")
    _folder(path, "results")
    note = ""
    if not force:
        free = _free(path)
        if free != path and requested is not None:
            note = f"{path} exists (or its plots folder does); writing {free} instead (--force overwrites)"
        path = free
    _probe(path)
    folder = plots_folder(path) if plots else None
    if folder is not None and folder.exists() and not folder.is_dir():
        raise OutputError(f"{folder}: cannot write plots: it is a file, not a folder")
    if folder is not None and not os.access(path.parent, os.W_OK | os.X_OK):
        raise OutputError(f"{folder}: cannot write plots: {os.strerror(errno.EACCES)}")
    return Outputs(path, folder, note)

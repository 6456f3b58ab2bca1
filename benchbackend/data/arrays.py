"""A run's arrays: prepared once per workload, written to the .npz every worker reads, and named by
a checksum of their content, which the CSV records per cell (``data_sha256``) and a Ray node
checks before it uses a copy it made, cached or fetched (``executors/ray_node.py``)."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Optional

import numpy as np

from . import datasets as data
from . import language

if TYPE_CHECKING:
    from ..spec.workload import Workload


def checksum(arrays: Mapping[str, np.ndarray] | str | Path) -> str:
    """sha256 of a run's arrays, each by name, dtype, shape and bytes, in name order: the same for
    the same data however it is stored (an .npz's zip entries carry the time they were written).
    ``arrays``: a mapping of name to array, or the path of an .npz."""
    if not isinstance(arrays, Mapping):
        with np.load(arrays) as z:
            return checksum({k: z[k] for k in z.files})
    digest = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
        if a.size:  # an empty split (validation: 0) has no bytes, and memoryview cannot cast it
            digest.update(memoryview(a).cast("B"))
    return digest.hexdigest()


def of(workload: "Workload", ds: "data.Dataset") -> dict[str, np.ndarray]:
    """``ds`` with the workload's epoch orders (``data.epoch_orders``): what a worker reads."""
    return ds.arrays(data.epoch_orders(len(ds.y_train), workload.training.epochs, workload.seed))


class Prepared(NamedTuple):
    """A run's arrays as :func:`prepare` wrote them: where they came from, their checksum, sizes."""

    source: str
    sha256: str
    sizes: tuple[int, int, int]  # train, validation, test


def prepare(workload: "Workload", source: str, data_dir: Optional[Path], path: Path,
            progress: Optional[Any] = None) -> Prepared:
    """Load the workload's data (``data.load``: real, synthetic or the user's), draw its epoch
    orders and write both to the .npz ``path``, which every backend's worker reads."""
    ds = language.load(workload) if workload.next_token else data.load(workload, source, data_dir, progress=progress)
    arrays = of(workload, ds)
    np.savez(path, **arrays)
    return Prepared(ds.source, checksum(arrays), (len(ds.y_train), len(ds.y_val), len(ds.y_test)))

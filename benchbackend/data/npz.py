"""The user's own data: an .npz of arrays, read without pickle and checked against the workload.

The file holds ``x_train``, ``y_train``, ``x_test`` and ``y_test``, and may hold ``x_val`` and
``y_val`` (else validation is the *last* ``validation`` samples of ``x_train``, after the training
part, as for the canonical datasets). Images are uint8 (0..255, scaled by 1/255 like MNIST and
CIFAR-10) or float (used as they are, in float32); a sample's shape is the workload's
``input_shape``; labels are integers in ``[0, num_classes)``. It is loaded with
``allow_pickle=False``, so a file holding Python objects is refused, not executed. Every problem
is a :class:`~benchbackend.errors.DataError` of one line naming the file and the array.
"""
from __future__ import annotations

import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import DataError

if TYPE_CHECKING:
    from ..spec.workload import Workload

REQUIRED = ("x_train", "y_train", "x_test", "y_test")
OPTIONAL = ("x_val", "y_val")


def read(workload: "Workload") -> dict[str, np.ndarray]:
    """The six arrays of a run (``x_train``, ``y_train``, ``x_val``, ``y_val``, ``x_test``, ``y_test``)."""
    spec = workload.data
    path = Path(str(spec.path)).expanduser()
    arrays = _load(path)
    where = str(path)
    for part in ("train", "val", "test"):
        if f"x_{part}" in arrays:
            _check_pair(where, part, arrays, workload.input_shape, workload.num_classes)
    pool = len(arrays["y_train"])
    if "x_val" in arrays:
        x_val, y_val = arrays["x_val"], arrays["y_val"]
        if spec.validation > len(y_val):
            raise DataError(f"{where}: x_val holds {len(y_val)} samples; the workload needs validation "
                            f"{spec.validation}")
        x_val, y_val = x_val[:spec.validation], y_val[:spec.validation]
        need = spec.train
    else:
        x_val, y_val = arrays["x_train"][pool - spec.validation:], arrays["y_train"][pool - spec.validation:]
        need = spec.train + spec.validation
    if need > pool:
        extra = "" if "x_val" in arrays else f" + validation {spec.validation} (no x_val in the file)"
        raise DataError(f"{where}: x_train holds {pool} samples; the workload needs train {spec.train}{extra}")
    if spec.test > len(arrays["y_test"]):
        raise DataError(f"{where}: x_test holds {len(arrays['y_test'])} samples; the workload needs test {spec.test}")
    return {"x_train": arrays["x_train"][:spec.train].copy(), "y_train": arrays["y_train"][:spec.train].copy(),
            "x_val": x_val.copy(), "y_val": y_val.copy(),
            "x_test": arrays["x_test"][:spec.test].copy(), "y_test": arrays["y_test"][:spec.test].copy()}


def _load(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise DataError(f"{path}: no such file (the workload's data.path)")
    _check_is_npz(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            keys = list(z.files)
            unknown = sorted(set(keys) - set(REQUIRED) - set(OPTIONAL))
            if unknown:
                raise DataError(f"{path}: unexpected array '{unknown[0]}'; the file holds "
                                f"{', '.join(REQUIRED)} (and optionally {', '.join(OPTIONAL)})")
            missing = [k for k in REQUIRED if k not in keys]
            if missing:
                raise DataError(f"{path}: no array '{missing[0]}'; the file must hold {', '.join(REQUIRED)} "
                                f"(and optionally {', '.join(OPTIONAL)})")
            if ("x_val" in keys) != ("y_val" in keys):
                raise DataError(f"{path}: holds {'x_val' if 'x_val' in keys else 'y_val'} without its pair")
            arrays = {}
            for k in keys:
                try:
                    arrays[k] = z[k]
                except ValueError:  # numpy: "Object arrays cannot be loaded when allow_pickle=False"
                    raise DataError(f"{path}: '{k}' holds Python objects, which are not loaded "
                                    "(allow_pickle=False): save plain numeric arrays") from None
    except (OSError, zipfile.BadZipFile, EOFError, ValueError) as exc:
        raise DataError(f"{path}: not a readable .npz file ({type(exc).__name__}: {exc})") from None
    return arrays


def _check_is_npz(path: Path) -> None:
    """An .npz is a zip of .npy arrays; anything else (a CSV, one .npy) is named for what it is,
    rather than what ``np.load`` makes of it ("pickled data" for text, a bare array for an .npy)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(512)
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc.strerror}") from None
    if zipfile.is_zipfile(path):
        return
    if head.startswith(b"\x93NUMPY"):
        what = "it is a single .npy array"
    elif not head:
        what = "it is empty"
    else:
        try:
            head.decode("utf-8")
            what = "it is text"
        except UnicodeDecodeError:
            what = "it is not a zip archive"
    raise DataError(f"{path}: not an .npz file ({what}); write one with numpy.savez(path, x_train=..., "
                    "y_train=..., x_test=..., y_test=...)")


def _check_pair(where: str, part: str, arrays: dict[str, np.ndarray], shape: tuple[int, ...],
                num_classes: int) -> None:
    """Checks ``x_<part>``/``y_<part>`` in place; images become uint8 or float32."""
    x, y = arrays[f"x_{part}"], arrays[f"y_{part}"]
    if x.dtype != np.uint8 and not np.issubdtype(x.dtype, np.floating):
        raise DataError(f"{where}: x_{part} is {x.dtype}; images must be uint8 (0..255, scaled by 1/255) "
                        "or float (used as they are)")
    if x.ndim < 1 or tuple(x.shape[1:]) != tuple(shape):
        raise DataError(f"{where}: x_{part} samples are {tuple(x.shape[1:])}; the workload's input_shape is "
                        f"{tuple(shape)}")
    if np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float32)
        if not np.all(np.isfinite(x)):
            raise DataError(f"{where}: x_{part} holds NaN or infinite values")
        arrays[f"x_{part}"] = x
    if not np.issubdtype(y.dtype, np.integer) or y.ndim != 1:
        raise DataError(f"{where}: y_{part} is {y.dtype} of shape {y.shape}; labels must be integers, one per "
                        "sample")
    if len(y) != len(x):
        raise DataError(f"{where}: x_{part} holds {len(x)} samples but y_{part} {len(y)} labels")
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        bad = int(y.min()) if int(y.min()) < 0 else int(y.max())
        raise DataError(f"{where}: y_{part} holds label {bad}, out of range for {num_classes} classes (0.."
                        f"{num_classes - 1})")
    arrays[f"y_{part}"] = y.astype(np.int64)

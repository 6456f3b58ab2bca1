"""A user's ``.npz`` knows its own sizes: ``data: {dataset: npz, path: mine.npz}`` is enough.

``fill`` reads the file's arrays' shapes (and its labels, for the number of classes) before the
workload is validated, and fills in what the YAML leaves out; what the YAML gives is kept (an
override):

- ``input_shape``: one ``x_train`` sample's shape;
- ``num_classes``: the largest label (of every split) plus one; when some label below it never
  occurs, that is refused: say ``num_classes`` yourself;
- ``test``: every sample of ``x_test``;
- ``validation``: every sample of ``x_val`` when the file has one, else a tenth of ``x_train``
  (at least one sample), its last samples;
- ``train``: the rest of ``x_train``.

NumPy only (``allow_pickle=False``): the spec reads no data module. The arrays themselves are
checked later, when they are read for a run (``data/npz.py``).
"""
from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import numpy as np

FIELDS = ("input_shape", "num_classes", "train", "validation", "test")


def fill(data: Any, where: Path) -> Any:
    """``data`` (the YAML's mapping) with the .npz's defaults; ``where`` is the YAML's folder, which a
    relative ``path`` is read from. Raises ``ValueError`` (one line naming the file) when a field is
    left out and the file cannot give it."""
    if not isinstance(data, dict) or data.get("dataset") != "npz" or not isinstance(data.get("path"), str):
        return data
    missing = [f for f in FIELDS if f not in data]
    if not missing:
        return data
    path = Path(data["path"]).expanduser()
    path = path if path.is_absolute() else where / path
    try:
        with np.load(path, allow_pickle=False) as z:
            names = set(z.files)
            need = {"x_train", "y_train", "x_test", "y_test"} - names
            if need:
                raise ValueError(f"it has no {', '.join(sorted(need))}")
            labels = [np.asarray(z[k]) for k in ("y_train", "y_val", "y_test") if k in names]
            shapes = {k: z[k].shape for k in ("x_train", "x_val", "x_test") if k in names}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path}: cannot read the .npz for `{missing[0]}` ({exc}); give `{missing[0]}` in the "
                         "YAML or a readable file") from None
    out = dict(data)
    n_train, n_val = shapes["x_train"][0], shapes["x_val"][0] if "x_val" in shapes else None
    validation = out.setdefault("validation", n_val if n_val is not None else max(1, n_train // 10))
    out.setdefault("train", n_train if n_val is not None else n_train - validation)
    out.setdefault("test", shapes["x_test"][0])
    out.setdefault("input_shape", list(shapes["x_train"][1:]))
    if "num_classes" not in out:
        seen = np.unique(np.concatenate([y.reshape(-1) for y in labels]).astype(np.int64))
        top = int(seen.max()) + 1 if seen.size else 0
        skipped = sorted(set(range(top)) - set(seen.tolist()))
        if skipped:
            shown = ", ".join(map(str, skipped[:5])) + (", ..." if len(skipped) > 5 else "")
            raise ValueError(f"{path}: labels 0..{top - 1} but {shown} never occur: say `num_classes` in the YAML "
                             "(the labels cannot tell whether a class is missing or absent)")
        out["num_classes"] = top
    return out

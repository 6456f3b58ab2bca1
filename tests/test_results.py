"""The results CSV: writer round trip, status rewrite, and one-line errors for bad files."""
from __future__ import annotations

import numpy as np
import pytest

from benchbackend import results
from benchbackend.errors import ResultsError


def _row(**kw):
    return {"workload": "mnist", "backend": "torch", "device": "cpu", "repeat": 1, "phase": "train_epoch",
            "epoch": 1, "seconds": np.float64(1.25), "loss": float("nan"), "status": "ok", **kw}


def test_round_trip_with_numpy_scalars_and_nan(tmp_path):
    w = results.CsvWriter(tmp_path / "r.csv")
    w.write(_row(message="a, quoted\nmessage"))
    w.write(_row(epoch=2, loss=np.float32(0.5), samples=np.int64(64)))
    df = results.read(tmp_path / "r.csv")
    assert list(df.columns[:len(results.COLUMNS)]) == results.COLUMNS
    assert df["seconds"].tolist() == [1.25, 1.25]
    assert np.isnan(df["loss"][0]) and df["loss"][1] == 0.5 and df["samples"][1] == 64
    assert df["message"][0] == "a, quoted\nmessage"


def test_finalize_rewrites_only_the_cell(tmp_path):
    w = results.CsvWriter(tmp_path / "r.csv")
    torch_row = w.write(_row())
    w.write(_row(backend="tensorflow"))
    w.finalize([torch_row], "nan_loss", time_to_accuracy_s=float("inf"))
    df = results.read(tmp_path / "r.csv")
    assert df.set_index("backend")["status"].to_dict() == {"torch": "nan_loss", "tensorflow": "ok"}
    assert df.set_index("backend")["time_to_accuracy_s"].to_dict()["torch"] == float("inf")


@pytest.mark.parametrize("mutate, needle", [
    (lambda t: t[: t.rindex(",", 0, len(t) - 40)], "truncated"),
    (lambda t: t.rstrip("\n"), "truncated"),
    (lambda t: t.replace(f"\n{results.SCHEMA_VERSION},", "\n99,", 1), "schema_version 99 is newer"),
    (lambda t: t.replace("1.25", "fast", 1), "column seconds is not a number: 'fast'"),
    (lambda t: "a,b\n1,2\n", "missing columns"),
    (lambda t: "", "empty file"),
])
def test_bad_files_give_one_line_naming_the_file(tmp_path, mutate, needle):
    p = tmp_path / "r.csv"
    w = results.CsvWriter(p)
    w.write(_row())
    w.write(_row(epoch=2))
    p.write_text(mutate(p.read_text()))
    with pytest.raises(ResultsError) as err:
        results.read(p)
    assert str(p) in str(err.value) and needle in str(err.value)
    assert "\n" not in str(err.value)


def test_worst_status_orders_failures():
    assert results.worst_status(["ok", "chance_accuracy", "nan_loss"]) == "nan_loss"
    assert results.worst_status(["ok", "ok"]) == "ok"

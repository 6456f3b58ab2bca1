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


def _cell(**kw):
    return _row(run_id="r1", status="pending", **kw)


def test_a_cells_run_row_gives_every_row_of_the_cell_its_status(tmp_path):
    """While the run goes rows are only appended: the reader joins a cell's final status from its
    `run` row; `close` rewrites the file once so that pandas sees final statuses too."""
    path = tmp_path / "r.csv"
    w = results.CsvWriter(path)
    w.write(_cell(cell_order=0))
    w.write(_cell(cell_order=1, backend="tensorflow"))
    w.end_cell(_cell(cell_order=0, time_to_accuracy_s=float("inf")), "nan_loss")
    w.write(_cell(cell_order=2, backend="jax"))  # never ended: its parent was killed
    w.end_cell(_cell(cell_order=1, backend="tensorflow"), "ok")
    assert path.read_text().count(",pending,") == 3  # nothing rewritten before close
    for closed in (False, True):
        if closed:
            w.close()
            assert path.read_text().count(",pending,") == 1  # the cell that never ended
        df = results.read(path)
        status = df[df.phase == "train_epoch"].set_index("backend")["status"].to_dict()
        assert status == {"torch": "nan_loss", "tensorflow": "ok", "jax": "pending"}
        tta = df[(df.phase == "run") & (df.backend == "torch")]["time_to_accuracy_s"]
        assert tta.tolist() == [float("inf")]


def test_the_writer_appends_and_its_cost_is_linear(tmp_path):
    """No rewrite before close: the file grows by appends only (a quadratic rewrite per cell was
    the old cost); close rewrites it once."""
    path = tmp_path / "r.csv"
    w = results.CsvWriter(path)
    sizes = []
    for order in range(50):
        for epoch in range(1, 4):
            w.write(_cell(cell_order=order, epoch=epoch))
        w.end_cell(_cell(cell_order=order), "ok")
        sizes.append(path.stat().st_size)
    inode = path.stat().st_ino
    assert path.stat().st_ino == inode and sizes == sorted(sizes)
    w.close()
    assert set(results.read(path)["status"]) == {"ok"} and w.rows == 200


def test_a_file_written_before_schema_3_gets_its_definition_columns(tmp_path):
    from benchbackend.results import COLUMNS

    path = tmp_path / "old.csv"
    old = [c for c in COLUMNS if c not in ("cell_order", "notes", *results.DEFINITION_COLUMNS)]
    row = {**_row(), "schema_version": 2, "definition": "train=1024 val=256 test=256 epochs=2 batch=32 "
                                                          "infer_batch=64 seed=3 data=synthetic"}
    path.write_text(",".join(old) + "\n" + ",".join(str(row.get(c, "")) for c in old) + "\n")
    df = results.read(path)
    assert df[list(results.DEFINITION_COLUMNS)].iloc[0].tolist() == [1024, 2, 32, 64, 3]


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

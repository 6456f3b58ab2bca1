"""The CSV as pandas sees it (issue 24, item 13): the definition as columns, one meaning per column
(``epoch`` only the epoch, ``pass`` the inference pass, ``notes`` apart from ``message``), one
device name per device, and older files read as the current schema says them."""
from __future__ import annotations

import csv
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from benchbackend import results
from benchbackend.cli import main
from benchbackend.data import arrays
from benchbackend.spec import workload


def _run(monkeypatch, tmp_path: Path, *args: str) -> Path:
    from support import inprocess

    inprocess.use(monkeypatch)
    out = tmp_path / "r.csv"
    got = CliRunner().invoke(main, ["run", "mnist", "-b", "numpy", "--data", "synthetic", "--limit", "200",
                                    "--repeats", "1", "--no-plots", "--quiet", "-o", str(out), *args])
    assert got.exit_code in (0, 1), got.output[-2000:]
    return out


def test_a_run_writes_the_definition_and_one_meaning_per_column(monkeypatch, tmp_path):
    path = _run(monkeypatch, tmp_path, "--epochs", "2", "--parity-steps", "2", "--batch-size", "50")
    raw = pd.read_csv(path, dtype=str, keep_default_na=False)  # as a user reads it, no benchbackend
    assert set(raw["schema_version"]) == {str(results.SCHEMA_VERSION)} and results.SCHEMA_VERSION == 14
    # Schema 14: the reference keeps no compiled programs (--compile-cache: nothing to say).
    assert set(raw["compile_cache"]) == {""} and set(raw["compile_cache_hit"]) == {""}
    # Schema 13: each epoch's losses audited (run/loss_audit.py): epoch 1's first step and the 2
    # trajectory steps (step 1 is both), epoch 2's first step; no step that differs.
    epochs = raw[raw["phase"] == "train_epoch"]
    assert epochs["loss_audited"].tolist() == ["2", "1"] and set(epochs["audit_step"]) == {""}
    # Schema 12: every timed row has an MFU no higher than 1 or says why it has none; a CPU cell's
    # rows say whether the CPU has bf16 instructions (this machine's own flags).
    timed = raw[raw["phase"].isin(["train_epoch", "inference"])]
    assert all((m != "" and 0 < float(m) <= 1) != (why != "") for m, why in zip(timed["mfu"], timed["mfu_missing"]))
    assert set(timed["cpu_bf16"]) <= {"True", "False"} and timed["cpu_bf16"].nunique() == 1
    # And the quality gate's declaration on every row, and its verdict, judged as the run
    # ended, on every row of the cell (one fp32 cell: its own baseline, so pass unless its checks failed).
    assert set(raw["quality_metric"]) == {"val_accuracy"} and set(raw["quality_target"]) == {"0.99 of fp32"}
    assert len(set(raw["gate"])) == 1 and set(raw["gate"]) <= {"pass", "not_judged"}
    assert raw["gate_reason"].iloc[0] and set(raw["quality_samples"]) == {"256"}
    # Schema 9: every timed row says how much of the cell's cores other processes held (a share),
    # every row the load average as the cell started; the rows that time nothing say nothing.
    timed = raw[raw["phase"].isin(["build", "train_epoch", "inference"])]
    assert timed["foreign_cpu_share"].astype(float).between(0, 1).all()
    assert set(raw.loc[raw["phase"] == "parity", "foreign_cpu_share"]) == {""}
    assert (raw.loc[raw["phase"] != "run", "load_avg"].astype(float) >= 0).all()
    # Schema 5: one attempt per cell here, and the arrays every row was measured on.
    assert set(raw["attempt"]) == {"1"} and set(raw["data_origin"]) == {"local"}
    # Schema 6: the data placement rule on every row (a CPU holds every array); the device's peak
    # memory on each row that has peak_rss_mb, empty on a CPU (no device counter).
    assert set(raw["data_on_device"]) == {"True"}
    memory = raw[raw["peak_rss_mb"] != ""]
    assert set(memory["phase"]) == {"build", "train_epoch", "inference"} and set(raw["peak_device_mb"]) == {""}
    w = workload.load("mnist").with_overrides(limit=200, epochs=2, batch_size=50)
    assert set(raw["data_sha256"]) == {arrays.prepare(w, "synthetic", None, tmp_path / "a.npz").sha256}
    # The definition as real columns on every row, not parsed out of `definition`.
    assert set(raw["batch_size"]) == {"50"} and set(raw["epochs"]) == {"2"} and set(raw["limit"]) == {"200"}
    assert set(raw["inference_batch_size"]) == {"50"}  # --batch-size sets both
    by_phase = {phase: rows for phase, rows in raw.groupby("phase")}
    # `epoch` is the epoch of a train_epoch row and nothing else.
    assert by_phase["train_epoch"]["epoch"].tolist() == ["1", "2"]
    assert (raw.loc[raw["phase"] != "train_epoch", "epoch"] == "").all()
    # The inference pass has its own column.
    passes = by_phase["inference"]["pass"].tolist()
    assert passes == [str(i) for i in range(1, len(passes) + 1)] and len(passes) >= 2
    assert (raw.loc[raw["phase"] != "inference", "pass"] == "").all()
    # The trajectory row: its steps in `steps`, no diverging step (`parity_step` empty), no epoch.
    trajectory = by_phase["parity"][by_phase["parity"]["steps"] != ""]
    assert trajectory["steps"].tolist() == ["2"] and trajectory["parity_step"].tolist() == [""]
    assert "steps agree" in trajectory["notes"].iloc[0]
    # `message` is only a failure's reason, on the cell's run row.
    assert (raw.loc[raw["phase"] != "run", "message"] == "").all()
    assert set(raw["device"]) == {"cpu"}


@pytest.mark.parametrize("given, canonical", [
    ("cpu", "cpu"), ("cpu:0", "cpu"), ("/CPU:0", "cpu"), ("llvm_cpu.0", "cpu"),
    ("cuda", "gpu:0"), ("cuda:0", "gpu:0"), ("gpu:1", "gpu:1"), ("/GPU:1", "gpu:1"),
    ("tpu:0", "tpu:0"), ("opencl_amd_gfx900.0", "opencl_amd_gfx900.0"),
])
def test_one_device_has_one_name_across_backends(given, canonical):
    assert results.canonical_device(given) == canonical


def test_the_writer_names_a_device_canonically(tmp_path):
    path = tmp_path / "r.csv"
    w = results.CsvWriter(path)
    for backend, device in (("torch", "cpu"), ("tensorflow", "cpu:0")):
        w.write({"workload": "mnist", "backend": backend, "device": device, "repeat": 1, "phase": "train_epoch",
                 "epoch": 1, "seconds": 1.0, "status": "ok"})
    assert set(pd.read_csv(path, dtype=str)["device"]) == {"cpu"}


def _old_file(path: Path, version: int, rows: list[dict]) -> Path:
    """A file as an older benchbackend wrote it: its columns only, its schema_version."""
    later = ("pass", "attempt", "data_sha256", "data_origin", "math_mode", "data_on_device", "peak_device_mb",
             "replicas", "scale_lr")
    columns = [c for c in results.COLUMNS if c not in later]
    if version < 3:
        columns = [c for c in columns if c not in ("cell_order", "notes", *results.DEFINITION_COLUMNS)]
    with open(path, "w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(columns)
        for row in rows:
            full = {"schema_version": version, "workload": "mnist", "backend": "tensorflow", "device": "cpu:0",
                    "mode": "tf.function", "repeat": 1, "seconds": 0.5, "status": "ok", "run_id": "r1", **row}
            out.writerow([full.get(c, "") for c in columns])
    return path


@pytest.mark.parametrize("version", [2, 3])
def test_an_older_file_is_read_as_the_current_schema_says_it(tmp_path, version):
    path = _old_file(tmp_path / "old.csv", version, [
        {"phase": "build", "epoch": 0, "message": "cpu_capability AVX512" if version < 3 else "",
         "notes": "cpu_capability AVX512"},
        {"phase": "parity", "epoch": 0, "samples": 8, "parity_max_abs": 1e-8, "parity_max_rel": 1e-7},
        {"phase": "parity", "epoch": 5, "steps": 5, "message": "5 steps agree within 0.001" if version < 3 else "",
         "notes": "5 steps agree within 0.001"},
        {"phase": "train_epoch", "epoch": 1, "samples": 100},
        {"phase": "train_epoch", "epoch": 2, "samples": 100},
        {"phase": "inference", "epoch": 1, "samples": 50},
        {"phase": "inference", "epoch": 2, "samples": 50},
        {"phase": "run", "epoch": 0, "status": "timeout", "message": "worker timed out after 60s"},
    ])
    df = results.read(path)
    phase = df["phase"]
    assert set(df["attempt"]) == {1}  # before schema 5, a cell had one attempt
    assert set(df["data_on_device"]) == {""} and df["peak_device_mb"].isna().all()  # not recorded before 6
    assert set(df["replicas"]) == {1} and set(df["scale_lr"]) == {"none"}  # before 7: one replica, lr as given
    assert df.loc[phase == "train_epoch", "epoch"].tolist() == [1, 2]
    assert df.loc[phase != "train_epoch", "epoch"].isna().all()
    assert df.loc[phase == "inference", "pass"].tolist() == [1, 2]
    assert df.loc[phase != "inference", "pass"].isna().all()
    assert set(df["device"]) == {"cpu"}
    assert df.loc[phase == "build", "notes"].tolist() == ["cpu_capability AVX512"]
    assert df.loc[(phase == "parity") & df["steps"].notna(), "notes"].tolist() == ["5 steps agree within 0.001"]
    assert df.loc[df["message"] != "", "phase"].tolist() == ["run"]


def test_a_schema_5_file_reads_with_placement_and_device_memory_unknown(tmp_path):
    path = tmp_path / "v5.csv"
    columns = [c for c in results.COLUMNS if c not in ("data_on_device", "peak_device_mb")]
    with open(path, "w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(columns)
        row = {"schema_version": 5, "workload": "mnist", "backend": "torch", "device": "cpu", "repeat": 1,
               "phase": "train_epoch", "epoch": 1, "seconds": 0.5, "status": "ok", "peak_rss_mb": 900.0}
        out.writerow([row.get(c, "") for c in columns])
    df = results.read(path)
    assert df["peak_rss_mb"].tolist() == [900.0] and df["peak_device_mb"].isna().all()
    assert df["data_on_device"].tolist() == [""]


def test_a_newer_schema_is_refused(tmp_path):
    path = tmp_path / "new.csv"
    path.write_text(",".join(results.COLUMNS) + "\n"
                    + ",".join(str(results.SCHEMA_VERSION + 1) if c == "schema_version" else
                               {"workload": "mnist", "backend": "numpy", "device": "cpu", "repeat": "1",
                                "phase": "run", "seconds": "0", "status": "ok"}.get(c, "")
                               for c in results.COLUMNS) + "\n")
    from benchbackend.errors import ResultsError

    with pytest.raises(ResultsError, match=f"schema_version {results.SCHEMA_VERSION + 1} is newer"):
        results.read(path)

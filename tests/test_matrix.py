"""The harness side of the matrix: batch-size sweeps, MFU columns, time to accuracy (numpy backend)."""
from __future__ import annotations

import math

import pytest

from benchbackend import results
from benchbackend.run import checks
from conftest import cli, mnist_with_target


@pytest.mark.slow
def test_batch_size_sweep_is_a_matrix_dimension_with_mfu_on_every_timed_row(tmp_path):
    out = tmp_path / "sweep.csv"
    r = cli("run", "mnist", "-b", "numpy", "--batch-size", "32", "--batch-size", "64", "--peak-tflops", "0.5",
            "--inference-only", "--data", "synthetic", "--limit", "256", "--repeats", "1", "-o", str(out),
            "--no-plots")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "mnist b32/numpy" in r.stderr and "mnist b64/numpy" in r.stderr
    df = results.read(out)
    assert df["workload_hash"].nunique() == 2  # two experiment definitions
    assert {d.split("infer_batch=")[1].split()[0] for d in df["definition"]} == {"32", "64"}
    timed = df[df.phase == "inference"]
    assert len(timed) == 2 * 5
    expected = timed["flops_per_sample"] * timed["samples_per_s"]  # inference: one forward per sample
    assert ((timed["achieved_flops"] - expected).abs() <= 1e-9 * expected).all()
    assert ((timed["mfu_datasheet"] - timed["achieved_flops"] / 0.5e12).abs() <= 1e-12).all()
    assert set(timed["peak_datasheet_flops"]) == {0.5e12}  # beside the probe's MFU, not instead of it
    assert ((timed["mfu"] - timed["achieved_flops"] / timed["peak_flops"]).abs() <= 1e-9).all()
    # The device's one peak: the best GEMM probe taken on it, whichever framework's (the suite's shared
    # cache may hold TensorFlow's from an earlier test), the same on every row.
    assert timed["peak_source"].str.contains("GEMM probe").all() and timed["peak_flops"].nunique() == 1
    assert timed["peak_source"].nunique() == 1


@pytest.mark.slow
def test_training_rows_count_three_forward_passes_per_sample(tmp_path):
    out = tmp_path / "train.csv"
    r = cli("run", "mnist", "-b", "numpy", "--peak-tflops", "1", "--data", "synthetic", "--limit", "256",
            "--epochs", "1", "--repeats", "1", "-o", str(out), "--no-plots")
    df = results.read(out)
    epoch = df[df.phase == "train_epoch"].iloc[0]
    assert epoch["achieved_flops"] == pytest.approx(3 * epoch["flops_per_sample"] * epoch["samples_per_s"]), r.stderr


@pytest.mark.slow
def test_time_to_accuracy_is_the_training_time_until_the_target(tmp_path):
    rows = [{"phase": "train_epoch", "epoch": e, "seconds": s, "val_accuracy": a}
            for e, s, a in ((1, 2.0, 0.3), (2, 1.5, 0.6), (3, 1.0, 0.9))]
    assert checks.time_to_accuracy(rows, 0.5) == pytest.approx(3.5)
    assert checks.time_to_accuracy(rows, 0.3) == pytest.approx(2.0)
    assert checks.time_to_accuracy(rows, 0.95) == math.inf
    path = mnist_with_target(tmp_path, "mnist_tta", 0.5)
    out = tmp_path / "tta.csv"
    r = cli("run", str(path), "-b", "numpy", "--data", "synthetic", "--limit", "1024", "--epochs", "2",
            "--repeats", "1", "-o", str(out), "--no-plots")
    df = results.read(out)
    epochs = df[df.phase == "train_epoch"].sort_values("epoch")
    reached = epochs[epochs["val_accuracy"] >= 0.5]
    want = epochs["seconds"].cumsum()[reached.index[0]] if len(reached) else math.inf
    assert set(df["time_to_accuracy_s"]) == {want}, r.stderr[-1500:]
    assert "time to accuracy 0.5" in r.stderr


@pytest.mark.slow
def test_a_threads_sweep_is_a_matrix_dimension_whose_counts_never_pool(tmp_path):
    """``--threads 1 --threads 2``: each count its own cells, tags and experiment; a resume knows them apart."""
    from benchbackend.analysis import compare

    out = tmp_path / "threads.csv"
    args = ("run", "mnist", "-b", "numpy", "--threads", "1", "--threads", "2", "--inference-only", "--data",
            "synthetic", "--limit", "128", "--repeats", "1", "--no-plots")
    r = cli(*args, "-o", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "[mnist/numpy:reference/fp32 t1 r1/1]" in r.stderr and "[mnist/numpy:reference/fp32 t2 r1/1]" in r.stderr
    df = results.read(out)
    assert sorted(df.loc[df.phase == "inference", "threads"].unique()) == [1, 2]
    groups = compare.run_compare([str(out)]).groups.reset_index()
    assert sorted(groups["experiment"]) == ["mnist (threads 1)", "mnist (threads 2)"]
    again = cli(*args, "--resume", str(out))
    assert again.returncode == 0 and "2 of 2 cells had finished; nothing left to run" in again.stderr, again.stderr

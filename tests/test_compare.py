"""`compare`: ratios, significance, ranking of correct backends only, warnings, formats, exit codes.

Every CSV here is written by the real ``results.CsvWriter`` from known distributions.

Over 400 lines: one test per rule of compare's output, each on its own small CSV; they share the
writers at the top.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from io import StringIO
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pandas as pd
import pytest

from benchbackend import results
from benchbackend.analysis import compare
from benchbackend.errors import ResultsError

ROOT = Path(__file__).resolve().parent.parent
ENV = {"host": "bench-1", "os": "Linux-6.1", "python": "3.11.7", "cpu": "Xeon x16", "gpu": ""}


def write_cells(writer: results.CsvWriter, backend: str, steady: float, *, repeats: int = 5, seed: int = 0,
                noise: float = 0.03, epochs: int = 4, passes: int = 5, infer: Optional[float] = None,
                status: str = "ok", workload: str = "mnist", device: str = "cpu", mode: str = "",
                run_id: str = "run1", workload_hash: str = "h1", backend_version: str = "1.0",
                parity: float = 1e-7, statuses: Optional[dict[int, str]] = None, samples: int = 1000,
                test_samples: int = 500, first_pass: Optional[float] = None, inference_only: bool = False,
                flops: Optional[float] = None, peak: Optional[tuple[float, str]] = None,
                tta: Optional[list[float]] = None, **env: Any) -> None:
    """Rows of ``repeats`` fresh-process repeats whose steady epoch time is ``steady`` * (1 + noise * N(0, 1)).

    ``statuses`` gives some repeats their own status (e.g. {3: "crashed"}); a crashed, timed-out or
    interrupted repeat has one epoch of 1/10 the time (a partial epoch) and a ``run`` row.
    ``flops`` (forward FLOPs per sample) gives timed rows achieved_flops as the runner writes them
    (training 3x), and ``peak`` = (FLOP/s, source) their mfu; ``tta`` is each repeat's
    time_to_accuracy_s (inf: not reached), on every row of the repeat as the runner writes it.
    """
    rng = np.random.default_rng(seed)
    infer = steady / 4 if infer is None else infer
    for rep in range(1, repeats + 1):
        rep_status = (statuses or {}).get(rep, status)
        base: dict[str, Any] = dict(ENV, run_id=run_id, workload=workload, workload_hash=workload_hash,
                                    backend=backend, backend_version=backend_version, device=device, mode=mode,
                                    repeat=rep, status=rep_status, inference_only=inference_only)
        base.update(env)
        if peak is not None:
            base.update(peak_flops=peak[0], peak_source=peak[1])
        if tta is not None:
            base["time_to_accuracy_s"] = tta[rep - 1]

        def rates(phase: str, rate: float) -> dict[str, Any]:
            if flops is None:
                return {}
            achieved = (3 if phase == "train_epoch" else 1) * flops * rate
            return {"achieved_flops": achieved, "mfu": achieved / peak[0] if peak else None}

        writer.write(dict(base, phase="build", seconds=0.05, params=1000))
        writer.write(dict(base, phase="parity", seconds=0.01, parity_max_abs=parity,
                          parity_max_rel=parity * 10))
        if rep_status in ("crashed", "timeout", "interrupted", "pending"):
            writer.write(dict(base, phase="train_epoch", epoch=1, samples=samples, seconds=steady / 10,
                              samples_per_s=samples * 10 / steady, loss=2.0, val_loss=2.0, val_accuracy=0.5))
            writer.write(dict(base, phase="train_epoch", epoch=2, samples=samples, seconds=steady / 10,
                              samples_per_s=samples * 10 / steady, loss=2.0, val_loss=2.0, val_accuracy=0.5))
            writer.write(dict(base, phase="run", message=f"RuntimeError: {rep_status} in repeat {rep}"))
            continue
        rep_steady = steady * (1 + noise * float(rng.standard_normal()))
        rep_infer = infer * (1 + noise * float(rng.standard_normal()))
        for epoch in range(1, (0 if inference_only else epochs) + 1):
            seconds = 3 * steady if epoch == 1 else rep_steady * (1 + 0.005 * float(rng.standard_normal()))
            loss = float("nan") if rep_status == "nan_loss" and epoch > 1 else 2.0 / epoch
            writer.write(dict(base, phase="train_epoch", epoch=epoch, samples=samples, seconds=seconds,
                              samples_per_s=samples / seconds, loss=loss, accuracy=0.9, val_loss=loss,
                              val_accuracy=0.5 + 0.1 * epoch, **rates("train_epoch", samples / seconds)))
        for n in range(1, passes + 1):
            seconds = rep_infer * (1 + 0.005 * float(rng.standard_normal()))
            if n == 1 and first_pass is not None:
                seconds = first_pass
            writer.write(dict(base, phase="inference", **{"pass": n}, samples=test_samples, seconds=seconds,
                              samples_per_s=test_samples / seconds, **rates("inference", test_samples / seconds)))


def groups_json(paths: list[Path], **kw: Any) -> tuple[dict[str, dict[str, Any]], compare.CompareOutcome]:
    out = compare.run_compare([str(p) for p in paths], fmt="json", **kw)
    data = json.loads(out.text)
    return {g["label"]: g for g in data["groups"]}, out


@pytest.fixture
def two_x(tmp_path: Path) -> Path:
    """tensorflow takes 2 s an epoch, torch 1 s: a true 2x difference over 5 repeats."""
    path = tmp_path / "two_x.csv"
    w = results.CsvWriter(path)
    write_cells(w, "tensorflow", 2.0, seed=1)
    write_cells(w, "torch", 1.0, seed=2)
    return path


_VS = re.compile(r"(faster|slower|not significant): ([\d.]+)x \[([\d.]+)-([\d.]+)\]")


def test_true_2x_difference_is_significant_and_about_2x(two_x: Path) -> None:
    groups, out = groups_json([two_x], baseline="tensorflow")
    torch = groups["torch"]
    assert torch["baseline"] == "tensorflow"
    assert 1.85 < torch["train_ratio"] < 2.15
    assert torch["train_verdict"] == "faster" and torch["train_p"] < 0.05
    assert 1 < torch["train_ratio_low"] < torch["train_ratio"] < torch["train_ratio_high"]
    assert torch["infer_verdict"] == "faster" and 1.8 < torch["infer_ratio"] < 2.2
    assert torch["fastest_train"] and torch["fastest_infer"]
    assert groups["tensorflow"]["train_verdict"] == "baseline"
    assert out.exit_code == 0 and out.warnings == []
    text = compare.run_compare([str(two_x)], baseline="tensorflow").text
    assert "faster: 1.96x [1.85-2.07]" in text and "fastest correct (*): training torch" in text


def test_one_convention_for_every_line(two_x: Path) -> None:
    """The header states the convention; a slower backend reads 'slower: 0.5x [..]' (speed-up
    below 1), never an inverted number with another meaning."""
    text = compare.run_compare([str(two_x)], baseline="torch").text
    assert "speed-up = baseline's time / this time (>1: faster)" in text.splitlines()[0]
    tf_line = next(ln for ln in text.splitlines() if ln.lstrip("* ").startswith("tensorflow") and "slower" in ln)
    verdict, ratio, low, high = _VS.search(tf_line).groups()
    assert verdict == "slower" and 0.45 < float(ratio) < 0.55 and float(low) <= float(ratio) <= float(high) < 1


def test_verdicts_in_the_table_agree_with_their_intervals(tmp_path: Path) -> None:
    """Every vs cell of a noisy 3-repeat comparison: the verdict matches the interval's side of 1."""
    path = tmp_path / "noisy3.csv"
    w = results.CsvWriter(path)
    for i, (backend, t) in enumerate([("torch", 1.0), ("tensorflow", 1.3), ("onnxruntime", 1.05),
                                      ("plaidml", 4.8)]):
        write_cells(w, backend, t, repeats=3, noise=0.15, seed=10 + i)
    text = compare.run_compare([str(path)]).text
    cells = _VS.findall(text)
    assert len(cells) >= 6
    for verdict, ratio, low, high in cells:
        r, lo, hi = float(ratio), float(low), float(high)
        assert lo <= r <= hi
        assert (verdict == "not significant") == (lo <= 1 <= hi)
        assert verdict != "faster" or lo > 1
        assert verdict != "slower" or hi < 1


def test_same_distribution_is_not_significant(tmp_path: Path) -> None:
    path = tmp_path / "same.csv"
    w = results.CsvWriter(path)
    write_cells(w, "tensorflow", 1.0, seed=100)
    write_cells(w, "torch", 1.0, seed=200)
    groups, _ = groups_json([path], baseline="tensorflow")
    assert groups["torch"]["train_verdict"] == "not significant"
    assert groups["torch"]["infer_verdict"] == "not significant"
    assert groups["torch"]["train_ratio_low"] < 1 < groups["torch"]["train_ratio_high"]


def test_three_repeats_can_be_significant(tmp_path: Path) -> None:
    """3 against 3: a rank test can never reach 0.05; Welch's t on log times can."""
    path = tmp_path / "three.csv"
    w = results.CsvWriter(path)
    write_cells(w, "tensorflow", 2.0, repeats=3, seed=1)
    write_cells(w, "torch", 1.0, repeats=3, seed=2)
    groups, out = groups_json([path], baseline="tensorflow")
    assert groups["torch"]["train_verdict"] == "faster"
    assert not any("fewer than 3" in w for w in out.warnings)


def _exact_cells(writer: results.CsvWriter, backend: str, steady: list[float], infer: list[float]) -> None:
    """One repeat per value: its steady epochs take exactly ``steady[i]`` seconds (the first three
    times that), its inference passes exactly ``infer[i]``."""
    for rep, (epoch_s, pass_s) in enumerate(zip(steady, infer), start=1):
        base = dict(ENV, run_id="run1", workload="mnist", workload_hash="h1", backend=backend,
                    backend_version="1.0", device="cpu", repeat=rep, status="ok")
        writer.write(dict(base, phase="build", seconds=0.05, params=1000))
        for epoch in (1, 2, 3):
            seconds = 3 * epoch_s if epoch == 1 else epoch_s
            writer.write(dict(base, phase="train_epoch", epoch=epoch, samples=1000, seconds=seconds,
                              samples_per_s=1000 / seconds, loss=1.0, val_loss=1.0, val_accuracy=0.9))
        for n in (1, 2, 3):
            writer.write(dict(base, phase="inference", **{"pass": n}, samples=500, seconds=pass_s,
                              samples_per_s=500 / pass_s))


def test_identical_timings_on_both_sides_get_an_exact_ratio_and_a_verdict(tmp_path: Path) -> None:
    """Every repeat of each side timed alike: an exact ratio with a verdict, not 'too few repeats'."""
    path = tmp_path / "exact.csv"
    w = results.CsvWriter(path)
    _exact_cells(w, "tensorflow", [2.0] * 3, [0.5] * 3)
    _exact_cells(w, "torch", [1.0] * 3, [0.5] * 3)
    groups, _ = groups_json([path], baseline="tensorflow")
    torch = groups["torch"]
    assert torch["train_verdict"] == "faster" and torch["train_text"] == "faster: 2.00x [2.00-2.00]"
    assert (torch["train_ratio"], torch["train_ratio_low"], torch["train_ratio_high"]) == (2.0, 2.0, 2.0)
    assert torch["infer_verdict"] == "not significant" and torch["infer_ratio"] == 1.0
    assert "too few repeats" not in compare.run_compare([str(path)], baseline="tensorflow").text


def test_the_ratio_and_the_columns_beside_it_use_one_estimator(tmp_path: Path) -> None:
    """One slow repeat in five: the time columns are medians over repeats, and the speed-up beside
    them is the ratio of those medians (a ratio of geometric means would say 2.49x beside 2.00 and
    1.00); the header and the JSON name the estimator."""
    path = tmp_path / "outlier.csv"
    w = results.CsvWriter(path)
    _exact_cells(w, "tensorflow", [2.0, 2.0, 2.0, 2.0, 6.0], [1.0, 1.0, 1.0, 1.0, 3.0])
    _exact_cells(w, "torch", [1.0, 0.9, 1.0, 1.1, 1.0], [0.5, 0.45, 0.5, 0.55, 0.5])
    out = compare.run_compare([str(path)], baseline="tensorflow", fmt="json")
    data = json.loads(out.text)
    groups = {g["label"]: g for g in data["groups"]}
    tf, torch = groups["tensorflow"], groups["torch"]
    assert torch["train_ratio"] == pytest.approx(tf["steady_s"] / torch["steady_s"]) == pytest.approx(2.0)
    assert torch["infer_ratio"] == pytest.approx(tf["infer_s"] / torch["infer_s"]) == pytest.approx(2.0)
    for prefix in ("train", "infer"):
        assert torch[f"{prefix}_ratio_low"] <= torch[f"{prefix}_ratio"] <= torch[f"{prefix}_ratio_high"]
    assert data["estimator"] == "median"
    header = compare.run_compare([str(path)], baseline="tensorflow").text.splitlines()[0]
    assert "median" in header and "geometric" not in header
    steady = _column(compare.run_compare([str(path)], baseline="tensorflow").text, "Training", "steady s", "torch")
    assert float(steady) == pytest.approx(1.0)


def test_median_interval_is_labelled_by_what_it_is(tmp_path: Path) -> None:
    """3 repeats: the min-max range, labelled 'range'; 8 repeats: an order-statistic 95% CI."""
    few, many = tmp_path / "few.csv", tmp_path / "many.csv"
    write_cells(results.CsvWriter(few), "torch", 1.0, repeats=3)
    write_cells(results.CsvWriter(many), "torch", 1.0, repeats=8)
    text_few = compare.run_compare([str(few)]).text
    assert "range of repeats" in text_few and "95% CI of median" not in text_few
    assert "95% CI of median" in compare.run_compare([str(many)]).text
    groups, _ = groups_json([few])
    assert groups["torch"]["steady_interval"] == "range"
    reps = pd.read_csv(few)
    steady = reps[(reps["phase"] == "train_epoch") & (reps["epoch"] >= 2)].groupby("repeat")["seconds"].median()
    assert groups["torch"]["steady_low"] == pytest.approx(steady.min())
    assert groups["torch"]["steady_high"] == pytest.approx(steady.max())


def test_nan_loss_backend_is_never_the_winner(tmp_path: Path) -> None:
    path = tmp_path / "nan.csv"
    w = results.CsvWriter(path)
    write_cells(w, "tensorflow", 0.3, status="nan_loss", seed=1)  # the quickest, and wrong
    write_cells(w, "numpy", 2.0, seed=2)
    write_cells(w, "torch", 1.0, seed=3)
    groups, _ = groups_json([path])
    tf = groups["tensorflow"]
    assert tf["status"] == "nan_loss" and tf["train_verdict"] == "not ranked (nan_loss)"
    assert not tf["fastest_train"] and not tf["fastest_infer"] and tf["train_ratio"] is None
    assert groups["torch"]["fastest_train"] and groups["torch"]["fastest_infer"]
    assert groups["numpy"]["baseline"] == "torch"  # the default baseline skips failed backends and numpy
    text = compare.run_compare([str(path)]).text
    tf_rows = [ln for ln in text.splitlines() if " tensorflow " in ln]
    assert tf_rows and all(not ln.startswith("*") and "nan_loss" in ln for ln in tf_rows)
    assert "tensorflow was quicker in training but is nan_loss" in text


def test_default_baseline_is_a_framework_not_the_numpy_oracle(tmp_path: Path) -> None:
    path = tmp_path / "b.csv"
    w = results.CsvWriter(path)
    write_cells(w, "numpy", 9.0, seed=1)
    write_cells(w, "tensorflow", 1.0, seed=2)
    write_cells(w, "torch", 2.0, seed=3, statuses={2: "crashed"})  # torch is not ok: not the baseline
    groups, _ = groups_json([path])
    assert {g["baseline"] for g in groups.values()} == {"tensorflow"}
    only = tmp_path / "only.csv"
    write_cells(results.CsvWriter(only), "numpy", 9.0)
    assert groups_json([only])[0]["numpy"]["train_verdict"] == "baseline"
    assert groups_json([path], baseline="numpy")[0]["tensorflow"]["baseline"] == "numpy"


def test_no_correct_backend_means_no_winner(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    w = results.CsvWriter(path)
    write_cells(w, "jax", 0.3, status="nan_loss")
    write_cells(w, "torch", 1.0, status="chance_accuracy", seed=4)
    groups, _ = groups_json([path])
    assert not any(g["fastest_train"] or g["fastest_infer"] for g in groups.values())
    assert "training none (no backend passed its checks)" in compare.run_compare([str(path)]).text


def test_failed_repeats_are_left_out_of_the_timings(tmp_path: Path) -> None:
    """A crashed repeat's partial epochs (here 10x quicker) must not pull the median; the failed
    repeats are counted apart, and the group is not ranked."""
    path = tmp_path / "crash.csv"
    w = results.CsvWriter(path)
    write_cells(w, "tensorflow", 2.0, seed=1)
    write_cells(w, "torch", 1.0, repeats=3, noise=0.0, seed=2, statuses={2: "crashed", 3: "crashed"})
    groups, out = groups_json([path])
    torch = groups["torch"]
    assert torch["steady_s"] == pytest.approx(1.0, rel=0.02) and torch["first_s"] == pytest.approx(3.0)
    assert torch["ok_repeats"] == 1 and torch["failed"] == "2 crashed" and torch["steady_n"] == 1
    assert torch["status"] == "crashed" and torch["train_verdict"] == "not ranked (crashed)"
    assert not torch["fastest_train"]
    text = compare.run_compare([str(path)]).text
    assert "1 ok + 2 crashed" in text


@pytest.mark.parametrize("status", ["pending", "interrupted"])
def test_pending_and_interrupted_never_rank(tmp_path: Path, status: str) -> None:
    path = tmp_path / "p.csv"
    w = results.CsvWriter(path)
    write_cells(w, "tensorflow", 2.0, seed=1)
    write_cells(w, "torch", 1.0, status=status, seed=2)
    groups, _ = groups_json([path])
    assert groups["torch"]["status"] == status and not groups["torch"]["fastest_train"]
    assert groups["tensorflow"]["fastest_train"] and groups["torch"]["steady_s"] is None


def test_mixed_environments_warn(tmp_path: Path) -> None:
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    write_cells(results.CsvWriter(a), "numpy", 2.0, host="bench-1", backend_version="1.0")
    wb = results.CsvWriter(b)
    write_cells(wb, "torch", 1.0, host="laptop", python="3.10.4", seed=5)
    write_cells(wb, "numpy", 2.0, host="laptop", backend_version="2.0", seed=6, run_id="run2")
    _, out = groups_json([a, b])
    host = [w for w in out.warnings if "host differs" in w]
    assert host and "bench-1" in host[0] and "laptop" in host[0] and "a.csv" in host[0]
    assert any("backend_version differs" in w and "mnist/cpu/numpy" in w for w in out.warnings)
    # Backends run from isolated environments differ in python: only a difference within one backend counts.
    assert not any("python differs" in w for w in out.warnings)
    # numpy's own repeats come from two hosts: said explicitly.
    assert any(w.startswith("mnist/cpu/numpy: its repeats ran on different hosts") for w in out.warnings)


def test_thread_counts_never_pool(tmp_path: Path) -> None:
    """Threads define the experiment, as the batch size does: `compare quiet.csv threads1.csv` once
    gave `torch ok 6` (two counts pooled into one group) with only a warning."""
    quiet, one = tmp_path / "quiet.csv", tmp_path / "threads1.csv"
    w = results.CsvWriter(quiet)
    write_cells(w, "tensorflow", 2.0, threads=2, repeats=3)
    write_cells(w, "torch", 1.0, threads=2, repeats=3, seed=3)
    w = results.CsvWriter(one)
    write_cells(w, "tensorflow", 3.0, threads=1, repeats=3, run_id="run2")
    write_cells(w, "torch", 1.5, threads=1, repeats=3, seed=4, run_id="run2")
    groups, out = groups_json([quiet, one])
    sections = {g["experiment"] for g in out.groups.reset_index().to_dict("records")}
    assert sections == {"mnist (threads 1)", "mnist (threads 2)"}
    assert sorted(int(r) for r in out.groups["repeats"]) == [3, 3, 3, 3]  # no group of 6
    assert "== mnist (threads 1) on cpu" in out.table_text and "== mnist (threads 2) on cpu" in out.table_text
    assert not any("threads differs" in w for w in out.warnings)  # no pooling left to warn about
    # N replicas of 1 thread each are a cell of 2 threads: compared with the single replica of 2.
    both = tmp_path / "replicas.csv"
    w = results.CsvWriter(both)
    write_cells(w, "torch", 1.0, threads=2, repeats=3)
    write_cells(w, "torch", 0.6, threads=1, replicas=2, repeats=3, seed=5)
    _, out = groups_json([both])
    assert set(out.groups.reset_index()["experiment"]) == {"mnist"}


def test_one_environment_does_not_warn(two_x: Path) -> None:
    assert compare.run_compare([str(two_x)]).warnings == []


def _sections(text: str) -> list[str]:
    return re.findall(r"^== (.*) ==$", text, flags=re.M)


def test_definitions_are_compared_apart_and_labelled_by_what_differs(tmp_path: Path) -> None:
    """One workload name, two --limit values: two sections, no ratio between them."""
    path, other = tmp_path / "defs.csv", tmp_path / "defs-2.csv"  # two runs, two files
    write_cells(results.CsvWriter(path), "numpy", 1.0, workload_hash="aaa", samples=1024, seed=1,
                definition="train=1024 val=256 test=256 epochs=4 batch=32 seed=0 data=synthetic")
    write_cells(results.CsvWriter(other), "tensorflow", 2.0, workload_hash="bbb", samples=2000, seed=2,
                run_id="run2", definition="train=2000 val=256 test=256 epochs=4 batch=32 seed=0 data=synthetic")
    groups, out = groups_json([path, other])
    assert _sections(compare.run_compare([str(path), str(other)]).text) == [
        "mnist (limit 1024) on cpu (baseline: numpy)", "mnist (limit 2000) on cpu (baseline: tensorflow)"]
    assert groups["numpy"]["experiment"] == "mnist (limit 1024)"
    assert all(g["train_verdict"] == "baseline" and g["train_ratio"] is None for g in groups.values())
    assert any("workload 'mnist' has 2 different definitions" in w and "no ratio between them" in w
               for w in out.warnings)


def test_definitions_without_a_definition_column_fall_back_to_the_rows(tmp_path: Path) -> None:
    path = tmp_path / "old.csv"
    w = results.CsvWriter(path)
    write_cells(w, "torch", 1.0, workload_hash="aaa", epochs=2, seed=1)
    write_cells(w, "torch", 1.0, workload_hash="bbb", epochs=3, seed=2, run_id="run2")
    write_cells(w, "torch", 1.0, workload_hash="ccc111", epochs=3, seed=2, run_id="run3")
    text = compare.run_compare([str(path)]).text
    assert _sections(text) == ["mnist (epochs 2) on cpu (baseline: torch)",
                               "mnist (epochs 3, def bbb) on cpu (baseline: torch)",
                               "mnist (epochs 3, def ccc111) on cpu (baseline: torch)"]


def test_data_source_separates_experiments(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    w = results.CsvWriter(path)
    write_cells(w, "torch", 1.0, data_source="synthetic", seed=1)
    write_cells(w, "tensorflow", 1.0, data_source="real", seed=2)
    assert _sections(compare.run_compare([str(path)]).text) == [
        "mnist (data real) on cpu (baseline: tensorflow)", "mnist (data synthetic) on cpu (baseline: torch)"]


def test_inference_table_shows_the_first_pass_apart(tmp_path: Path) -> None:
    path = tmp_path / "inf.csv"
    w = results.CsvWriter(path)
    write_cells(w, "torch", 1.0, infer=0.2, first_pass=5.0, repeats=3)
    groups, _ = groups_json([path])
    assert groups["torch"]["infer_first_s"] == pytest.approx(5.0)
    assert groups["torch"]["infer_s"] == pytest.approx(0.2, rel=0.1)
    text = compare.run_compare([str(path)]).text
    assert "1st pass s" in text and "500 samples per inference pass" in text


def test_inference_only_backends_rank_in_inference_only(tmp_path: Path) -> None:
    path = tmp_path / "io.csv"
    w = results.CsvWriter(path)
    write_cells(w, "torch", 1.0, infer=0.4, seed=1)
    write_cells(w, "onnxruntime", 1.0, infer=0.1, seed=2, inference_only=True)
    groups, _ = groups_json([path])
    assert groups["onnxruntime"]["fastest_infer"] and groups["onnxruntime"]["infer_verdict"] == "faster"
    assert groups["onnxruntime"]["train_verdict"] == "n/a"
    text = compare.run_compare([str(path)]).text
    training = text.split("\nTraining\n")[1].split("\nInference\n")[0]
    inference = text.split("\nInference\n")[1]
    assert "onnxruntime" not in training and "torch" in training
    assert "onnxruntime" in inference


def test_truncated_file_fails_with_its_name(two_x: Path, tmp_path: Path) -> None:
    bad = tmp_path / "cut.csv"
    bad.write_bytes(two_x.read_bytes()[:-40])
    with pytest.raises(ResultsError, match=r"cut\.csv.*truncated"):
        compare.run_compare([str(two_x), str(bad)])
    out = compare.run_compare([str(two_x), str(bad)], skip_bad=True)
    assert any(w.startswith("skipped ") and "cut.csv" in w for w in out.warnings)
    assert "torch" in out.text


def test_files_without_measurements_are_an_error(tmp_path: Path) -> None:
    header_only = tmp_path / "header.csv"
    header_only.write_text(",".join(results.COLUMNS) + "\n")
    with pytest.raises(ResultsError, match=r"header\.csv: no measurements to compare \(no rows at all\)"):
        compare.run_compare([str(header_only)])
    status_only = tmp_path / "status.csv"
    w = results.CsvWriter(status_only)
    w.write(dict(ENV, run_id="r", workload="mnist", backend="torch", device="cpu", repeat=1, phase="run",
                 status="crashed", message="RuntimeError: boom"))
    with pytest.raises(ResultsError, match=r"status\.csv: no measurements to compare"):
        compare.run_compare([str(status_only)])


def test_bad_input_raises(two_x: Path, tmp_path: Path) -> None:
    with pytest.raises(ResultsError, match="unknown baseline backend 'mxnet'.*tensorflow:tf.function, torch:eager"):
        compare.run_compare([str(two_x)], baseline="mxnet")
    with pytest.raises(ResultsError, match="unknown candidate backend 'mxnet'"):
        compare.run_compare([str(two_x)], candidate=("mxnet",))
    with pytest.raises(ResultsError, match="format must be one of"):
        compare.run_compare([str(two_x)], fmt="html")
    with pytest.raises(ResultsError, match="no files match"):
        compare.run_compare([str(tmp_path / "none-*.csv")])
    with pytest.raises(ResultsError, match="no such file"):
        compare.run_compare([str(tmp_path / "missing.csv")])


def test_directories_and_globs_are_read(tmp_path: Path) -> None:
    folder = tmp_path / "res"
    write_cells(results.CsvWriter(folder / "1.csv"), "numpy", 2.0)
    write_cells(results.CsvWriter(folder / "2.csv"), "torch", 1.0, seed=3)
    for paths in ([str(folder)], [str(folder / "*.csv")]):
        groups, _ = groups_json(paths)
        assert set(groups) == {"numpy", "torch"}


def test_stability_warnings(tmp_path: Path) -> None:
    path = tmp_path / "noisy.csv"
    w = results.CsvWriter(path)
    write_cells(w, "numpy", 2.0, repeats=2)
    write_cells(w, "torch", 1.0, noise=0.4, seed=9)
    out = compare.run_compare([str(path)])
    assert any("fewer than 3 timed repeats" in w and "mnist/cpu/numpy (2)" in w for w in out.warnings)
    assert any(w.startswith("unstable steady epoch time") and "mnist/cpu/torch" in w for w in out.warnings)


def test_single_epoch_has_no_steady_time(tmp_path: Path) -> None:
    path = tmp_path / "one.csv"
    w = results.CsvWriter(path)
    write_cells(w, "tensorflow", 2.0, epochs=1)
    write_cells(w, "torch", 1.0, epochs=1, seed=2)
    groups, out = groups_json([path], baseline="tensorflow")
    assert groups["torch"]["steady_s"] is None and groups["torch"]["train_verdict"] == "n/a"
    assert groups["torch"]["first_s"] > 0 and groups["torch"]["infer_verdict"] == "faster"
    assert any("only one epoch" in w for w in out.warnings)
    assert "n/a" in compare.run_compare([str(path)]).text


def test_crashed_cell_is_shown_with_its_message(two_x: Path) -> None:
    w = results.CsvWriter(two_x.with_name("crash.csv"))
    w.write(dict(ENV, run_id="run1", workload="mnist", backend="plaidml", device="cpu", repeat=1, phase="run",
                 status="crashed", message="Traceback (most recent call last):\nRuntimeError: out of memory"))
    groups, out = groups_json([two_x, w.path])
    assert groups["plaidml"]["status"] == "crashed" and groups["plaidml"]["train_verdict"] == "not ranked (crashed)"
    assert groups["plaidml"]["experiment"] == "mnist"  # a status row without a hash joins the only definition
    assert "mnist/cpu/plaidml: crashed: RuntimeError: out of memory" in out.warnings
    assert "crashed" in compare.run_compare([str(two_x), str(w.path)]).text


def test_modes_and_parity_are_shown(tmp_path: Path) -> None:
    path = tmp_path / "modes.csv"
    w = results.CsvWriter(path)
    write_cells(w, "tensorflow", 2.0, mode="eager", parity=3e-7)
    write_cells(w, "tensorflow", 1.0, mode="tf.function", parity=3e-7, seed=4)
    groups, _ = groups_json([path], baseline="tensorflow:eager")
    assert groups["tensorflow:tf.function"]["train_verdict"] == "faster"
    text = compare.run_compare([str(path)], baseline="tensorflow:eager").text
    assert "tensorflow:tf.function" in text and "3.0e-07" in text and "vs tensorflow:eager" in text


def test_formats(two_x: Path) -> None:
    md = compare.run_compare([str(two_x)], fmt="markdown").text
    assert "### mnist on cpu (baseline: torch)" in md and "| * | torch | ok |" in md
    frame = pd.read_csv(StringIO(compare.run_compare([str(two_x)], fmt="csv").text))
    assert list(frame["label"]) == ["tensorflow", "torch"]
    assert {"experiment", "steady_s", "steady_low", "steady_high", "steady_interval", "train_ratio",
            "train_verdict", "train_text", "parity_max_abs", "infer_s", "infer_first_s", "infer_spread",
            "status", "failed"} <= set(frame.columns)
    data = json.loads(compare.run_compare([str(two_x)], fmt="json").text)
    assert data["warnings"] == [] and len(data["groups"]) == 2


def test_fail_on_regression(tmp_path: Path) -> None:
    path = tmp_path / "reg.csv"
    w = results.CsvWriter(path)
    write_cells(w, "tensorflow", 1.0)
    write_cells(w, "torch", 2.0, seed=2)  # torch takes twice as long
    out = compare.run_compare([str(path)], baseline="tensorflow", candidate=("torch",), fail_on_regression=1.5)
    assert out.exit_code == compare.EXIT_REGRESSION == 3
    found = [re.match(r"regression: mnist/cpu/torch steady epoch is ([\d.]+)x slower than tensorflow "
                      r"\(limit 1.5x; slower: ", w) for w in out.warnings]
    assert any(m and 1.8 < float(m.group(1)) < 2.3 for m in found), out.warnings
    kw = {"baseline": "tensorflow", "candidate": ("torch",)}
    assert compare.run_compare([str(path)], fail_on_regression=2.5, **kw).exit_code == 0
    assert compare.run_compare([str(path)], **kw).exit_code == 0
    assert compare.run_compare([str(path)], baseline="torch", candidate=("tensorflow",),
                               fail_on_regression=1.5).exit_code == 0
    with pytest.raises(ResultsError, match="at least 1"):
        compare.run_compare([str(path)], fail_on_regression=0.5)


def test_a_slowdown_that_is_not_significant_is_not_a_regression(tmp_path: Path) -> None:
    """Two repeats each, slower on the point estimate but noisy: a warning, not exit 3."""
    path = tmp_path / "noisy.csv"
    w = results.CsvWriter(path)
    # noise 0.3: an interval of [0.07-8.4]; at 0.5 it would span over 1000x and withhold the verdict
    write_cells(w, "tensorflow", 1.0, repeats=2, noise=0.3, seed=11)
    write_cells(w, "torch", 1.6, repeats=2, noise=0.3, seed=12)
    groups, _ = groups_json([path], baseline="tensorflow")
    assert groups["torch"]["train_verdict"] == "not significant" and groups["torch"]["train_ratio"] < 1 / 1.1
    out = compare.run_compare([str(path)], baseline="tensorflow", candidate=("torch",), fail_on_regression=1.1)
    assert out.exit_code == 0
    assert any(w.startswith("possible regression, not significant: mnist/cpu/torch steady epoch")
               for w in out.warnings)


@pytest.mark.parametrize("status", ["crashed", "nan_loss", "unavailable"])
def test_a_candidate_that_is_not_ok_fails_with_its_own_code(tmp_path: Path, status: str) -> None:
    path = tmp_path / "bad.csv"
    w = results.CsvWriter(path)
    write_cells(w, "tensorflow", 2.0, seed=1)
    write_cells(w, "torch", 1.0, seed=2, statuses={1: status})  # quicker, but one repeat failed
    out = compare.run_compare([str(path)], baseline="tensorflow", candidate=("torch",), fail_on_regression=1.5)
    assert out.exit_code == compare.EXIT_CANDIDATE_FAILED == 4
    assert any(w.startswith(f"candidate failed: mnist/cpu/torch is {status}") for w in out.warnings)


def test_cli_exit_codes(two_x: Path, tmp_path: Path) -> None:
    pytest.importorskip("click")
    from click.testing import CliRunner

    from benchbackend.cli import main

    ok = CliRunner().invoke(main, ["compare", str(two_x), "--format", "markdown"])
    assert ok.exit_code == 0, ok.output
    bad = tmp_path / "cut.csv"
    bad.write_bytes(two_x.read_bytes()[:-40])
    failed = CliRunner().invoke(main, ["compare", str(bad)])
    assert failed.exit_code == 2 and "cut.csv" in failed.output
    slow = CliRunner().invoke(main, ["compare", str(two_x), "--baseline", "torch", "--candidate", "tensorflow",
                                     "--fail-on-regression", "1.5"])
    assert slow.exit_code == 3
    header_only = tmp_path / "header.csv"
    header_only.write_text(",".join(results.COLUMNS) + "\n")
    empty = CliRunner().invoke(main, ["compare", str(header_only)])
    assert empty.exit_code == 2 and len(empty.output.strip().splitlines()) == 1, empty.output
    assert "no measurements" in empty.output


def test_the_console_command_skips_teardown_but_keeps_its_output_and_exit_code(two_x: Path) -> None:
    """``entry()`` ends compare with os._exit (no interpreter teardown): stdout and stderr are
    flushed first, and the exit code is the command's."""
    from click.testing import CliRunner

    from benchbackend.cli import main

    args = ["compare", str(two_x), "--baseline", "torch", "--candidate", "tensorflow", "--fail-on-regression", "1.5"]
    same = CliRunner().invoke(main, args)
    done = subprocess.run([sys.executable, "-m", "benchbackend", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert done.returncode == same.exit_code == 3
    assert done.stdout == same.stdout and "vs torch" in done.stdout
    assert "regression: mnist/cpu/tensorflow" in done.stderr and done.stderr == same.stderr
    # no teardown: an exit handler never runs (it does after any other command)
    probe = ("import atexit, sys\nfrom benchbackend.cli import entry\n"
             "atexit.register(lambda: print('torn down'))\nsys.argv = ['benchbackend', *sys.argv[1:]]\nentry()\n")
    for cmd, torn in ((args, False), (["list", "--no-probe"], True)):
        ran = subprocess.run([sys.executable, "-c", probe, *cmd], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert ("torn down" in ran.stdout) == torn, (cmd, ran.stdout[-200:])


MIXED = [ROOT / "tests" / "data" / "numpy-limit-1024.csv", ROOT / "tests" / "data" / "numpy-limit-2000.csv"]


def test_real_runs_with_different_limits_are_two_groups() -> None:
    """The issue's case, from real runs (``benchbackend run mnist -b numpy --data synthetic --limit
    1024|2000 --epochs 2 --repeats 2``): two sections labelled by limit, no ratio across them."""
    out = compare.run_compare([str(p) for p in MIXED])
    assert _sections(out.text) == ["mnist (limit 1024) on cpu (baseline: numpy)",
                                   "mnist (limit 2000) on cpu (baseline: numpy)"]
    assert not re.search(r"(faster|slower|not significant):", out.text)
    assert any("2 different definitions" in w for w in out.warnings)
    data = json.loads(compare.run_compare([str(p) for p in MIXED], fmt="json").text)
    assert sorted(g["train_samples"] for g in data["groups"]) == [1024, 2000]


def _modules_after(code: str) -> set[str]:
    probe = ("import sys\n" + code + "\nprint(sorted(m for m in sys.modules "
             "if m.split('.')[0] in ('torch', 'tensorflow', 'keras', 'plaidml', 'jax')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.strip().splitlines()[-1].replace("'", '"')))


def test_compare_imports_no_ml_framework(two_x: Path, tmp_path: Path) -> None:
    code = (f"from benchbackend.analysis import compare\n"
            f"from benchbackend.analysis import report\n"
            f"out = compare.run_compare([{str(two_x)!r}])\n"
            f"report.write_report(out.frame, {str(tmp_path / 'p')!r}, out.table_text)\n"
            f"assert 'torch' in out.text")
    assert _modules_after(code) == set()


def test_compare_help_imports_no_ml_framework() -> None:
    code = ("from benchbackend.cli import main\n"
            "try:\n    main(['compare', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n")
    assert _modules_after(code) == set()


def test_backends_asked_for_the_same_device_are_compared(tmp_path: Path) -> None:
    """torch says cpu, TensorFlow cpu:0, PlaidML llvm_cpu.0: all were asked for --device cpu."""
    path = tmp_path / "devices.csv"
    w = results.CsvWriter(path)
    write_cells(w, "tensorflow", 2.0, seed=1, device="cpu:0", mode="tf.function", requested_device="cpu")
    write_cells(w, "plaidml", 4.0, seed=2, device="llvm_cpu.0", mode="keras2", requested_device="cpu")
    groups, _ = groups_json([path], baseline="tensorflow")
    assert set(groups) == {"tensorflow", "plaidml"}  # one mode each: no ":mode" suffix
    assert groups["plaidml"]["train_verdict"] == "slower" and 0.45 < groups["plaidml"]["train_ratio"] < 0.55


# --- MFU, batch-size sweeps, time to accuracy (issue 13) -----------------------------------------

PEAK = (0.4e12, "--peak-tflops")
PROBE = (0.43e12, "torch GEMM probe (cached 2026-11-21)")


def _section(text: str, title_part: str) -> str:
    """One section of the table text, from its ``==`` title line to the next."""
    blocks = re.split(r"^(?=== )", text, flags=re.M)
    return next(b for b in blocks if b.startswith("==") and title_part in b.splitlines()[0])


def _column(text: str, table: str, head: str, backend: str) -> str:
    """The cell under ``head`` in ``backend``'s row of the Training or Inference table."""
    lines = text.split(f"\n{table}\n")[1].splitlines()
    header = lines[0]
    start = header.index(head)
    row = next(ln for ln in lines[2:] if ln.lstrip("* ").startswith(backend + " "))
    # right-aligned numbers end where their header ends
    end = start + len(head)
    return row[:end].split()[-1]


def test_mfu_is_the_median_over_repeats_of_steady_epochs_and_passes(tmp_path: Path) -> None:
    path = tmp_path / "mfu.csv"
    write_cells(results.CsvWriter(path), "numpy", 2.0, repeats=3, flops=2e6, peak=PEAK)
    groups, out = groups_json([path])
    numpy = groups["numpy"]
    # Of the median steady epoch and pass that rank the group (3 x 2e6 FLOPs a sample, 1000 samples an
    # epoch, 500 a pass), not a median of per-repeat MFUs, which an even count of passes sets apart.
    train_mfu, infer_mfu = 3 * 2e6 * 1000 / numpy["steady_s"] / 0.4e12, 2e6 * 500 / numpy["infer_s"] / 0.4e12
    assert numpy["mfu"] == pytest.approx(train_mfu) and numpy["infer_mfu"] == pytest.approx(infer_mfu)
    # a training sample is 3x its forward FLOPs: MFU follows from samples/s and the peak
    assert numpy["mfu"] == pytest.approx(3 * 2e6 * numpy["samples_per_s"] / 0.4e12)
    assert numpy["peak"] == "0.4 TFLOP/s fp32 (--peak-tflops)" and numpy["peak_flops"] == 0.4e12
    text = compare.run_compare([str(path)]).text
    assert "MFU = achieved FLOP/s / a peak of 0.4 TFLOP/s fp32 (--peak-tflops)" in text
    assert _column(text, "Training", "MFU", "numpy") == f"{train_mfu * 100:#.3g}%"
    assert _column(text, "Inference", "MFU", "numpy") == f"{infer_mfu * 100:#.3g}%"


def test_mfu_says_when_peaks_differ_or_are_unknown(tmp_path: Path) -> None:
    path = tmp_path / "peaks.csv"
    w = results.CsvWriter(path)
    write_cells(w, "numpy", 2.0, flops=2e6, peak=PEAK, seed=1)
    write_cells(w, "torch", 1.0, flops=2e6, peak=PROBE, seed=2)
    # no probe and no --peak-tflops with its threads (with torch's, torch's probe would be its peak too)
    write_cells(w, "tensorflow", 1.5, flops=2e6, seed=3, threads=7)
    text = compare.run_compare([str(path)]).text
    line = next(ln for ln in text.splitlines() if ln.startswith("MFU"))
    assert "each backend's own peak" not in line  # one peak per device and precision, whoever probed it
    assert line.startswith("MFU = achieved FLOP/s / the peak of its device and precision (the best GEMM probe taken "
                           "there, whichever framework took it): ")
    assert "0.4 TFLOP/s fp32 (--peak-tflops) for numpy" in line  # a file before schema 12 keeps its figure
    assert "0.43 TFLOP/s fp32 (torch GEMM probe (cached 2026-11-21)) for torch" in line
    assert "MFU n/a for tensorflow: no peak known" in line
    assert _column(text, "Training", "MFU", "tensorflow") == "n/a"
    assert _column(text, "Training", "MFU", "torch").endswith("%")


def test_every_backend_on_a_device_is_measured_against_its_one_best_probe(tmp_path: Path) -> None:
    """A fresh cache: torch probed 0.194 and TensorFlow 0.223 TFLOP/s during one run, so their rows
    carry different peaks. compare divides both by the best, so their MFUs compare; a row against
    --peak-tflops keeps its figure, and another device (or thread count) has its own best."""
    path = tmp_path / "best.csv"
    w = results.CsvWriter(path)
    write_cells(w, "torch", 1.0, flops=2e6, peak=(0.194e12, "torch GEMM probe"), seed=1, threads=2)
    write_cells(w, "tensorflow", 1.5, flops=2e6, peak=(0.223e12, "tensorflow GEMM probe"), seed=2, threads=2)
    write_cells(w, "numpy", 2.0, flops=2e6, peak=PEAK, seed=3, threads=2)
    write_cells(w, "jax", 1.2, flops=2e6, peak=(0.1e12, "jax GEMM probe"), seed=4, threads=1)
    groups, _ = groups_json([path])
    torch, tf = groups["torch"], groups["tensorflow"]
    assert torch["peak_flops"] == tf["peak_flops"] == 0.223e12
    assert torch["peak"] == tf["peak"] == "0.223 TFLOP/s fp32 (tensorflow GEMM probe)"
    assert torch["mfu"] == pytest.approx(3 * 2e6 * torch["samples_per_s"] / 0.223e12, rel=1e-6)
    assert groups["numpy"]["peak_flops"] == 0.4e12 and groups["jax"]["peak_flops"] == 0.1e12


def test_files_before_mfu_have_no_mfu_column(two_x: Path) -> None:
    text = compare.run_compare([str(two_x)]).text
    assert "MFU" not in text


def test_batch_sizes_are_separate_sections_with_no_ratio_between_them(tmp_path: Path) -> None:
    """``run --batch-size 32 --batch-size 64``: one definition per batch size, labelled by it."""
    path = tmp_path / "sweep.csv"
    w = results.CsvWriter(path)
    for i, batch in enumerate((32, 64)):
        for j, (backend, t) in enumerate((("numpy", 2.0), ("torch", 1.0))):
            write_cells(w, backend, t / (1 + i), repeats=3, workload_hash=f"h{batch}", seed=10 * i + j,
                        flops=2e6, peak=PEAK,
                        definition=f"train=512 val=256 test=256 epochs=4 batch={batch} infer_batch={batch} "
                                   "seed=0 data=synthetic")
    out = compare.run_compare([str(path)])
    sections = _sections(out.text)
    assert len(sections) == 2
    assert re.match(r"mnist \(batch 32[,)]", sections[0]) and re.match(r"mnist \(batch 64[,)]", sections[1])
    # within a batch size torch is compared with numpy; across batch sizes nothing is
    for section in (_section(out.text, "batch 32"), _section(out.text, "batch 64")):
        assert len(_VS.findall(section)) == 2  # torch's training and inference cells only
        assert "MFU = achieved FLOP/s / a peak of 0.4 TFLOP/s fp32" in section


def _tta_file(tmp_path: Path) -> Path:
    """torch's epochs are 2x quicker than numpy's, but it needs more of them: on time to accuracy
    it is about 2x slower. jax never reaches the target; tensorflow reaches it in 3 of 4 repeats."""
    path = tmp_path / "tta.csv"
    w = results.CsvWriter(path)
    write_cells(w, "numpy", 2.0, repeats=4, seed=1, tta=[6.0, 6.2, 5.9, 6.1])
    write_cells(w, "torch", 1.0, repeats=4, seed=2, tta=[12.0, 12.5, 11.8, 12.2])
    write_cells(w, "jax", 0.5, repeats=3, seed=3, tta=[math.inf] * 3)
    write_cells(w, "tensorflow", 1.5, repeats=4, seed=4, tta=[3.0, math.inf, 3.1, 2.9])
    return path


def test_time_to_accuracy_ranks_on_its_own_per_repeat_values(tmp_path: Path) -> None:
    path = _tta_file(tmp_path)
    by_epoch, _ = groups_json([path], baseline="numpy")
    assert by_epoch["torch"]["train_verdict"] == "faster"  # its epochs are quicker
    groups, out = groups_json([path], baseline="numpy", metric="time-to-accuracy")
    torch = groups["torch"]
    assert torch["train_verdict"] == "slower" and 0.45 < torch["train_ratio"] < 0.55
    assert torch["train_ratio_high"] < 1
    assert torch["tta_s"] == pytest.approx(np.median([12.0, 12.5, 11.8, 12.2]))
    assert torch["infer_verdict"] == "faster"  # inference is ranked on inference time as before
    tf = groups["tensorflow"]
    assert (tf["tta_reached"], tf["tta_missed"]) == (3, 1) and tf["tta_s"] == pytest.approx(3.0)
    assert tf["train_verdict"] == "faster" and tf["fastest_train"]
    jax = groups["jax"]
    assert jax["train_verdict"] == "not ranked (target not reached)" and not jax["fastest_train"]
    assert jax["train_ratio"] is None
    assert json.loads(out.text)["metric"] == "time-to-accuracy"


def test_time_to_accuracy_table_states_the_metric_and_counts_unreached_repeats(tmp_path: Path) -> None:
    path = _tta_file(tmp_path)
    out = compare.run_compare([str(path)], baseline="numpy", metric="time-to-accuracy")
    text = out.text
    assert "Training is ranked on time to accuracy" in text.splitlines()[1]
    assert "time to acc s" in text
    tf_row = next(ln for ln in text.split("\nTraining\n")[1].splitlines() if " tensorflow " in ln)
    assert "3 reached + 1 not reached" in tf_row and tf_row.startswith("*")
    jax_row = next(ln for ln in text.split("\nTraining\n")[1].splitlines() if " jax " in ln)
    assert "0 reached + 3 not reached" in jax_row and "not ranked (target not reached)" in jax_row
    assert "fastest correct (*): time to accuracy tensorflow (3.000 s" in text
    assert any("fewer than 3 repeats reached the target accuracy" in w and "mnist/cpu/jax (0 reached)" in w
               for w in out.warnings)
    assert "Training is ranked on the steady epoch time" in compare.run_compare([str(path)]).text


def test_time_to_accuracy_default_baseline_reached_the_target(tmp_path: Path) -> None:
    path = tmp_path / "base.csv"
    w = results.CsvWriter(path)
    write_cells(w, "tensorflow", 1.0, repeats=3, seed=1, tta=[math.inf] * 3)  # first in registry order
    write_cells(w, "torch", 1.0, repeats=3, seed=2, tta=[4.0, 4.1, 3.9])
    groups, out = groups_json([path], metric="time-to-accuracy")
    assert groups["torch"]["train_verdict"] == "baseline"
    assert groups["tensorflow"]["train_verdict"] == "not ranked (target not reached)"
    _, named = groups_json([path], metric="time-to-accuracy", baseline="tensorflow")
    assert any("the baseline tensorflow never reached the target accuracy" in w for w in named.warnings)


def test_time_to_accuracy_needs_the_column_and_a_known_metric(two_x: Path) -> None:
    with pytest.raises(ResultsError, match=r"^no time_to_accuracy_s in these results: declare "
                                           r"checks.target_accuracy in the workload$"):
        compare.run_compare([str(two_x)], metric="time-to-accuracy")
    with pytest.raises(ResultsError, match="metric must be one of epoch-time, time-to-accuracy"):
        compare.run_compare([str(two_x)], metric="wall-time")


def test_a_candidate_that_never_reached_the_target_fails_regression(tmp_path: Path) -> None:
    path = _tta_file(tmp_path)
    out = compare.run_compare([str(path)], baseline="numpy", candidate=("jax",), fail_on_regression=1.5,
                              metric="time-to-accuracy")
    assert out.exit_code == compare.EXIT_CANDIDATE_FAILED
    assert any(w.startswith("candidate failed: mnist/cpu/jax never reached the target accuracy")
               for w in out.warnings)
    slow = compare.run_compare([str(path)], baseline="numpy", candidate=("torch",), fail_on_regression=1.5,
                               metric="time-to-accuracy")
    assert slow.exit_code == compare.EXIT_REGRESSION
    assert any(w.startswith("regression: mnist/cpu/torch time to accuracy is") for w in slow.warnings)


def test_cli_metric_option(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from benchbackend.cli import main

    if "--metric" not in CliRunner().invoke(main, ["compare", "--help"]).output:
        pytest.skip("cli.py's compare has no --metric option yet")
    path = _tta_file(tmp_path)
    done = CliRunner().invoke(main, ["compare", str(path), "--metric", "time-to-accuracy", "--baseline", "numpy"])
    assert done.exit_code == 0, done.output
    assert "time to acc s" in done.output
    missing = tmp_path / "none.csv"
    write_cells(results.CsvWriter(missing), "numpy", 1.0)
    failed = CliRunner().invoke(main, ["compare", str(missing), "--metric", "time-to-accuracy"])
    assert failed.exit_code == 2 and "declare checks.target_accuracy" in failed.output


def _unavailable(writer: results.CsvWriter, backend: str, run_id: str, timestamp: str) -> None:
    """The one ``run`` row a backend that is not installed gets."""
    writer.end_cell(dict(ENV, run_id=run_id, workload="mnist", workload_hash="h1", backend=backend, device="cpu",
                         repeat=1, timestamp=timestamp, message=f"not installed: pip install {backend}"), "unavailable")


def test_a_stale_unavailable_row_is_not_pooled_with_a_later_run_of_its_choice(tmp_path: Path) -> None:
    """jax was not installed, then was, and ran: its old ``unavailable`` row says nothing of it now."""
    path = tmp_path / "u.csv"
    w = results.CsvWriter(path)
    _unavailable(w, "jax", "run0", "2026-01-01T00:00:00+0000")
    write_cells(w, "tensorflow", 2.0, seed=1, run_id="run1", timestamp="2026-01-02T00:00:00+0000")
    write_cells(w, "jax", 1.0, seed=2, run_id="run1", timestamp="2026-01-02T00:00:00+0000")
    groups, out = groups_json([path], baseline="tensorflow")
    assert groups["jax"]["status"] == "ok" and groups["jax"]["failed"] == "", groups["jax"]
    assert groups["jax"]["train_verdict"] == "faster"
    assert not any("unavailable" in line for line in out.warnings)
    _unavailable(w, "jax", "run2", "2026-01-03T00:00:00+0000")  # uninstalled since: that is news
    groups, _ = groups_json([path], baseline="tensorflow")
    assert groups["jax"]["status"] == "unavailable"


def test_a_named_baseline_that_failed_says_so(tmp_path: Path) -> None:
    path = tmp_path / "b.csv"
    w = results.CsvWriter(path)
    write_cells(w, "torch", 1.0, repeats=3, seed=1, mode="eager", statuses={2: "crashed"})
    write_cells(w, "torch", 1.0, repeats=3, seed=2, mode="compile")
    write_cells(w, "tensorflow", 2.0, repeats=3, seed=3)
    groups, out = groups_json([path], baseline="torch")  # of the two torch groups, the ok one
    assert groups["tensorflow"]["baseline"] == "torch:compile"
    assert any("the baseline is torch:compile" in line for line in out.warnings)
    groups, out = groups_json([path], baseline="torch:eager")  # named: used, and said to have failed
    assert groups["tensorflow"]["baseline"] == "torch:eager"
    assert groups["torch:eager"]["train_text"] == "baseline (crashed: ratios use its 2 ok repeats)"
    assert any("the baseline torch:eager is crashed" in line for line in out.warnings)
    text = compare.run_compare([str(path)], baseline="torch:eager").text
    assert "baseline (crashed: ratios use its 2 ok repeats)" in text


def test_time_to_accuracy_judges_only_the_cells_that_train(tmp_path: Path) -> None:
    """An inference-only backend trains nothing, so it reached no target: no warning says it missed,
    and --fail-on-regression does not fail it for that."""
    other = tmp_path / "ort.csv"
    write_cells(results.CsvWriter(other), "onnxruntime", 1.0, repeats=3, seed=5, inference_only=True,
                tta=[math.inf] * 3)
    groups, out = groups_json([_tta_file(tmp_path), other], baseline="numpy", metric="time-to-accuracy",
                              fail_on_regression=100.0, candidate=("onnxruntime",))
    assert (groups["onnxruntime"]["tta_reached"], groups["onnxruntime"]["tta_missed"]) == (0, 0)
    assert not any("onnxruntime" in line for line in out.warnings), out.warnings
    assert out.exit_code == 0


def test_an_inference_only_run_records_no_time_to_accuracy(tmp_path: Path, monkeypatch) -> None:
    from click.testing import CliRunner
    from support import inprocess

    from benchbackend.cli import main
    from conftest import mnist_with_target

    path = mnist_with_target(tmp_path, "mnist_tta", 0.5)
    inprocess.use(monkeypatch)
    out = tmp_path / "i.csv"
    r = CliRunner().invoke(main, ["run", str(path), "-b", "numpy", "--inference-only",
                                  "--data", "synthetic", "--limit", "256", "--repeats", "1", "-o", str(out),
                                  "--no-plots"])
    assert r.exit_code == 0, r.output[-2000:]
    assert "time to accuracy" not in r.output
    assert results.read(out).query("phase == 'run'")["time_to_accuracy_s"].isna().all()


def test_a_deliberate_sweep_in_one_run_is_not_warned_of_as_several_definitions(tmp_path: Path) -> None:
    """``run --batch-size 32 --batch-size 128`` measures two definitions on purpose; two runs of
    one workload at two --limit values are what the warning is for."""
    path = tmp_path / "sweep.csv"
    w = results.CsvWriter(path)
    for batch in (32, 128):
        write_cells(w, "numpy", 1.0, repeats=3, workload_hash=f"h{batch}", run_id="sweep",
                    definition=f"train=512 val=256 test=256 epochs=4 batch={batch} infer_batch={batch} seed=0 "
                               "data=synthetic")
    out = compare.run_compare([str(path)])
    assert len(_sections(out.text)) == 2
    assert not any("different definitions" in line for line in out.warnings), out.warnings

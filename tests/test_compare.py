"""`compare`: ratios, significance, ranking of correct backends only, warnings, formats, exit codes.

Every CSV here is written by the real ``results.CsvWriter`` from known distributions.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from io import StringIO
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pandas as pd
import pytest

from benchbackend import compare, results
from benchbackend.errors import ResultsError

ROOT = Path(__file__).resolve().parent.parent
ENV = {"host": "bench-1", "os": "Linux-6.1", "python": "3.11.7", "cpu": "Xeon x16", "gpu": ""}


def write_cells(writer: results.CsvWriter, backend: str, steady: float, *, repeats: int = 5, seed: int = 0,
                noise: float = 0.03, epochs: int = 4, passes: int = 5, infer: Optional[float] = None,
                status: str = "ok", workload: str = "mnist", device: str = "cpu", mode: str = "",
                run_id: str = "run1", workload_hash: str = "h1", backend_version: str = "1.0",
                parity: float = 1e-7, **env: str) -> None:
    """Rows of ``repeats`` fresh-process repeats whose steady epoch time is ``steady`` * (1 + noise * N(0, 1))."""
    rng = np.random.default_rng(seed)
    infer = steady / 4 if infer is None else infer
    for rep in range(1, repeats + 1):
        base: dict[str, Any] = dict(ENV, run_id=run_id, workload=workload, workload_hash=workload_hash,
                                    backend=backend, backend_version=backend_version, device=device, mode=mode,
                                    repeat=rep, status=status)
        base.update(env)
        writer.write(dict(base, phase="build", epoch=0, seconds=0.05, params=1000))
        writer.write(dict(base, phase="parity", epoch=0, seconds=0.01, parity_max_abs=parity,
                          parity_max_rel=parity * 10))
        rep_steady = steady * (1 + noise * float(rng.standard_normal()))
        rep_infer = infer * (1 + noise * float(rng.standard_normal()))
        for epoch in range(1, epochs + 1):
            seconds = 3 * steady if epoch == 1 else rep_steady * (1 + 0.005 * float(rng.standard_normal()))
            loss = float("nan") if status == "nan_loss" and epoch > 1 else 2.0 / epoch
            writer.write(dict(base, phase="train_epoch", epoch=epoch, samples=1000, seconds=seconds,
                              samples_per_s=1000 / seconds, loss=loss, accuracy=0.9, val_loss=loss,
                              val_accuracy=0.5 + 0.1 * epoch))
        for n in range(1, passes + 1):
            writer.write(dict(base, phase="inference", epoch=n, samples=500,
                              seconds=rep_infer * (1 + 0.005 * float(rng.standard_normal()))))


def groups_json(paths: list[Path], **kw: Any) -> tuple[dict[str, dict[str, Any]], compare.CompareOutcome]:
    out = compare.run_compare([str(p) for p in paths], fmt="json", **kw)
    data = json.loads(out.text)
    return {g["label"]: g for g in data["groups"]}, out


@pytest.fixture
def two_x(tmp_path: Path) -> Path:
    """numpy takes 2 s an epoch, torch 1 s: a true 2x difference over 5 repeats."""
    path = tmp_path / "two_x.csv"
    w = results.CsvWriter(path)
    write_cells(w, "numpy", 2.0, seed=1)
    write_cells(w, "torch", 1.0, seed=2)
    return path


def test_true_2x_difference_is_significant_and_about_2x(two_x: Path) -> None:
    groups, out = groups_json([two_x])
    torch = groups["torch"]
    assert torch["baseline"] == "numpy"
    assert 1.85 < torch["train_ratio"] < 2.15
    assert torch["train_verdict"].endswith("x faster") and torch["train_p"] < 0.05
    assert 1 < torch["train_ratio_low"] < torch["train_ratio"] < torch["train_ratio_high"]
    assert torch["infer_verdict"].endswith("x faster") and 1.8 < torch["infer_ratio"] < 2.2
    assert torch["fastest_train"] and torch["fastest_infer"]
    assert groups["numpy"]["train_verdict"] == "baseline"
    assert out.exit_code == 0 and out.warnings == []
    text = compare.run_compare([str(two_x)]).text
    assert "faster [" in text and "fastest correct (*): training torch" in text


def test_baseline_sets_the_direction(two_x: Path) -> None:
    groups, _ = groups_json([two_x], baseline="torch")
    assert groups["numpy"]["train_verdict"].endswith("x slower")
    assert 1.85 < float(groups["numpy"]["train_verdict"].split("x")[0]) < 2.15
    assert "2.0" in compare.run_compare([str(two_x)], baseline="torch").text


def test_same_distribution_is_not_significant(tmp_path: Path) -> None:
    path = tmp_path / "same.csv"
    w = results.CsvWriter(path)
    write_cells(w, "numpy", 1.0, seed=100)
    write_cells(w, "torch", 1.0, seed=200)
    groups, _ = groups_json([path])
    assert groups["torch"]["train_verdict"] == "not significant"
    assert groups["torch"]["infer_verdict"] == "not significant"
    assert groups["torch"]["train_ratio_low"] < 1 < groups["torch"]["train_ratio_high"]


def test_false_positive_rate_is_about_alpha() -> None:
    """Same distribution, 5 repeats against 5: "significant" about 5% of the time (exact U: ~3%)."""
    from benchbackend import stats

    rng = np.random.default_rng(0)
    pairs = [stats.compare_times(1 + 0.03 * rng.standard_normal(5), 1 + 0.03 * rng.standard_normal(5))
             for _ in range(300)]
    rate = np.mean([r.significant for r in pairs])
    assert 0.005 < rate < 0.10
    assert np.mean([r.low < 1 < r.high for r in pairs]) > 0.9


def test_three_repeats_use_welch_on_logs_and_can_be_significant(tmp_path: Path) -> None:
    """3 against 3: a rank test can never reach 0.05, so the verdict comes from Welch's t-test."""
    path = tmp_path / "three.csv"
    w = results.CsvWriter(path)
    write_cells(w, "numpy", 2.0, repeats=3, seed=1)
    write_cells(w, "torch", 1.0, repeats=3, seed=2)
    groups, out = groups_json([path])
    assert groups["torch"]["train_verdict"].endswith("x faster")
    assert not any("fewer than 3 repeats" in w for w in out.warnings)


def test_three_repeats_same_distribution_false_positive_rate() -> None:
    from benchbackend import stats

    rng = np.random.default_rng(1)
    pairs = [stats.compare_times(1 + 0.03 * rng.standard_normal(3), 1 + 0.03 * rng.standard_normal(3))
             for _ in range(300)]
    assert np.mean([r.significant for r in pairs]) < 0.10


def test_one_repeat_is_not_significant_and_says_why() -> None:
    from benchbackend import stats

    r = stats.compare_times(np.array([2.0]), np.array([1.0]))
    assert r.verdict == "not significant (too few repeats)"


def test_nan_loss_backend_is_never_the_winner(tmp_path: Path) -> None:
    path = tmp_path / "nan.csv"
    w = results.CsvWriter(path)
    write_cells(w, "jax", 0.3, status="nan_loss", seed=1)  # the quickest, and wrong
    write_cells(w, "numpy", 2.0, seed=2)
    write_cells(w, "torch", 1.0, seed=3)
    groups, _ = groups_json([path])
    assert groups["jax"]["status"] == "nan_loss"
    assert not groups["jax"]["fastest_train"] and not groups["jax"]["fastest_infer"]
    assert groups["torch"]["fastest_train"] and groups["torch"]["fastest_infer"]
    assert groups["torch"]["baseline"] == "numpy"  # the default baseline skips failed backends
    text = compare.run_compare([str(path)]).text
    jax_rows = [ln for ln in text.splitlines() if " jax " in ln]
    assert jax_rows and all(not ln.startswith("*") and "nan_loss" in ln for ln in jax_rows)
    assert "jax was quicker in training but is nan_loss" in text


def test_no_correct_backend_means_no_winner(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    w = results.CsvWriter(path)
    write_cells(w, "jax", 0.3, status="nan_loss")
    write_cells(w, "torch", 1.0, status="chance_accuracy", seed=4)
    groups, _ = groups_json([path])
    assert not any(g["fastest_train"] or g["fastest_infer"] for g in groups.values())
    assert "training none (no backend passed its checks)" in compare.run_compare([str(path)]).text


def test_mixed_environments_warn(tmp_path: Path) -> None:
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    write_cells(results.CsvWriter(a), "numpy", 2.0, host="bench-1", backend_version="1.0")
    wb = results.CsvWriter(b)
    write_cells(wb, "torch", 1.0, host="laptop", python="3.10.4", seed=5)
    write_cells(wb, "numpy", 2.0, host="laptop", backend_version="2.0", seed=6)
    _, out = groups_json([a, b])
    host = [w for w in out.warnings if "host differs" in w]
    assert host and "bench-1" in host[0] and "laptop" in host[0] and "a.csv" in host[0]
    assert any("backend_version differs" in w and "mnist/cpu/numpy" in w for w in out.warnings)
    # Backends run from isolated environments differ in python: only a difference within one backend counts.
    assert not any("python differs" in w for w in out.warnings)


def test_one_environment_does_not_warn(two_x: Path) -> None:
    assert compare.run_compare([str(two_x)]).warnings == []


def test_different_workload_hashes_warn(tmp_path: Path) -> None:
    path = tmp_path / "hash.csv"
    w = results.CsvWriter(path)
    write_cells(w, "numpy", 2.0, workload_hash="aaa")
    write_cells(w, "torch", 1.0, workload_hash="bbb")
    out = compare.run_compare([str(path)])
    assert any("workload 'mnist' has 2 different definitions" in w and "aaa" in w and "bbb" in w
               for w in out.warnings)


def test_truncated_file_fails_with_its_name(two_x: Path, tmp_path: Path) -> None:
    bad = tmp_path / "cut.csv"
    bad.write_bytes(two_x.read_bytes()[:-40])
    with pytest.raises(ResultsError, match=r"cut\.csv.*truncated"):
        compare.run_compare([str(two_x), str(bad)])
    out = compare.run_compare([str(two_x), str(bad)], skip_bad=True)
    assert any(w.startswith("skipped ") and "cut.csv" in w for w in out.warnings)
    assert "torch" in out.text


def test_bad_input_raises(two_x: Path, tmp_path: Path) -> None:
    with pytest.raises(ResultsError, match="unknown baseline backend 'mxnet'.*numpy, torch"):
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
    assert any("fewer than 3 repeats" in w and "mnist/cpu/numpy (2)" in w for w in out.warnings)
    assert any(w.startswith("unstable steady epoch time") and "mnist/cpu/torch" in w for w in out.warnings)


def test_single_epoch_has_no_steady_time(tmp_path: Path) -> None:
    path = tmp_path / "one.csv"
    w = results.CsvWriter(path)
    write_cells(w, "numpy", 2.0, epochs=1)
    write_cells(w, "torch", 1.0, epochs=1, seed=2)
    groups, out = groups_json([path])
    assert groups["torch"]["steady_s"] is None and groups["torch"]["train_verdict"] == "n/a"
    assert groups["torch"]["first_s"] > 0 and groups["torch"]["infer_verdict"].endswith("faster")
    assert any("only one epoch" in w for w in out.warnings)
    assert "n/a" in compare.run_compare([str(path)]).text


def test_crashed_cell_is_shown_with_its_message(two_x: Path) -> None:
    w = results.CsvWriter(two_x.with_name("crash.csv"))
    w.write(dict(ENV, run_id="run1", workload="mnist", backend="plaidml", device="cpu", repeat=1, phase="run",
                 status="crashed", message="Traceback (most recent call last):\nRuntimeError: out of memory"))
    groups, out = groups_json([two_x, w.path])
    assert groups["plaidml"]["status"] == "crashed" and groups["plaidml"]["train_verdict"] == "n/a"
    assert "mnist/cpu/plaidml: crashed: RuntimeError: out of memory" in out.warnings
    assert "crashed" in compare.run_compare([str(two_x), str(w.path)]).text


def test_modes_and_parity_are_shown(tmp_path: Path) -> None:
    path = tmp_path / "modes.csv"
    w = results.CsvWriter(path)
    write_cells(w, "tensorflow", 2.0, mode="eager", parity=3e-7)
    write_cells(w, "tensorflow", 1.0, mode="tf.function", parity=3e-7, seed=4)
    groups, _ = groups_json([path], baseline="tensorflow:eager")
    assert groups["tensorflow:tf.function"]["train_verdict"].endswith("x faster")
    text = compare.run_compare([str(path)], baseline="tensorflow:eager").text
    assert "tensorflow:tf.function" in text and "3.0e-07" in text and "vs tensorflow:eager" in text


def test_formats(two_x: Path) -> None:
    md = compare.run_compare([str(two_x)], fmt="markdown").text
    assert "### mnist on cpu (baseline: numpy)" in md and "| * | torch | ok |" in md
    frame = pd.read_csv(StringIO(compare.run_compare([str(two_x)], fmt="csv").text))
    assert list(frame["label"]) == ["numpy", "torch"]
    assert {"steady_s", "steady_low", "steady_high", "train_ratio", "train_verdict", "parity_max_abs",
            "infer_s", "infer_spread", "status"} <= set(frame.columns)
    data = json.loads(compare.run_compare([str(two_x)], fmt="json").text)
    assert data["warnings"] == [] and len(data["groups"]) == 2


def test_fail_on_regression(tmp_path: Path) -> None:
    path = tmp_path / "reg.csv"
    w = results.CsvWriter(path)
    write_cells(w, "numpy", 1.0)
    write_cells(w, "torch", 2.0, seed=2)  # torch takes twice as long
    out = compare.run_compare([str(path)], candidate=("torch",), fail_on_regression=1.5)
    assert out.exit_code == 3
    found = [re.match(r"regression: mnist/cpu/torch steady epoch is ([\d.]+)x slower than numpy \(limit 1.5x\)$", w)
             for w in out.warnings]
    assert any(m and 1.8 < float(m.group(1)) < 2.3 for m in found), out.warnings
    assert compare.run_compare([str(path)], candidate=("torch",), fail_on_regression=2.5).exit_code == 0
    assert compare.run_compare([str(path)], candidate=("torch",)).exit_code == 0
    assert compare.run_compare([str(path)], baseline="torch", candidate=("numpy",),
                               fail_on_regression=1.5).exit_code == 0
    with pytest.raises(ResultsError, match="at least 1"):
        compare.run_compare([str(path)], fail_on_regression=0.5)


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
    slow = CliRunner().invoke(main, ["compare", str(two_x), "--baseline", "torch", "--candidate", "numpy",
                                     "--fail-on-regression", "1.5"])
    assert slow.exit_code == 3


def _modules_after(code: str) -> set[str]:
    probe = ("import sys\n" + code + "\nprint(sorted(m for m in sys.modules "
             "if m.split('.')[0] in ('torch', 'tensorflow', 'keras', 'plaidml', 'jax')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.strip().splitlines()[-1].replace("'", '"')))


def test_compare_imports_no_ml_framework(two_x: Path, tmp_path: Path) -> None:
    code = (f"from benchbackend import compare\n"
            f"from benchbackend import plots\n"
            f"out = compare.run_compare([{str(two_x)!r}])\n"
            f"plots.write_report(out.frame, {str(tmp_path / 'p')!r}, out.table_text)\n"
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
    assert groups["plaidml"]["train_verdict"].startswith("2.0") and "slower" in groups["plaidml"]["train_verdict"]

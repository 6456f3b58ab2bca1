"""Generation (``--generate``) in compare, the report and the run's output: TTFT, TPOT p50/p99 and decode
tokens/s per prompt length, with verdicts by compare's rule; the TPOT-against-depth figure.

The CSVs are written by the real ``results.CsvWriter`` in the shape ``run/generation.py`` writes
(prefill, decode and greedy rows), from known timings; one slow test runs the numpy backend itself.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from benchbackend import results
from benchbackend.analysis import compare, experiments, report
from benchbackend.analysis.tables_generation import VERDICTS
from benchbackend.run import progress

ENV = {"host": "bench-1", "os": "Linux-6.1", "python": "3.11.7", "cpu": "Xeon x16", "gpu": ""}


def write_generation(writer: results.CsvWriter, backend: str, tpot: float, *, ttft: Optional[float] = None,
                     repeats: int = 3, passes: int = 3, prompts: tuple[int, ...] = (64,), new: int = 8,
                     batch: int = 1, mode: str = "", status: str = "ok", run_id: str = "", seed: int = 0,
                     noise: float = 0.05, scan: bool = False, busy: Optional[float] = None) -> None:
    """Rows of ``repeats`` repeats of a generation cell: per prompt length, ``passes`` passes of a
    prefill (``ttft``, the first pass 3x) and ``new`` - 1 decode steps of about ``tpot`` seconds
    (slower with depth), or one row of every step (``scan``); a greedy row and the run row."""
    rng = np.random.default_rng(seed)
    ttft = 4 * tpot if ttft is None else ttft
    for rep in range(1, repeats + 1):
        base: dict[str, Any] = dict(ENV, run_id=run_id or f"run-{backend}", workload="gpt-nano", workload_hash="g1",
                                    backend=backend, backend_version="1.0", device="cpu", mode=mode, repeat=rep,
                                    status=status, inference_only=True, cell_order=rep - 1, samples=batch,
                                    new_tokens=new, foreign_cpu_share=busy)
        writer.write(dict(base, phase="build", seconds=0.05, params=1000))
        for p in prompts:
            for i in range(1, passes + 1):
                warm = 3.0 if i == 1 else 1.0
                t = ttft * warm * (1 + noise * float(rng.standard_normal()))
                writer.write(dict(base, phase="prefill", prompt_tokens=p, **{"pass": i}, seconds=t,
                                  tokens_per_s=batch * p / t, cache_bytes=1024, cache_bytes_expected=1024))
                steps = [tpot * warm * (1 + 0.01 * k) * (1 + noise * float(rng.standard_normal()))
                         for k in range(1, new)]
                if scan:
                    writer.write(dict(base, phase="decode", prompt_tokens=p, **{"pass": i}, step=1, steps=new - 1,
                                      cache_depth=p, seconds=sum(steps)))
                    continue
                for k, s in enumerate(steps, start=1):
                    writer.write(dict(base, phase="decode", prompt_tokens=p, **{"pass": i}, step=k, steps=1,
                                      cache_depth=p + k - 1, seconds=s, tokens_per_s=batch / s))
            writer.write(dict(base, phase="greedy", prompt_tokens=p, tokens_matched=batch * new))
        writer.write(dict(base, phase="run"))


def _csv(tmp_path: Path, *cells: tuple[str, float, dict[str, Any]]) -> Path:
    path = tmp_path / "gen.csv"
    writer = results.CsvWriter(path)
    for seed, (backend, tpot, kw) in enumerate(cells):
        write_generation(writer, backend, tpot, seed=seed, **kw)
    return path


def _gen(path: Path, **kw: Any) -> pd.DataFrame:
    out = compare.run_compare([str(path)], **kw)
    assert out.generation is not None
    return out.generation.reset_index().set_index(["label", "prompt_tokens"])


def test_the_metrics_are_the_medians_over_repeats_of_each_repeats_passes_after_the_first(tmp_path: Path) -> None:
    path = _csv(tmp_path, ("numpy", 0.002, {"batch": 2, "prompts": (16, 64)}))
    gen = _gen(path)
    rows = results.read(path)
    for p in (16, 64):
        mine = rows[rows["prompt_tokens"] == p]
        pre = mine[(mine["phase"] == "prefill")]
        dec = mine[(mine["phase"] == "decode") & (mine["pass"] >= 2)]
        ttft = [pre[(pre["repeat"] == r) & (pre["pass"] >= 2)]["seconds"].median() for r in (1, 2, 3)]
        first = [pre[(pre["repeat"] == r) & (pre["pass"] == 1)]["seconds"].median() for r in (1, 2, 3)]
        steps = [dec[dec["repeat"] == r]["seconds"].to_numpy() for r in (1, 2, 3)]
        row = gen.loc[("numpy", p)]
        assert row["ttft_s"] == pytest.approx(np.median(ttft))
        assert row["first_ttft_s"] == pytest.approx(np.median(first))
        # LoadGen's percentile rule (stats.latency_percentile): the sorted latencies' value at floor(n q).
        assert row["tpot_p50_s"] == pytest.approx(np.median([np.sort(s)[len(s) // 2] for s in steps]))
        assert row["tpot_p99_s"] == pytest.approx(np.median([np.sort(s)[int(len(s) * 0.99)] for s in steps]))
        assert row["tpot_mean_s"] == pytest.approx(np.median([s.mean() for s in steps]))
        assert row["decode_tps"] == pytest.approx(np.median([2 / s.mean() for s in steps]))
        assert row["prefill_tps"] == pytest.approx(np.median([2 * p / t for t in ttft]))
        assert row["n"] == 3 and row["batch"] == 2


def test_a_single_dispatch_counts_as_its_steps(tmp_path: Path) -> None:
    """jax:scan writes one decode row of G - 1 steps: each step's TPOT is seconds / steps (one pass
    after the first: every step of a repeat has one TPOT, its p50 and p99 too)."""
    path = _csv(tmp_path, ("jax", 0.001, {"scan": True, "mode": "scan", "new": 9, "passes": 2}))
    row = _gen(path).loc[("jax", 64)]
    rows = results.read(path)
    dec = rows[(rows["phase"] == "decode") & (rows["pass"] >= 2)]
    assert (dec["steps"] == 8).all()
    expected = np.median([dec[dec["repeat"] == r]["seconds"].sum() / 8 for r in (1, 2, 3)])
    assert row["tpot_mean_s"] == pytest.approx(expected)
    assert row["tpot_p50_s"] == pytest.approx(expected) and row["tpot_p99_s"] == pytest.approx(expected)


def test_a_verdict_with_three_repeats_a_side_and_the_fastest_by_decode_tokens(tmp_path: Path) -> None:
    path = _csv(tmp_path, ("numpy", 0.002, {}), ("torch", 0.001, {"ttft": 0.02}))
    out = compare.run_compare([str(path)], baseline="numpy")
    gen = out.generation.reset_index().set_index("label")
    torch = gen.loc["torch"]
    assert torch["decode_verdict"] == "faster" and 1.8 < torch["decode_ratio"] < 2.2
    assert torch["tpot_p50_verdict"] == "faster" and torch["tpot_p99_verdict"] == "faster"
    assert torch["ttft_verdict"] == "slower"  # its prefill is slower: each metric has its own verdict
    assert torch["fastest"] and not gen.loc["numpy", "fastest"]
    assert gen.loc["numpy", "decode_verdict"] == "baseline"
    assert "Generation (batch 1, 8 new tokens, prompt of 64 tokens)" in out.text
    assert "decode tokens/s vs numpy" in out.text and "Training\n" not in out.text
    assert out.verdict.startswith("gpt-nano on cpu: fastest correct (*): decode at prompt 64 torch (")
    assert "vs numpy: faster: " in out.verdict
    data = json.loads(compare.run_compare([str(path)], baseline="numpy", fmt="json").text)
    assert {g["label"] for g in data["generation"]} == {"numpy", "torch"}


def test_fewer_repeats_withhold_the_verdict(tmp_path: Path) -> None:
    path = _csv(tmp_path, ("numpy", 0.002, {"repeats": 1}), ("torch", 0.001, {"repeats": 1}))
    torch = _gen(path, baseline="numpy").loc[("torch", 64)]
    for prefix, _, _ in VERDICTS:
        assert torch[f"{prefix}_verdict"] == "too few repeats"
    assert compare.WITHHELD[1] == "too few repeats"


def test_a_busy_machine_withholds_the_verdict(tmp_path: Path) -> None:
    path = _csv(tmp_path, ("numpy", 0.2, {}), ("torch", 0.1, {"busy": 0.5}))
    out = compare.run_compare([str(path)], baseline="numpy")
    torch = out.generation.reset_index().set_index("label").loc["torch"]
    # Said in a few words in each of the row's four verdict columns; the warning says how much.
    assert torch["decode_verdict"] == compare.BUSY and torch["decode_text"] == "no verdict (machine busy)"
    assert not torch["fastest"]
    assert any(w.startswith("machine busy") and "timed generation of gpt-nano/cpu/torch (3 of 3" in w
               for w in out.warnings)


def test_a_generation_mismatch_is_not_ranked_even_when_quickest(tmp_path: Path) -> None:
    path = _csv(tmp_path, ("numpy", 0.002, {}), ("torch", 0.001, {}),
                ("onnxruntime", 0.0001, {"status": "generation_mismatch"}))
    writer = results.CsvWriter(path)
    writer.adopt(len(results.read(path)))  # appended under the file's header
    writer.write(dict(ENV, run_id="run-tvm", workload="gpt-nano", workload_hash="g1", backend="tvm", device="cpu",
                      repeat=1, status="unavailable", phase="run", message="tvm: no key/value cache", cell_order=9))
    out = compare.run_compare([str(path)], baseline="numpy")
    gen = out.generation.reset_index().set_index("label")
    onnx = gen.loc["onnxruntime"]
    assert onnx["decode_verdict"] == "not ranked (generation_mismatch)" and not onnx["fastest"]
    assert math.isnan(onnx["decode_ratio"]) and onnx["decode_tps"] > gen.loc["torch", "decode_tps"]
    assert gen.loc["torch", "fastest"]
    assert "onnxruntime decoded quicker at prompt 64 but is generation_mismatch, so it is not ranked" in out.verdict
    tvm = gen.loc["tvm"]  # a backend that cannot generate: a row of its own, not ranked
    assert tvm["decode_verdict"] == "not ranked (unavailable)" and math.isnan(tvm["prompt_tokens"])


def test_the_report_has_the_tpot_against_depth_figure(tmp_path: Path) -> None:
    path = _csv(tmp_path, ("numpy", 0.002, {"prompts": (16, 64)}), ("jax", 0.001, {"scan": True, "mode": "scan"}),
                ("torch", 0.001, {"status": "generation_mismatch"}))
    df = experiments.for_comparison(results.read(path))
    written = report.write_report(df, tmp_path / "report")
    figure = tmp_path / "report" / "gpt-nano-cpu-tpot-depth.png"
    assert figure in written and figure.stat().st_size > 10_000
    page = (tmp_path / "report" / "index.html").read_text()
    assert 'src="gpt-nano-cpu-tpot-depth.png"' in page and "Time per output token against cache depth" in page
    assert "decode tokens/s vs" in page and "<h2>Verdicts</h2>" not in page  # generation's are in its table


def test_one_progress_line_per_pass() -> None:
    w = type("W", (), {"generating": type("G", (), {"passes": 2})()})()
    cell: list[float] = []
    lines = []
    for i in (1, 2):
        rows = [{"phase": "prefill", "pass": i, "prompt_tokens": 64, "new_tokens": 4, "samples": 2, "seconds": 0.01}]
        rows += [{"phase": "decode", "pass": i, "prompt_tokens": 64, "new_tokens": 4, "samples": 2, "step": k,
                  "steps": 1, "seconds": 0.002 * k} for k in (1, 2, 3)]
        lines += [line for row in rows if (line := progress.row_line(row, w, cell))]
    assert lines == ["generation pass 1/2 (warm-up), prompt 64: TTFT 10.00 ms, TPOT mean 4.000 ms over 3 steps, "
                     "500 tokens/s",
                     "generation pass 2/2, prompt 64: TTFT 10.00 ms, TPOT mean 4.000 ms over 3 steps, 500 tokens/s"]
    scan = [{"phase": "prefill", "pass": 1, "prompt_tokens": 8, "new_tokens": 4, "samples": 1, "seconds": 0.01},
            {"phase": "decode", "pass": 1, "prompt_tokens": 8, "new_tokens": 4, "samples": 1, "step": 1, "steps": 3,
             "seconds": 0.003}]
    assert [progress.row_line(row, w, cell) for row in scan][1].endswith("TPOT mean 1.000 ms over 3 steps, "
                                                                         "1,000 tokens/s")


@pytest.mark.slow
def test_a_numpy_generation_run_ends_with_its_figures(tmp_path: Path) -> None:
    """The real run: the summary line shows TTFT and TPOT instead of epoch/inference n/a, and compare
    reads its file."""
    from benchbackend.cli import main

    out = tmp_path / "r.csv"
    res = CliRunner().invoke(main, ["run", "gpt-nano", "-b", "numpy", "--generate", "--data", "synthetic",
                                    "--repeats", "1", "--limit", "64", "--prompt-tokens", "16", "--new-tokens", "4",
                                    "--no-plots", "-o", str(out)])
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.output.splitlines() if "numpy:reference/fp32" in ln and " r1 " in ln)
    assert "p16: TTFT " in line and "TPOT p50 " in line and " tok/s" in line and "epoch n/a" not in line
    gen = _gen(out).loc[("numpy", 16)]
    assert gen["ttft_s"] > 0 and gen["decode_tps"] > 0 and gen["status"] == "ok"


def test_fail_on_regression_reads_decode_tokens_and_ttft(tmp_path: Path) -> None:
    path = _csv(tmp_path, ("numpy", 0.002, {}), ("torch", 0.001, {"ttft": 0.008}))
    slow = compare.run_compare([str(path)], baseline="torch", candidate=("numpy",), fail_on_regression=1.5)
    assert slow.exit_code == compare.EXIT_REGRESSION
    assert any(w.startswith("regression: gpt-nano/cpu/numpy decode tokens/s at prompt 64 is ") for w in slow.warnings)
    assert not any("time to first token" in w for w in slow.warnings)  # the same TTFT: within the limit
    fine = compare.run_compare([str(path)], baseline="numpy", candidate=("torch",), fail_on_regression=1.5)
    assert fine.exit_code == 0 and not any("regression" in w for w in fine.warnings)

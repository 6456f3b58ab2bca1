"""The quality gate (issue 43, item 1): a cell's result counts only when its accuracy holds against
its baseline (``quality:`` in the workload; ``analysis/quality.py``). A planted precision loss that
passes the 10-step trajectory fails the gate, is shown as "fails quality" beside its speed and is
never starred; the same backend without the plant passes; the gate's other outcomes each have a
case that reaches them."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from support import inprocess

from benchbackend import results
from benchbackend.analysis import compare, experiments, quality, summary
from benchbackend.backends import registry as backends
from benchbackend.spec import workload

LOSSY = backends.BackendSpec(
    "lossy", "support.precision_loss:RoundingBackend", ("numpy",), "numpy", "(test only)",
    "the NumPy reference whose bf16 weights keep 4 mantissa bits",
    modes=(backends.Mode("rounding", "bf16 weights rounded to 4 mantissa bits after every update"),
           backends.Mode("honest", "the reference unchanged at every precision")),
    precisions=("fp32", "bf16"))


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """One run: the plant at fp32 (its baseline) and bf16, and the honest mode at bf16."""
    out = tmp_path_factory.mktemp("gate") / "gate.csv"
    r = inprocess.run_with(LOSSY, ["mnist", "--mode", "lossy:rounding", "--mode", "lossy:honest",
                                  "--precision", "fp32", "--precision", "bf16", "--data", "synthetic",
                                  "--limit", "1024", "--epochs", "2", "--repeats", "1", "--parity-steps", "10",
                                  "-o", str(out), "--no-plots"])
    return r, out


@pytest.mark.slow
def test_a_planted_precision_loss_passes_its_trajectory_but_fails_the_gate(planted) -> None:
    r, out = planted
    df = results.read(out)
    run = df[df.phase == "run"].set_index(["mode", "precision"])
    assert set(run["status"]) == {"ok"}, run[["status", "message"]]  # every numerical check passed
    trajectory = df[(df.phase == "parity") & df["steps"].notna() & (df["mode"] == "rounding")
                    & (df["precision"] == "bf16")]
    assert len(trajectory) == 1 and trajectory["status"].iloc[0] == "ok"
    assert run.loc[("rounding", "bf16"), "gate"] == "fail", run[["gate", "gate_reason"]]
    assert run.loc[("rounding", "bf16"), "quality_ratio"] < 0.5
    # Without the plant (honest mode, same weights and batches) the gate passes: it reads the plant.
    assert run.loc[("honest", "bf16"), "gate"] == "pass" and run.loc[("honest", "bf16"), "quality_ratio"] == 1.0
    assert run.loc[("rounding", "fp32"), "gate"] == "pass"
    # Every row of a cell carries its gate, as its status.
    cell = df[(df["mode"] == "rounding") & (df["precision"] == "bf16")]
    assert set(cell["gate"]) == {"fail"}
    # The run's own tables say so, and never rank it.
    ratio = run.loc[("rounding", "bf16"), "quality_ratio"]
    assert f"fails quality ({ratio:.3f} of fp32)" in r.output, r.output[-3000:]
    assert "lossy:rounding@bf16 0/1 pass" in r.output


@pytest.mark.slow
def test_compare_leaves_a_gate_failed_group_out_of_the_fastest_and_fails_it_as_a_candidate(planted) -> None:
    _, out = planted
    outcome = compare.run_compare([str(out)], baseline="lossy:rounding")
    groups = outcome.groups.reset_index().set_index(["mode", "precision"])
    failed = groups.loc[("rounding", "bf16")]
    assert failed["gate"] == "fail" and failed["train_verdict"] == compare.FAILS_QUALITY
    assert not failed["fastest_train"] and not failed["fastest_infer"]
    assert "fails quality (" in failed["train_text"]
    gated = compare.run_compare([str(out)], baseline="lossy:rounding", candidate=("lossy:rounding",),
                                fail_on_regression=1.0)
    assert gated.exit_code == compare.EXIT_CANDIDATE_FAILED
    assert any("fails the quality gate" in w for w in gated.warnings)


# --- the rule itself, on rows made up for each case ------------------------------------------------
def _rows(cells: list[tuple[str, str, int, float]], target: str = "0.99 of fp32", n: int = 5000,
          run_ids: tuple[str, ...] = ("r1",)) -> pd.DataFrame:
    """Results rows of ok training cells (backend, precision, repeat, final val accuracy), as read."""
    rows = []
    for run_id in run_ids:
        for order, (backend, precision, repeat, acc) in enumerate(cells):
            base = {"run_id": run_id, "cell_order": order, "attempt": 1, "workload": "w", "workload_hash": "h",
                    "backend": backend, "mode": "eager", "precision": precision, "device": "cpu", "repeat": repeat,
                    "quality_metric": "val_accuracy", "quality_target": target, "quality_samples": n,
                    "status": "ok", "data_source": "synthetic", "threads": 2}
            rows += [{**base, "phase": "train_epoch", "epoch": e, "seconds": 1.0, "samples": 100,
                      "val_accuracy": acc} for e in (1, 2)]
            rows.append({**base, "phase": "run"})
    frame = pd.DataFrame(rows)
    for c in results.COLUMNS:
        if c not in frame:
            frame[c] = math.nan if c in results.NUMERIC else ""
    frame[[c for c in results.COLUMNS if c not in results.NUMERIC]] = frame[
        [c for c in results.COLUMNS if c not in results.NUMERIC]].fillna("").astype(str)
    return experiments.for_comparison(frame)


def _gates(df: pd.DataFrame) -> dict[tuple[str, str, int], tuple[str, str]]:
    reps = summary.per_repeat(df)
    return {(k[2], k[4], int(k[-1])): (g, why) for k, g, why in zip(reps.index, reps["gate"], reps["gate_reason"])}


def test_each_repeat_is_judged_against_its_baselines_cell_from_the_same_initial_weights() -> None:
    # Each repeat starts from its own initial weights: each bf16 repeat is held to its own fp32 cell.
    g = _gates(_rows([("t", "fp32", 1, 0.79), ("t", "fp32", 2, 0.80), ("t", "bf16", 1, 0.79),
                      ("t", "bf16", 2, 0.70)]))
    assert g[("t", "bf16", 1)] == ("pass", "1.000 of fp32 (t:eager fp32: 0.7900)") and g[("t", "fp32", 2)][0] == "pass"
    assert g[("t", "bf16", 2)][0] == "fail" and g[("t", "bf16", 2)][1].startswith("0.875 of fp32")


def test_a_baseline_whose_accuracy_the_seed_decides_is_not_judged_against() -> None:
    # resnet20 at 32 steps read 0.84 and 0.54 at fp32 over two seeds, and bf16 0.63 of one of them.
    cells = [("t", "fp32", 1, 0.84), ("t", "fp32", 2, 0.54), ("t", "bf16", 1, 0.87), ("t", "bf16", 2, 0.34)]
    gate, why = _gates(_rows(cells, n=256))[("t", "bf16", 2)]
    assert gate == "baseline_varies" and "2 seeds range 0.5400-0.8400" in why and "train longer" in why
    # Seeds that differ by less than the validation set's noise are no reason: 0.77 and 0.82 on 256.
    cells = [("t", "fp32", 1, 0.77), ("t", "fp32", 2, 0.82), ("t", "bf16", 1, 0.77), ("t", "bf16", 2, 0.82)]
    assert {g for g, _ in _gates(_rows(cells, n=256)).values()} == {"pass"}


def test_a_shortfall_within_the_noise_of_the_validation_set_is_not_judged() -> None:
    cells = [("t", "fp32", 1, 0.80), ("t", "bf16", 1, 0.76)]  # 0.95 of fp32
    assert _gates(_rows(cells, n=5000))[("t", "bf16", 1)][0] == "fail"  # ±1.3 points: 4 is a loss
    gate, why = _gates(_rows(cells, n=256))[("t", "bf16", 1)]  # ±5.8 points: 4 could be chance
    assert gate == "not_judged" and "less than the noise of 256 validation samples" in why


def test_a_baseline_that_does_not_repeat_itself_is_flagged_not_used() -> None:
    # The same repeat (same initial weights) in two runs: fp32 read 0.80 once and 0.70 once.
    df = _rows([("t", "fp32", 1, 0.80), ("t", "bf16", 1, 0.78)], run_ids=("a", "b"))
    df.loc[(df.run_id == "b") & (df.precision == "fp32"), "val_accuracy"] = 0.70
    gate, why = _gates(df)[("t", "bf16", 1)]
    assert gate == "baseline_varies" and "more than the gate's 1.0% margin" in why


def test_absolute_and_reference_targets_and_what_cannot_be_judged() -> None:
    g = _gates(_rows([("t", "fp32", 1, 0.52), ("t", "bf16", 1, 0.40)], target="0.5"))
    assert g[("t", "fp32", 1)][0] == "pass" and g[("t", "bf16", 1)][0] == "fail"
    g = _gates(_rows([("numpy", "fp32", 1, 0.80), ("t", "bf16", 1, 0.80)], target="0.99 of reference"))
    assert g[("t", "bf16", 1)][0] == "pass"
    g = _gates(_rows([("t", "bf16", 1, 0.80)], target="0.99 of reference"))
    assert g[("t", "bf16", 1)] == ("not_judged", "the reference (numpy at fp32) did not run in these results "
                                                 "(add -b numpy)")
    g = _gates(_rows([("t", "bf16", 1, 0.80)]))
    assert g[("t", "bf16", 1)][0] == "not_judged" and "no fp32 cell of t" in g[("t", "bf16", 1)][1]
    assert set(_gates(_rows([("t", "bf16", 1, 0.80)], target="")).values()) == {("", "")}  # an older file


def test_the_workload_declares_its_gate_and_the_gate_does_not_change_the_hash() -> None:
    w = workload.load("mnist")
    assert w.quality.text() == "0.99 of fp32"
    raw = w.model_dump(mode="json") | {"quality": {"target": 0.5, "of": "absolute"}}
    other = workload.Workload.model_validate(raw)
    assert other.quality.text() == "0.5" and other.hash() == w.hash()
    with pytest.raises(Exception, match="of"):
        workload.Workload.model_validate(w.model_dump(mode="json") | {"quality": {"of": "fp64"}})
    assert np.isclose(quality.parse_target("0.97 of reference")[0], 0.97)

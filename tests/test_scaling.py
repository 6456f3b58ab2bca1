"""Scaling (issue 22): ``compare`` and the plots report throughput against replicas and the scaling
efficiency throughput_N / (N x throughput_1) with its interval; strong and weak scaling are never
one group; ``--scaling weak`` trains N times the workload's batch and is checked at that batch."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from benchbackend import results
from benchbackend.analysis import compare, experiments, report
from benchbackend.cli import main
from benchbackend.spec import replicas, workload
from conftest import requires_torch, run_cell

#: (replicas, scaling, steady epoch seconds of repeats 1..3)
CELLS = [(1, "strong", (10.0, 10.3, 10.1)), (2, "strong", (6.0, 6.4, 6.1)), (2, "weak", (5.5, 5.6, 5.9)),
         (4, "strong", (4.0, 3.9, 4.2))]


def _csv(tmp_path: Path, cells=CELLS, failed: tuple = ()) -> Path:
    """Rows as a run writes them: per cell two epochs (the second steady) and its run row."""
    path = tmp_path / "r.csv"
    writer = results.CsvWriter(path)
    order = 0
    for n, kind, times in cells:
        for rep, t in enumerate(times, start=1):
            order += 1
            status = "nan_loss" if (n, kind) in failed else "ok"
            common = dict(run_id="r1", cell_order=order, attempt=1, workload="cifar10", workload_hash="h",
                          backend="torch", mode="eager", precision="fp32", device="cpu", requested_device="cpu",
                          repeat=rep, replicas=n, scaling=kind, scale_lr="none", data_source="synthetic", limit=1024,
                          epochs=2, batch_size=32, params=250_000)
            for epoch, seconds in ((1, t + 2), (2, t)):
                writer.write({**common, "phase": "train_epoch", "epoch": epoch, "samples": 1024, "seconds": seconds,
                              "samples_per_s": 1024 / seconds, "loss": 1.0, "accuracy": 0.5, "val_accuracy": 0.5,
                              "comm_s": t / 10 if n > 1 else None})
            writer.end_cell({**common, "phase": "run"}, status)
    writer.close()
    return path


def test_efficiency_is_the_speed_up_over_one_replica_divided_by_n(tmp_path):
    out = compare.run_compare([str(_csv(tmp_path))])
    g = out.groups.reset_index().set_index("mode")
    one = np.median(CELLS[0][2])
    for mode, (n, kind, times) in zip(["eager x2", "eager x2 weak", "eager x4"], CELLS[1:]):
        row = g.loc[mode]
        assert (row["replicas"], row["scaling"], row["scaling_of"]) == (n, kind, "torch:eager")
        assert row["scaling_eff"] == pytest.approx(one / np.median(times) / n)
        assert row["scaling_low"] < row["scaling_eff"] < row["scaling_high"]
        # The speed-up against one replica is N times the efficiency, interval included.
        assert row["train_ratio"] == pytest.approx(n * row["scaling_eff"])
        assert row["comm_share"] == pytest.approx(np.median(times) / 10 / np.median(times))
        assert row["ring_mb"] == pytest.approx(2 * (n - 1) / n * 250_000 * 4 / 1e6)  # decimal MB, the README table's
    assert np.isnan(g.loc["eager", "scaling_eff"])
    # Strong and weak 2-replica cells are two groups, each with its own line in the table.
    assert "Scaling" in out.text and "efficiency [95% CI]" in out.text
    assert "torch:eager x2 weak  weak" in out.text and "torch:eager x2       strong" in out.text


def test_a_failed_group_and_a_missing_single_replica_have_no_efficiency(tmp_path):
    out = compare.run_compare([str(_csv(tmp_path, failed=((2, "strong"),)))])
    g = out.groups.reset_index().set_index("mode")
    assert np.isnan(g.loc["eager x2", "scaling_eff"]) and g.loc["eager x4", "scaling_eff"] > 0
    (tmp_path / "alone").mkdir()
    alone = compare.run_compare([str(_csv(tmp_path / "alone", cells=CELLS[1:2]))])
    row = alone.groups.iloc[0]
    assert np.isnan(row["scaling_eff"]) and row["scaling_of"] == ""
    assert "  n/a  " in alone.text.split("\nScaling\n")[1]


def test_modes_name_replicas_and_scaling_and_read_back():
    assert experiments.split_mode("eager x2 weak") == ("eager", 2, "weak")
    assert experiments.split_mode("tf.function x4") == ("tf.function", 4, "strong")
    assert experiments.split_mode("jit") == ("jit", 1, "strong")


def test_the_scaling_figure_is_drawn(tmp_path):
    df = results.read(_csv(tmp_path))
    drawn = {d.stem: d for d in report.figures(df)}
    assert "cifar10-cpu-scaling" in drawn and "scaling efficiency" in drawn["cifar10-cpu-scaling"].caption
    legend = [t.get_text() for t in drawn["cifar10-cpu-scaling"].figure.axes[0].get_legend().get_texts()]
    eff4 = np.median(CELLS[0][2]) / np.median(CELLS[3][2]) / 4
    assert any(f"x4 {eff4:.2f} [" in label and label.startswith("torch:eager (x2 ") for label in legend), legend
    assert any(label.startswith("torch:eager (weak) (x2 ") for label in legend), legend


def test_weak_scaling_needs_no_divisible_batch_and_scales_the_batch_not_the_definition():
    w = workload.load("mnist")
    with pytest.raises(Exception, match="does not split evenly"):
        replicas.check_batches([w], [3])
    replicas.check_batches([w], [3], "weak")
    weak = replicas.scaled(w, 3, "none", "weak")
    assert weak.training.batch_size == 3 * w.training.batch_size and weak.training.lr == w.training.lr
    both = replicas.scaled(w, 2, "linear", "weak")
    assert both.training.lr == 2 * w.training.lr and both.training.batch_size == 2 * w.training.batch_size
    assert replicas.scaled(w, 1, "linear", "weak") is w


def test_scaling_is_in_the_help_and_a_bad_value_is_one_line():
    assert "--scaling [strong|weak]" in CliRunner().invoke(main, ["run", "--help"]).output
    got = CliRunner().invoke(main, ["run", "mnist", "--scaling", "linear"])
    assert got.exit_code == 2 and "'linear' is not one of 'strong', 'weak'" in got.output


@requires_torch
@pytest.mark.slow
def test_two_weak_replicas_train_twice_the_batch_and_match_the_reference_there(tmp_path):
    from benchbackend.run import checks
    from benchbackend.run.plan import Options

    w = workload.load("mnist").with_overrides(limit=96, epochs=1, batch_size=16)
    msgs, rows = run_cell(tmp_path, w, "torch", parity_steps=3, options=Options(replicas=2, threads=1, scaling="weak"))
    trajectory = next(r for r in rows if r["phase"] == "parity" and r.get("steps"))
    # Three steps of global batches of 32 agree with the reference at that batch (a tiny epoch may
    # still end at chance accuracy: the status is not the point here).
    assert trajectory["steps"] == 3 and trajectory["parity_step"] is None, checks.cell_status(rows, w)
    epoch = next(r for r in rows if r["phase"] == "train_epoch")
    assert epoch["steps"] == 3  # 96 samples in global batches of 2 x 16
    assert epoch["comm_s"] > 0  # DDP's comm hook timed the all-reduces


def test_the_html_report_carries_the_scaling_table_compare_prints(tmp_path):
    """Issue 41 item 4: the page showed efficiency only in a figure's legend; comm share and ring MB
    never appeared."""
    import re

    from benchbackend.analysis import page

    csv = _csv(tmp_path)
    out = compare.run_compare([str(csv)])
    html = page.summary_html(out.groups)
    part = html.split("<h4>Scaling</h4>")[1].split("</table>")[0]
    cells = [re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row) for row in re.findall(r"<tr>(.*?)</tr>", part, re.S)]
    assert cells[0][-3:] == ["comm share", "grad MB", "ring MB/step"]
    text_rows = out.text.split("\nScaling\n")[1]
    for row in cells[1:]:  # every figure the terminal prints, in the page too
        assert row[5] in text_rows and row[6] in text_rows and row[8] in text_rows, row
    assert len(cells) == 4 and "Scaling efficiency = throughput_N" in html

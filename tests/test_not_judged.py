"""Chance judged where the user looks (issue 43, item 4): a batchnorm network trained for a few steps
validates with untrained moving statistics, so its validation accuracy sits at chance on every
backend. Such a cell was ``ok`` (judged on its training accuracy) and could be starred "fastest
correct"; now it is ``not_judged``, saying why and how far from settled, and ranked nowhere. A cell
whose training accuracy is at chance too is ``chance_accuracy``; a settled one is judged on its
validation accuracy as before."""
from __future__ import annotations

from benchbackend.run import checks
from benchbackend.spec import workload


def _epochs(steps: int, val: float, train: float) -> list[dict]:
    return [{"phase": "train_epoch", "epoch": 1, "steps": steps, "loss": 2.0, "val_accuracy": val,
             "val_samples": 1000, "accuracy": train, "samples": steps * 128}]


def test_a_quick_batchnorm_run_at_chance_is_not_judged() -> None:
    w = workload.load("resnet20")  # momentum 0.9: 22 steps leave 10% of the initial statistics
    status, message = checks.cell_status(_epochs(8, val=0.098, train=0.41), w)
    assert status == "not_judged", message
    assert message.startswith("batchnorm's moving statistics have not settled at this size (8 steps: 43% of their "
                              "initial values remain; 22 steps leave 10%), so validation accuracy 0.098 is at "
                              "chance; training accuracy 0.410 is not")


def test_at_chance_in_training_too_is_chance_accuracy_and_settled_runs_are_judged_on_validation() -> None:
    w = workload.load("resnet20")
    assert checks.cell_status(_epochs(8, val=0.098, train=0.10), w)[0] == "chance_accuracy"
    assert checks.cell_status(_epochs(30, val=0.098, train=0.41), w)[0] == "chance_accuracy"
    assert checks.cell_status(_epochs(8, val=0.35, train=0.41), w) == ("ok", "")


def test_not_judged_counts_as_a_failed_check_in_the_summary() -> None:
    from benchbackend.analysis.summary import CHECK_FAILED

    assert "not_judged" in CHECK_FAILED

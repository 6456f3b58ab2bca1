"""Timed training epochs audited through their losses (issue 43, item 2, ``run/loss_audit.py``):
each epoch's step losses, handed back by the adapter, must match what the backend's own training-mode
forward pass gives for the epoch's first batch from the epoch's starting weights, epoch 1's first
steps must match the trajectory check's, and the epoch's loss must be their mean. A backend that
reports losses not computed on the timed batches ends ``audit_failed``, naming the epoch and the
step; the honest adapters pass."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchbackend import results
from benchbackend.backends import registry as backends
from benchbackend.run import checks, loss_audit
from benchbackend.spec import workload
from conftest import run_cell

STALE = backends.BackendSpec(
    "staleloss", "support.stale_loss:StaleLossBackend", ("numpy",), "numpy", "(test only)",
    "the NumPy reference reporting its first step's loss for every later step",
    modes=(backends.Mode("stale", "the first loss it computed, reported for every step"),),
    precisions=("fp32",))


def _mnist(epochs: int = 2) -> workload.Workload:
    w = workload.load("mnist").with_overrides(limit=256, epochs=epochs)
    return w.model_copy(update={"inference": w.inference.model_copy(update={"repeats": 1})})


def _epochs(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["phase"] == "train_epoch"]


@pytest.mark.parametrize("backend", ["numpy", "torch", "tensorflow", "jax"])
def test_an_honest_adapter_passes_its_loss_audit(tmp_path: Path, backend: str) -> None:
    w = _mnist()
    _, rows = run_cell(tmp_path, w, backend, parity_steps=3)
    epochs = _epochs(rows)
    # epoch 1: its first step and the trajectory's 3; epoch 2: its first step
    assert [r["loss_audited"] for r in epochs] == [3, 1], epochs
    assert all(r.get("audit_step") is None for r in epochs)
    assert checks.cell_status(rows, w)[0] == "ok", checks.cell_status(rows, w)


@pytest.mark.parametrize("plant, parity_steps, epoch, step", [
    ("StaleLossBackend", 0, 2, 1),       # epoch 1's first loss, reported again in epoch 2
    ("StaleLossBackend", 3, 1, 2),       # the trajectory check's step 2 sees it in epoch 1
    ("FixedBatchLossBackend", 0, 2, 1),  # a held batch's loss is not epoch 2's first batch's
    ("FirstBatchMeanBackend", 0, 1, 0),  # honest steps, but the epoch's loss is one batch's
])
def test_a_loss_not_computed_on_the_timed_batches_fails_the_audit(tmp_path: Path, plant: str, parity_steps: int,
                                                                  epoch: int, step: int) -> None:
    w = _mnist()
    _, rows = run_cell(tmp_path, w, "numpy", parity_steps=parity_steps, target=f"support.stale_loss:{plant}")
    status, message = checks.cell_status(rows, w)
    bad = [r for r in _epochs(rows) if r.get("audit_step") is not None]
    assert status == "audit_failed" and bad and (bad[0]["epoch"], bad[0]["audit_step"]) == (epoch, step), (
        status, message)
    assert message.startswith(f"training epoch {epoch}" + (f", step {step}:" if step else ":")), message


def test_the_cli_ends_a_planted_cell_audit_failed_in_real_worker_processes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchbackend run`` with the plant beside the honest reference, each cell in a worker process
    of its own (the worker is what audits): the plant's cell ends ``audit_failed`` with the epoch
    and the step in its message; the reference's, on the same weights and batches, ends ``ok``."""
    from click.testing import CliRunner

    from benchbackend.cli import main

    monkeypatch.setitem(backends.BACKENDS, STALE.name, STALE)
    monkeypatch.setenv("PYTHONPATH", f"{Path(__file__).parent}:{Path(__file__).parent.parent}")
    out = tmp_path / "audit.csv"
    r = CliRunner().invoke(main, ["run", "mnist", "-b", "numpy", "-b", "staleloss", "--data", "synthetic",
                                  "--limit", "256", "--epochs", "2", "--repeats", "1", "-o", str(out),
                                  "--no-plots"])
    df = results.read(out)
    run = df[df.phase == "run"].set_index("backend")
    assert run.loc["numpy", "status"] == "ok", (run[["status", "message"]], r.output[-2000:])
    assert run.loc["staleloss", "status"] == "audit_failed", run[["status", "message"]]
    assert run.loc["staleloss", "message"].startswith("training epoch 2, step 1: reported loss")
    epochs = df[(df.phase == "train_epoch") & (df.backend == "staleloss")].set_index("epoch")
    assert epochs.loc[2, "audit_step"] == 1 and np.isnan(epochs.loc[1, "audit_step"])


def test_an_adapter_that_keeps_no_step_losses_is_noted_not_passed_silently(tmp_path: Path) -> None:
    w = _mnist(epochs=1)
    _, rows = run_cell(tmp_path, w, "numpy", target="support.stale_loss:SilentBackend")
    (epoch,) = _epochs(rows)
    assert epoch.get("loss_audited") is None and epoch["notes"] == loss_audit.NOT_SUPPORTED, epoch


def test_steps_of_a_network_with_dropout_are_not_recomputed_and_say_so(tmp_path: Path) -> None:
    w = workload.load("mnist").with_overrides(limit=128, epochs=1)
    layers = list(w.model)
    dropout = workload.Workload.model_validate(
        {**w.model_dump(), "model": [*[m.model_dump() for m in layers[:-1]], {"type": "dropout", "rate": 0.25},
                                     layers[-1].model_dump()]})
    _, rows = run_cell(tmp_path, dropout, "numpy")
    (epoch,) = _epochs(rows)
    assert epoch["loss_audited"] == 0 and "dropout" in epoch["notes"], epoch
    assert checks.cell_status(rows, dropout)[0] != "audit_failed"


def test_judge_reads_the_band_between_a_clipped_and_an_unclipped_loss() -> None:
    probs = np.array([[1e-9, 1 - 1e-9], [0.5, 0.5]])
    low, high = loss_audit.band(probs, np.array([0, 1]))
    assert low < high  # the clip changes the first sample's term
    sizes = np.array([2.0])
    ok = {1: (low, high, 1e-3, "x")}
    assert loss_audit.judge(1, (low + high) / 2, np.array([(low + high) / 2]), sizes, ok, 1e-3) == (None, "")
    assert loss_audit.judge(1, 2 * high, np.array([2 * high]), sizes, ok, 1e-3)[0] == 1
    assert loss_audit.judge(3, 1.0, np.array([1.0, 1.0]), sizes, {}, 1e-3)[0] == 2  # a step count that differs

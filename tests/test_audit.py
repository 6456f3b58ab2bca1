"""Timed inference outputs audited (issue 43, item 2): every timed inference pass's outputs of a
seeded share of the test samples (1%, at least 100) must be what an untimed pass of those samples
gives, so a backend that caches, skips work or returns another batch's outputs during the timed
passes ends ``audit_failed``, naming the pass and the sample; an honest backend passes."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchbackend.run import checks
from benchbackend.spec import workload
from conftest import run_cell


def _mnist() -> workload.Workload:
    w = workload.load("mnist").with_overrides(limit=64, epochs=1)
    return w.model_copy(update={"data": w.data.model_copy(update={"test": 300}),
                                "inference": w.inference.model_copy(update={"batch_size": 64, "repeats": 2})})


def test_an_honest_backend_passes_its_audit(tmp_path: Path) -> None:
    w = _mnist()
    _, rows = run_cell(tmp_path, w, "numpy", trains=False)
    inference = [r for r in rows if r["phase"] == "inference"]
    assert [r["audited"] for r in inference] == [100, 100] and all(r.get("audit_sample") is None for r in inference)
    assert checks.cell_status(rows, w)[0] == "ok"


@pytest.mark.parametrize("cheat, first_pass", [("ShapeCachingBackend", 1), ("SkippingBackend", 1)])
def test_a_backend_that_cheats_in_its_timed_passes_fails_its_audit(tmp_path: Path, cheat: str,
                                                                   first_pass: int) -> None:
    w = _mnist()
    _, rows = run_cell(tmp_path, w, "numpy", trains=False, target=f"support.caching_backend:{cheat}")
    status, message = checks.cell_status(rows, w)
    bad = [r for r in rows if r["phase"] == "inference" and r.get("audit_sample") is not None]
    assert status == "audit_failed" and bad and bad[0]["pass"] == first_pass, (status, message)
    sample = bad[0]["audit_sample"]
    assert sample >= 64 and f"timed inference pass {first_pass}, test sample {sample}:" in message, message


def test_the_audited_share_is_one_percent_at_least_a_hundred_chosen_by_the_seed() -> None:
    assert len(checks.audit_indices(50, 0)) == 50 and len(checks.audit_indices(300, 0)) == 100
    assert len(checks.audit_indices(20_000, 0)) == 200
    assert not np.array_equal(checks.audit_indices(1000, 0), checks.audit_indices(1000, 1))
    assert np.array_equal(checks.audit_indices(1000, 3), checks.audit_indices(1000, 3))

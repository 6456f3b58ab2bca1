"""``--compile-cache`` (issue 40, item 3): ``warm`` keeps a cell's compiled programs between runs in its
framework's own persistent cache (JAX's compilation cache, torch.compile's inductor cache, tvm:tuned's
tuning database), one folder per workload, mode and precision; ``cold`` compiles into an empty folder,
removed after. The rows say which (``compile_cache``, ``compile_cache_hit``), and compare keeps cold
cells apart from warm ones. torch.compile's folder is checked on test_fast_modes's compile cell (one
cold inductor compilation is 10-30 s)."""
from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest

from benchbackend.analysis import experiments
from benchbackend.run.plan import Options
from benchbackend.spec import workload
from conftest import invoke, requires, run_cell


@pytest.fixture
def compiled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache of compiled programs, the folder ``warm`` keeps them in."""
    monkeypatch.setenv("BENCHBACKEND_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("BENCHBACKEND_COMPILE_CACHE", raising=False)
    return tmp_path / "cache" / "compile"


def _cell(tmp_path: Path, backend: str, setting: str, mode: str) -> tuple[dict, list[dict]]:
    tmp_path.mkdir()
    w = workload.load("mnist").with_overrides(limit=64, epochs=1)
    msgs, rows = run_cell(tmp_path, w, backend, mode=mode, options=Options(compile_cache=setting))
    assert not [m for m in msgs if m.get("type") in ("error", "unavailable")], msgs
    return next(m for m in msgs if m.get("type") == "info"), rows


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


@requires("jax")
def test_a_warm_jax_cell_finds_every_program_the_first_one_kept_and_a_cold_one_keeps_none(tmp_path, compiled):
    first, _ = _cell(tmp_path / "1", "jax", "warm", "jit")
    assert first["compile_cache"] == "warm" and first["compile_cache_hit"] is False
    (folder,) = (compiled / "jax").iterdir()  # one folder: this workload, mode and precision
    kept = _files(folder)
    assert kept and folder.name.endswith("-jit-fp32")
    second, _ = _cell(tmp_path / "2", "jax", "warm", "jit")
    assert second["compile_cache_hit"] is True
    assert _files(folder) == kept  # every program read back: none compiled and written anew
    cold, _ = _cell(tmp_path / "3", "jax", "cold", "jit")
    assert cold["compile_cache"] == "cold" and cold["compile_cache_hit"] is False
    assert _files(folder) == kept and "BENCHBACKEND_COMPILE_CACHE" not in os.environ
    import jax

    assert jax.config.jax_compilation_cache_dir is None  # the process's settings put back after each cell


def test_compare_groups_cold_cells_apart_from_warm_ones() -> None:
    rows = pd.DataFrame({"mode": ["jit", "jit", "eager"], "compile_cache": ["warm", "cold", ""]})
    frame = pd.DataFrame({c: [""] * 3 for c in ("workload", "workload_hash", "data_source", "threads", "backend",
                                                "requested_device", "device", "precision", "status", "phase")})
    frame = frame.assign(backend=["jax", "jax", "torch"], **rows)
    assert experiments.for_comparison(frame)["mode"].tolist() == ["jit", "jit cold", "eager"]


def test_an_unknown_setting_is_a_one_line_error() -> None:
    result = invoke("run", "mnist", "--compile-cache", "lukewarm")
    assert result.exit_code == 2 and "'lukewarm' is not one of 'warm', 'cold'" in result.output

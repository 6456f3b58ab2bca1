"""Shared fixtures. Framework tests skip with a reason when the framework is absent."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


requires_torch = pytest.mark.skipif(not have("torch"), reason="PyTorch is not installed (pip install 'benchbackend[torch]' torch==2.13.0)")
requires_tf = pytest.mark.skipif(not have("tensorflow"), reason="TensorFlow is not installed (pip install 'benchbackend[tensorflow]')")


def cli(*args: str, cwd: Path | None = None, timeout: float = 900, env: dict | None = None):
    """Run the real CLI as a subprocess (python -m benchbackend)."""
    import subprocess

    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "benchbackend", *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, timeout=timeout, env=full_env)


@pytest.fixture(scope="session")
def envs_root(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the isolated environments (PlaidML, Chainer) are built once and reused across runs:
    $BENCHBACKEND_ENVS if set, else pytest's cache folder (.pytest_cache/d/benchbackend-envs)."""
    if os.environ.get("BENCHBACKEND_ENVS"):
        return Path(os.environ["BENCHBACKEND_ENVS"])
    cache = getattr(request.config, "cache", None)
    return cache.mkdir("benchbackend-envs") if cache else tmp_path_factory.mktemp("envs")


def job_arrays(tmp_path: Path, w) -> str:
    """The run's arrays as the runner hands them to a worker (an .npz of synthetic data and orders),
    in ``tmp_path``, named by the workload's hash."""
    from benchbackend import data

    ds = data.load(w, "synthetic")
    path = tmp_path / f"{w.name}-{w.hash()}.npz"
    ds.save(path, data.epoch_orders(len(ds.y_train), w.training.epochs, w.seed))
    return str(path)


def built_env(envs_root: Path, name: str, probe, label: str):
    """The isolated environment ``name`` built (or reused) under ``envs_root``; skips, saying why, where
    it cannot be built here (no package index, no wheel, no venv)."""
    from unittest import mock

    from benchbackend import envs
    from benchbackend.errors import EnvError

    with mock.patch.dict(os.environ, {"BENCHBACKEND_ENVS": str(envs_root)}):
        try:
            st = envs.setup(name, probe)
        except EnvError as exc:
            if str(exc).startswith(("pip install", "creating the")):
                pytest.skip(f"cannot build the {label} env here: {exc}")
            raise
    assert st.ready, st.message
    return st

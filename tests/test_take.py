"""``Backend.take`` (issue 39): the gather of a query's samples on the device, inside the clock of
``--scenario`` (``run/scenario.py``), on each framework that has one. Each backend runs
``support/take_check.py`` in a process of its own with the worker's interpreter and environment
(Keras's backend is chosen before Keras is imported; Chainer runs in its isolated env)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import backend_params, isolated_env

CHECK = Path(__file__).parent / "support" / "take_check.py"


@pytest.mark.parametrize("name", backend_params(["tensorflow", "jax", "keras-jax", "keras-torch", "torch", "chainer"],
                                                build_isolated=True))
def test_take_gathers_the_query_on_the_device(name: str, envs_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from benchbackend.backends import registry as backends
    from benchbackend.run import launch

    for key, value in isolated_env(envs_root, name).items():
        monkeypatch.setenv(key, value)
    spec = backends.get(name)
    python = launch.python_for(spec) if spec.isolated_env else sys.executable
    done = subprocess.run([python, str(CHECK), name], capture_output=True, text=True, timeout=300,
                          env=launch.worker_environ(spec, "cpu", threads=2))
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["gathers"], got  # None: the SUT would copy every query from the host, noted in the row
    assert got["same_samples"] and got["shape"] == [6, 4], got
    assert got["scores_diff"] < 1e-5, got

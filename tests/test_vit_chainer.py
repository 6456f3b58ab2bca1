"""Chainer builds and trains the ViT layers (``chainer_transformer``): the trap network in static-graph
mode with heavy decoupled weight decay (define-by-run: ``test_vit_backends.py``), and each convention
planted back to a default (``support.chainer_planted``) fails the check the real adapter passes.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import pytest
from support.vit import PARITY_RTOL, trap

from benchbackend.backends import envs
from benchbackend.run import checks
from benchbackend.spec.workload import Workload
from conftest import FORKS, built_env, make_job

pytestmark = [pytest.mark.chainer, pytest.mark.slow]

TESTS = Path(__file__).resolve().parent
#: Kernels shrink by lr * rate = 10% a step: a trajectory that misses the attention's decay shows it.
DECAYED = {"weight_decay": {"kind": "decoupled", "rate": 100.0}}


@pytest.fixture(scope="module")
def chainer_env(envs_root: Path) -> envs.EnvStatus:
    return built_env(envs_root, "chainer",
                     envs.Probe("chainer", "benchbackend.backends.chainer.adapter:ChainerBackend", {}), "Chainer")


def cell(env: envs.EnvStatus, tmp: Path, w: Workload, target: Optional[str] = None, **fields) -> tuple[dict, dict]:
    """(the forward parity row, the trajectory row decided) of one Chainer worker on ``w``; ``target``: a
    planted adapter of ``support.chainer_planted``."""
    job = make_job(tmp, w, "chainer", target=target and f"support.chainer_planted:{target}", **fields)
    worker_env = envs.worker_env()
    worker_env["PYTHONPATH"] += os.pathsep + str(TESTS)
    proc = FORKS.run(env.python, worker_env, job, 600)
    msgs = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert proc.returncode == 0 and not [m for m in msgs if m.get("type") == "error"], (msgs, proc.stderr[-3000:])
    parity = [m for m in msgs if m.get("type") == "row" and m["phase"] == "parity"]
    forward = next(r for r in parity if not r.get("steps"))
    steps = [checks.trajectory(r, w) for r in parity if r.get("steps")]
    return forward, (steps[0] if steps else {})


def test_static_graph_builds_and_trains_the_trap(chainer_env: envs.EnvStatus, tmp_path: Path) -> None:
    forward, steps = cell(chainer_env, tmp_path, trap(**DECAYED), mode="static-graph", parity_steps=4)
    assert forward["parity_max_rel"] < PARITY_RTOL, forward
    assert steps["steps"] == 4 and steps["parity_step"] is None, steps["notes"]


@pytest.mark.parametrize("planted", ["ChainerEpsilon", "TanhGelu", "Unscaled"])
def test_a_planted_default_misses_forward_parity(chainer_env: envs.EnvStatus, tmp_path: Path, planted: str) -> None:
    forward, _ = cell(chainer_env, tmp_path, trap(), planted)
    assert forward["parity_max_rel"] > 10 * PARITY_RTOL, forward


def test_undecayed_attention_kernels_miss_the_trajectory(chainer_env: envs.EnvStatus, tmp_path: Path) -> None:
    forward, steps = cell(chainer_env, tmp_path, trap(**DECAYED), "AttentionUndecayed", parity_steps=4)
    assert forward["parity_max_rel"] < PARITY_RTOL
    assert steps["parity_step"] is not None, steps["notes"]

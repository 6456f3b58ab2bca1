"""Test files that must not share the test session's process run here, each in a pytest of its own.

OpenVINO's ``Core()`` segfaulted in CI's single test process after torch, TensorFlow, JAX and Keras
had run in it; the product never does that (one framework per worker process), so those tests get
a process of their own too. The child's failures are this test's failure, with its output.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT

ISOLATED = ["onnx_runtimes"]


@pytest.mark.parametrize("name", ISOLATED)
def test_in_its_own_process(name):
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider",
                          f"tests/test_{name}.py"], cwd=ROOT, capture_output=True, text=True, timeout=1800,
                         env=dict(os.environ, BENCHBACKEND_ISOLATED=name))
    tail = (out.stdout + out.stderr)[-4000:]
    assert out.returncode in (0, 5), tail  # 5: everything skipped (the frameworks are not installed)
    print(tail.strip().splitlines()[-1])

"""Test files that must not share the test session's process run here, each in a pytest of its own.

OpenVINO's ``Core()`` segfaulted in CI's single test process after torch, TensorFlow, JAX and Keras
had run in it; the product never does that (one framework per worker process), so those tests get
a process of their own too. The child's failures are this test's failure, with its output.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow  # every test here starts a framework's worker or trains one
ISOLATED = ["onnx_runtimes"]


@pytest.mark.parametrize("name", ISOLATED)
def test_in_its_own_process(name):
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider",
                          f"tests/test_{name}.py"], cwd=ROOT, capture_output=True, text=True, timeout=1800,
                         env=dict(os.environ, BENCHBACKEND_ISOLATED=name))
    tail = (out.stdout + out.stderr)[-4000:]
    # 0 only: 5 ("no tests ran") would let a file whose every test skipped pass as green. A test that
    # skips for a missing framework fails in the child too under BENCHBACKEND_REQUIRE_ALL=1.
    assert out.returncode == 0 and re.search(r"\d+ passed", tail), tail
    print(tail.strip().splitlines()[-1])

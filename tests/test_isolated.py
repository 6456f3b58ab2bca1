"""Test files that must not share the test session's process run here, each in a pytest of its own.

OpenVINO's ``Core()`` segfaulted in CI's single test process after torch, TensorFlow, JAX and Keras
had run in it; the product never does that (one framework per worker process), so those tests get
a process of their own too. The child's failures are this test's failure, with its output.

The rules that keep such a run honest are tested here too, on planted children: a child that ran
no test, or only skipped ones, is not green; and under ``BENCHBACKEND_REQUIRE_ALL=1`` an isolated
environment (PlaidML, Chainer) that fails to build fails the run instead of skipping its tests.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import ROOT

ISOLATED = ["onnx_runtimes"]


def child_pytest(*args: str, cwd: Path = ROOT, env: dict | None = None, timeout: float = 1800):
    """``python -m pytest -q -ra ARGS`` in a process of its own: (exit status, the end of its output)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", *args], cwd=cwd,
                         capture_output=True, text=True, timeout=timeout, env=dict(os.environ, **(env or {})))
    return out.returncode, (out.stdout + out.stderr)[-4000:]


def assert_green(returncode: int, tail: str) -> None:
    # 0 only: 5 ("no tests ran") would let a file whose every test was deselected pass as green, and
    # a test must have passed: a file whose every test skipped exits 0. A test that skips for a
    # missing framework fails in the child too under BENCHBACKEND_REQUIRE_ALL=1.
    assert returncode == 0 and re.search(r"\d+ passed", tail), tail


@pytest.mark.slow  # every test it runs starts a framework's worker or trains one
@pytest.mark.parametrize("name", ISOLATED)
def test_in_its_own_process(name):
    returncode, tail = child_pytest(f"tests/test_{name}.py", env={"BENCHBACKEND_ISOLATED": name})
    assert_green(returncode, tail)
    print(tail.strip().splitlines()[-1])


@pytest.mark.parametrize("body, status, says", [
    ("def helper():\n    pass\n", 5, "no tests ran"),
    ("import pytest\n\n@pytest.mark.skip(reason='absent')\ndef test_skipped():\n    pass\n", 0, "1 skipped"),
])
def test_a_child_that_passed_no_test_is_not_green(tmp_path, body, status, says):
    (tmp_path / "test_planted.py").write_text(body)
    returncode, tail = child_pytest("test_planted.py", cwd=tmp_path, env={"BENCHBACKEND_REQUIRE_ALL": ""})
    assert returncode == status and says in tail, tail  # what the planted child really did
    with pytest.raises(AssertionError):
        assert_green(returncode, tail)


#: A session fixture as tests/test_plaidml.py's, whose build fails as pip fails without an index.
FAILING_BUILD = textwrap.dedent('''
    from unittest import mock

    import pytest

    from benchbackend.backends import envs
    from benchbackend.errors import EnvError
    from conftest import built_env

    FAILED = EnvError("pip install into the plaidml environment failed (exit 1): ERROR: No matching "
                      "distribution found for plaidml==0.7.0; see the end of setup.log")


    @pytest.fixture(scope="session")
    def plaidml_env(tmp_path_factory):
        with mock.patch.object(envs, "setup", side_effect=FAILED):
            return built_env(tmp_path_factory.mktemp("envs"), "plaidml", None, "PlaidML")


    def test_one(plaidml_env):
        pass


    def test_two(plaidml_env):
        pass
''')


@pytest.mark.parametrize("require_all", [False, True])
def test_an_isolated_env_that_fails_to_build_fails_the_run_under_require_all(tmp_path, require_all):
    """The child loads tests/conftest.py (``-p conftest``): its ``built_env`` and its report hook,
    the ones every PlaidML and Chainer test goes through. No environment is built: ``envs.setup``
    raises as a failed ``pip install`` does."""
    (tmp_path / "test_planted.py").write_text(FAILING_BUILD)
    path = os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    returncode, tail = child_pytest("-p", "conftest", "test_planted.py", cwd=tmp_path, timeout=300,
                                    env={"PYTHONPATH": path, "BENCHBACKEND_REQUIRE_ALL": "1" if require_all else ""})
    assert "cannot build the PlaidML env here: pip install into the plaidml environment failed" in tail, tail
    if require_all:
        assert returncode == 1 and "2 errors" in tail and "2 skipped" not in tail, tail
        assert tail.count("BENCHBACKEND_REQUIRE_ALL=1 and this would have skipped") >= 2, tail
    else:  # a developer's machine without a package index: a skip that says why
        assert returncode == 0 and "2 skipped" in tail, tail

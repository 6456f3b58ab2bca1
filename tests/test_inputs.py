"""What `run` checks before any worker starts (issue 24, items 3, 4 and 8): where it writes (an
unwritable -o or plots folder is one line, exit 2; an existing results file is never overwritten
without --force), a half-installed backend is a usage error with its install command, and sizes
that make a run doubtful are said up front."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from benchbackend import results
from benchbackend.cli import main
from benchbackend.run import plan
from benchbackend.spec import workload

ROOT = Path(__file__).resolve().parent.parent
TINY = ["mnist", "-b", "numpy", "--data", "synthetic", "--limit", "200", "--epochs", "1", "--repeats", "1", "-q"]


def _run(monkeypatch, *args: str):
    from support import inprocess

    started = []
    inprocess.use(monkeypatch)
    monkeypatch.setattr(inprocess.InProcessExecutor, "run", _counting(inprocess.InProcessExecutor.run, started))
    return CliRunner().invoke(main, ["run", *TINY, *args]), started


def _counting(real, started: list):
    def run(self, tasks):
        started.append(len(tasks))
        yield from real(self, tasks)
    return run


@pytest.mark.parametrize("where", ["/proc/bb-results.csv", "a-file/under.csv"])
def test_an_unwritable_output_is_one_line_before_any_work(monkeypatch, tmp_path, where):
    (tmp_path / "a-file").write_text("not a folder")
    target = where if where.startswith("/") else str(tmp_path / where)
    out, started = _run(monkeypatch, "-o", target, "--no-plots")
    assert out.exit_code == 2, out.output
    lines = out.output.strip().splitlines()
    assert len(lines) == 1 and "cannot write results" in lines[0] and target in lines[0], out.output
    assert "Traceback" not in out.output and started == []
    if not where.startswith("/"):
        assert "is a file, not a folder" in lines[0]  # not the misleading "File exists"


def test_a_plots_path_that_is_a_file_is_refused_before_any_work(monkeypatch, tmp_path):
    (tmp_path / "r-plots").write_text("a file where the report would go")
    out, started = _run(monkeypatch, "-o", str(tmp_path / "r.csv"), "--force")
    assert out.exit_code == 2 and "cannot write plots" in out.output and started == []
    assert not (tmp_path / "r.csv").exists()


def test_an_existing_results_file_is_kept_and_the_run_writes_beside_it(monkeypatch, tmp_path):
    old = tmp_path / "r.csv"
    old.write_text("earlier results\n")
    out, _ = _run(monkeypatch, "-o", str(old), "--no-plots")
    assert out.exit_code in (0, 1), out.output  # 1: a 7-step mnist may end at chance_accuracy
    assert old.read_text() == "earlier results\n"
    beside = tmp_path / "r-2.csv"
    assert "run" in set(results.read(beside)["phase"])
    assert f"writing {beside}" in out.stderr and "--force" in out.stderr
    again, _ = _run(monkeypatch, "-o", str(old), "--no-plots")
    assert again.exit_code in (0, 1) and (tmp_path / "r-3.csv").exists()


def test_force_overwrites(monkeypatch, tmp_path):
    old = tmp_path / "r.csv"
    old.write_text("earlier results\n")
    out, _ = _run(monkeypatch, "-o", str(old), "--no-plots", "--force")
    assert out.exit_code in (0, 1), out.output
    assert "run" in set(results.read(old)["phase"]) and not (tmp_path / "r-2.csv").exists()


def _without(module: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The CLI in a subprocess where ``module`` cannot be found (as on a machine without it)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(f"import sys\nsys.modules[{module!r}] = None  # not installed\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    return subprocess.run([sys.executable, "-m", "benchbackend", *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)


def test_a_half_installed_backend_is_a_usage_error_with_its_install_command(tmp_path):
    # keras-jax without jax says what -b jax says: one line, exit 2, what is missing, the pip command.
    for backend in ("keras-jax", "jax"):
        out = _without("jax", tmp_path, "run", "mnist", "-b", backend, "--data", "synthetic", "--limit", "200",
                       "-o", str(tmp_path / "r.csv"))
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
        assert f"backend '{backend}' is not installed (jax is not installed)" in lines[0]
        assert "pip install 'benchbackend[" in lines[0]
        assert not (tmp_path / "r.csv").exists()
    listed = _without("jax", tmp_path, "list", "--no-probe")
    assert listed.returncode == 0
    row = next(line for line in listed.stdout.splitlines() if line.strip().startswith("keras-jax"))
    assert "not installed (jax is not installed)" in row and "pip install" in row


def test_sizes_that_make_a_run_doubtful_are_said_before_it(monkeypatch, tmp_path):
    mnist = workload.load("mnist")
    huge = plan.size_warnings([mnist.with_overrides(limit=100_000_000)], 100_000_000, False)
    assert huge == ["mnist: --limit 100,000,000 is above its 54,000 training samples; all 54,000 are used"]
    one = plan.size_warnings([mnist.with_overrides(limit=1)], 1, False)
    assert any("likely to end at chance_accuracy" in w for w in one)
    big_batch = plan.size_warnings([mnist.with_overrides(limit=200, batch_size=100_000)], 200, False)
    assert any("batch size 100,000 is larger than the 200 training samples" in w for w in big_batch)
    assert plan.size_warnings([mnist.with_overrides(limit=1)], 1, True) == []  # no training: no such doubt
    assert plan.size_warnings([mnist.with_overrides(limit=2000)], 2000, False) == []
    # On the command line: said first, on stderr, and the run goes on.
    out, started = _run(monkeypatch, "--batch-size", "100000", "-o", str(tmp_path / "r.csv"), "--no-plots")
    assert out.stderr.startswith("warning: mnist: batch size 100,000 is larger than the 200 training samples")
    assert started == [1]


def test_list_probes_once_per_installed_version_and_refreshes_on_request(monkeypatch, tmp_path):
    from benchbackend import inventory
    from benchbackend.backends import registry as backends

    monkeypatch.setenv("BENCHBACKEND_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    spec = backends.get("numpy")
    lines: list[str] = []
    first = inventory.probes([spec], progress=lines.append)["numpy"]
    assert first["devices"] and "cached" not in first and lines and "numpy" in lines[0]
    again = inventory.probes([spec], progress=lines.append)["numpy"]
    assert again["devices"] == first["devices"] and again["cached"] and len(lines) == 1  # no second probe
    assert "cached" not in inventory.probes([spec], refresh=True)["numpy"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # what a framework can see changed: probe again
    assert "cached" not in inventory.probes([spec])["numpy"]
    # The command says when it probed; one backend is enough to show it (with this fresh cache, every
    # backend's probe was 40 core-seconds: test_cli's `list` probes them all).
    real = inventory.probes
    monkeypatch.setattr(inventory, "probes",
                        lambda specs, *a, **kw: real([s for s in specs if s.name == "numpy"], *a, **kw))
    out = CliRunner().invoke(main, ["list"])
    assert out.exit_code == 0 and "(probed " in out.stdout

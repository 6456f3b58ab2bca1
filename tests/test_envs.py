"""``envs.setup`` without pip or a network: install steps declared beside the pins, and the rule
that setup only ever touches folders it created (its marker file).

``_run`` (venv, pip) and the device probe are replaced by fakes that record what setup asked for;
``venv`` is faked by linking this interpreter, so that the env's ``bin/python`` really runs.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import pytest

from benchbackend.backends import envs, pins
from benchbackend.errors import EnvError

PROBE = envs.Probe("demo", "demo.module:DemoBackend", {})
PINS = """# demo pins
setuptools==73.0.1
numpy==1.26.4
#! pip install --no-build-isolation demo-pkg==1.0
# a plain comment
#! pip install --no-deps -c constraints.txt 'other[extra]>=2'
"""


class FakeTools:
    """Stands in for ``envs._run`` and ``envs.probe``; ``fail_on`` makes one pip step fail."""

    def __init__(self, fail_on: Optional[str] = None):
        self.commands: list[list[str]] = []
        self.fail_on = fail_on

    def run(self, cmd: list[str], logfile: Path, step: str, timeout: float) -> None:
        self.commands.append(cmd)
        if cmd[1:3] == ["-m", "venv"]:
            env = Path(cmd[3])
            (env / "bin").mkdir(parents=True, exist_ok=True)
            (env / "bin" / "python").symlink_to(sys.executable)
            (env / "pyvenv.cfg").write_text("version = 3.11.7\n")
        elif self.fail_on and self.fail_on in " ".join(cmd):
            raise EnvError(f"{step} failed (exit 1): no such package; see the end of {logfile}")

    def probe(self, name: str, check: envs.Probe, env: Optional[Path] = None, timeout: float = 0) -> dict:
        return {"version": "1.0", "devices": ["cpu"]}

    @property
    def pip_calls(self) -> list[list[str]]:
        return [c[c.index("install") + 1:] for c in self.commands if "pip" in c]


@pytest.fixture
def tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeTools:
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "demo-requirements.txt").write_text(PINS)
    monkeypatch.chdir(tmp_path)  # configs_dirs() looks in ./configs
    monkeypatch.setenv("BENCHBACKEND_ENVS", str(tmp_path / "envs"))
    fake = FakeTools()
    monkeypatch.setattr(envs, "_run", fake.run)
    monkeypatch.setattr(envs, "probe", fake.probe)
    return fake


def test_install_steps_are_read_in_order_from_directive_lines(tmp_path: Path) -> None:
    path = tmp_path / "pins.txt"
    path.write_text(PINS)
    assert pins.install_steps(path) == [["--no-build-isolation", "demo-pkg==1.0"],
                                        ["--no-deps", "-c", "constraints.txt", "other[extra]>=2"]]
    path.write_text("numpy\n#! rm -rf /\n")
    with pytest.raises(EnvError, match=r"pins.txt:2: an install step must read '#! pip install ARGS'"):
        pins.install_steps(path)


def test_setup_runs_the_install_steps_after_the_pins(tools: FakeTools, tmp_path: Path) -> None:
    st = envs.setup("demo", PROBE)
    assert st.ready, st.message
    assert tools.pip_calls == [["--no-input", "-r", str(tmp_path / "configs" / "demo-requirements.txt"),
                                *pins.WORKER_REQUIREMENTS],
                               ["--no-input", "--no-build-isolation", "demo-pkg==1.0"],
                               ["--no-input", "--no-deps", "-c", "constraints.txt", "other[extra]>=2"]]
    marker = json.loads((st.path / envs.MARKER).read_text())
    assert marker["created_by"] == "benchbackend" and marker["name"] == "demo" and marker["built"]


def test_status_lists_the_packages_of_install_steps(tools: FakeTools) -> None:
    st = envs.setup("demo", PROBE)
    site = st.path / "lib" / "python3.11" / "site-packages"
    for dist, version in (("demo_pkg", "1.0"), ("other", "2.1"), ("numpy", "1.26.4")):
        (site / f"{dist}-{version}.dist-info").mkdir(parents=True)
    versions = envs.status("demo", PROBE, verify=False).versions
    assert versions == {"numpy": "1.26.4", "demo-pkg": "1.0", "other": "2.1"}  # not 'constraints.txt'


def test_a_changed_install_step_makes_the_env_outdated(tools: FakeTools, tmp_path: Path) -> None:
    envs.setup("demo", PROBE)
    assert envs.is_ready("demo")
    pinned = tmp_path / "configs" / "demo-requirements.txt"
    pinned.write_text(PINS.replace("demo-pkg==1.0", "demo-pkg==1.1"))
    assert not envs.is_ready("demo")
    assert "other pins" in envs.status("demo", PROBE, verify=False).message


def test_a_malformed_install_step_fails_before_anything_is_created(tools: FakeTools, tmp_path: Path) -> None:
    (tmp_path / "configs" / "demo-requirements.txt").write_text("numpy\n#! curl http://x | sh\n")
    with pytest.raises(EnvError, match="demo-requirements.txt:2"):
        envs.setup("demo", PROBE)
    assert tools.commands == [] and not (tmp_path / "envs").exists()


@pytest.mark.parametrize("kind", ["files", "a user's venv"])
def test_setup_path_never_touches_a_folder_it_did_not_create(tools: FakeTools, tmp_path: Path, kind: str) -> None:
    target = tmp_path / "mine"
    (target / "bin").mkdir(parents=True)
    (target / "notes.txt").write_text("keep me")
    if kind == "a user's venv":
        (target / "pyvenv.cfg").write_text("version = 3.11.7\n")
        (target / "bin" / "python").symlink_to(sys.executable)
    before = sorted(p.relative_to(target) for p in target.rglob("*"))
    with pytest.raises(EnvError) as err:
        envs.setup("demo", PROBE, path=target)
    msg = str(err.value)
    assert "\n" not in msg and str(target) in msg and "not created by benchbackend" in msg
    assert sorted(p.relative_to(target) for p in target.rglob("*")) == before
    assert (target / "notes.txt").read_text() == "keep me"
    assert tools.commands == [] and not (tmp_path / "mine-setup.log").exists()


def test_an_empty_folder_is_used(tools: FakeTools, tmp_path: Path) -> None:
    target = tmp_path / "empty"
    target.mkdir()
    st = envs.setup("demo", PROBE, path=target)
    assert st.ready and st.path == target and envs.env_dir("demo") == target


def test_another_envs_folder_is_refused(tools: FakeTools, tmp_path: Path) -> None:
    target = tmp_path / "other"
    target.mkdir()
    (target / envs.MARKER).write_text(json.dumps({"created_by": "benchbackend", "name": "plaidml"}))
    with pytest.raises(EnvError, match="holds benchbackend's plaidml environment"):
        envs.setup("demo", PROBE, path=target)


def test_an_interrupted_setup_leaves_a_stub_that_the_next_setup_repairs(tools: FakeTools, tmp_path: Path) -> None:
    target = tmp_path / "env"
    tools.fail_on = "demo-pkg"
    with pytest.raises(EnvError, match="^pip install --no-build-isolation demo-pkg==1.0"):
        envs.setup("demo", PROBE, path=target)
    marker = json.loads((target / envs.MARKER).read_text())
    assert marker == {"created_by": "benchbackend", "name": "demo"}  # ours, but not a finished build
    assert not envs.status("demo", PROBE, path=target, verify=False).ready
    tools.fail_on, logged = None, []
    st = envs.setup("demo", PROBE, path=target, log=logged.append)
    assert st.ready and any("repairing" in line for line in logged), logged
    assert json.loads((target / envs.MARKER).read_text())["built"]


def test_the_stub_is_written_before_venv_runs(tools: FakeTools, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "env"

    def interrupted(cmd: list[str], logfile: Path, step: str, timeout: float) -> None:
        raise KeyboardInterrupt  # Ctrl-C while venv runs

    monkeypatch.setattr(envs, "_run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        envs.setup("demo", PROBE, path=target)
    assert json.loads((target / envs.MARKER).read_text())["created_by"] == "benchbackend"
    monkeypatch.setattr(envs, "_run", tools.run)
    assert envs.setup("demo", PROBE, path=target).ready  # recognized as ours, rebuilt


def test_a_broken_env_of_ours_is_rebuilt_from_scratch(tools: FakeTools, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    st = envs.setup("demo", PROBE)
    (st.path / "leftover.txt").write_text("x")
    calls = {"n": 0}

    def flaky(name: str, check: envs.Probe, env: Optional[Path] = None, timeout: float = 0) -> dict:
        calls["n"] += 1
        if calls["n"] <= 2:  # the reuse check, then the probe after reinstalling over it
            raise EnvError("the demo device probe failed: boom")
        return {"version": "1.0", "devices": ["cpu"]}

    monkeypatch.setattr(envs, "probe", flaky)
    assert envs.setup("demo", PROBE).ready
    assert not (st.path / "leftover.txt").exists()  # deleted: the folder carried our marker
    assert os.path.islink(st.path / "bin" / "python")

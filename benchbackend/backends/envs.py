"""Isolated per-backend environments: where they live, whether they are ready, how to build one.

A backend whose framework cannot share the main environment (PlaidML 0.7 pins Keras 2.2.4, which
clashes with TensorFlow 2.x) runs its worker from a virtual environment of its own. ``setup``
builds it with the current interpreter's ``venv``, installs the pins from
``configs/<name>-requirements.txt`` plus the worker's own imports, verifies it by running the
worker's device probe inside it, and then completes a marker file. ``is_ready`` and
``package_version`` only read files, so ``list`` and ``--help`` stay fast.

Install steps that a plain ``pip install -r`` cannot express (one package built without build
isolation, say) are declared beside the pins as directive lines, ``#! pip install ARGS``, which
pip reads as comments; they run in file order after the plain lines (:mod:`benchbackend.backends.pins`
reads the pins file).

Ownership: the marker is written the moment the folder is created, as a stub, and completed after
a successful probe. ``setup`` installs into, repairs or deletes only a folder that carries it: a
non-empty folder without it (a user's own venv, anything else) is refused and left intact.

Location: ``$BENCHBACKEND_ENVS/<name>`` when that variable is set, else
``$XDG_DATA_HOME/benchbackend/envs/<name>`` (``~/.local/share/...``). ``setup(path=DIR)`` builds
elsewhere and records DIR in ``<root>/<name>.location``, which ``env_dir`` then follows.

The worker runs with ``PYTHONPATH`` set to a directory holding only the ``benchbackend`` package
(``worker_env``), so the env needs numpy, pyyaml and pydantic but not benchbackend itself.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from ..errors import EnvError
from ..paths import envs_root
from .pins import WORKER_REQUIREMENTS, install_steps, requirement_names, requirements_digest, requirements_file


@dataclass(frozen=True)
class Probe:
    """How to verify an environment: the adapter (``module:Class``) whose device probe must run in
    it, and the environment variables that backend's worker gets. The caller (which knows the
    registry) supplies it, so this module never imports a backend."""

    backend: str
    target: str
    env: Mapping[str, str] = field(default_factory=dict)
MARKER = "benchbackend-env.json"
CREATED_BY = "benchbackend"
_VENV_TIMEOUT_S = 300
_PIP_TIMEOUT_S = 1800
_PROBE_TIMEOUT_S = 180
# Variables that would make the env's Python (and its pip) see the main environment's packages.
_LEAKY_VARS = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PIP_USER", "PIP_TARGET", "PIP_PREFIX")


def _quiet(message: str) -> None:
    pass


# --- where things are ----------------------------------------------------------------------
def _pointer(name: str) -> Path:
    return envs_root() / f"{name}.location"


def env_dir(name: str) -> Path:
    """Where the environment ``name`` lives (a path recorded by ``setup(path=...)`` wins)."""
    pointer = _pointer(name)
    try:
        recorded = pointer.read_text().strip()
    except OSError:
        recorded = ""
    return Path(recorded) if recorded else envs_root() / name


def _python_in(env: Path) -> Path:
    return env / "Scripts" / "python.exe" if os.name == "nt" else env / "bin" / "python"


def python_for(name: str) -> Path:
    """The interpreter of environment ``name`` (``<env>/bin/python``); it may not exist yet."""
    return _python_in(env_dir(name))


def _read_marker(env: Path) -> Optional[dict[str, Any]]:
    try:
        data = json.loads((env / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _marker_problem(name: str, env: Path) -> Optional[str]:
    """Why ``env`` is not a finished build of the current pins, or None when it is."""
    if not _python_in(env).exists():
        return f"no environment at {env}"
    marker = _read_marker(env)
    if marker is None or not marker.get("built"):
        return f"the environment at {env} is incomplete (no successful setup recorded)"
    digest = requirements_digest(name)
    if digest and marker.get("requirements") != digest:
        return f"the environment at {env} was built from other pins than {requirements_file(name)}"
    return None


def is_ready(name: str) -> bool:
    """Whether ``setup`` finished for the current pins and the interpreter is still there (no subprocess)."""
    return _marker_problem(name, env_dir(name)) is None


def _canonical(dist: str) -> str:
    return re.sub(r"[-_.]+", "_", dist).lower()


def _dist_version(env: Path, dist: str) -> Optional[str]:
    want = _canonical(dist)
    for site in [*env.glob("lib/python*/site-packages"), env / "Lib" / "site-packages"]:
        for info in site.glob("*.dist-info"):
            stem, _, dir_version = info.name[: -len(".dist-info")].rpartition("-")
            if _canonical(stem) != want:
                continue
            try:
                with open(info / "METADATA", encoding="utf-8", errors="replace") as f:
                    for line in f:
                        if line.startswith("Version:"):
                            return line.split(":", 1)[1].strip()
                        if not line.strip():
                            break  # end of the headers
            except OSError:
                pass
            return dir_version or None
    return None


def package_version(name: str, dist: str) -> Optional[str]:
    """Installed version of distribution ``dist`` in environment ``name`` (reads its METADATA)."""
    return _dist_version(env_dir(name), dist)


# --- running things in an env ----------------------------------------------------------------
def worker_pythonpath() -> str:
    """A directory that holds ``benchbackend`` and nothing else of the main environment.

    From a source checkout that is the checkout. An installed benchbackend sits in the main
    env's site-packages, next to its numpy and frameworks, which must not shadow the isolated
    env's own; then a folder with a link to the package is used instead.
    """
    pkg = Path(__file__).resolve().parent.parent  # benchbackend/, this module being in backends/
    if pkg.parent.name not in ("site-packages", "dist-packages"):
        return str(pkg.parent)
    link_dir = envs_root() / ".benchbackend-path"
    link = link_dir / "benchbackend"
    try:
        link_dir.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() and Path(os.readlink(link)) != pkg:
            link.unlink()
        if not link.exists():
            link.symlink_to(pkg, target_is_directory=True)
    except OSError as exc:
        raise EnvError(f"cannot expose benchbackend to the isolated env via {link}: {exc}") from None
    return str(link_dir)


def worker_env(base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """Environment variables for ``<env python> -m benchbackend.run.worker``."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in _LEAKY_VARS}
    env["PYTHONPATH"] = worker_pythonpath()
    return env


def probe(name: str, check: Probe, env: Optional[Path] = None, timeout: float = _PROBE_TIMEOUT_S) -> dict[str, Any]:
    """Run the worker's ``--probe`` in environment ``name``: ``{"version", "devices"}``.

    Raises ``EnvError`` with the worker's own error line when the probe fails.
    """
    from ..errors import BackendUnavailable
    from .probe import probe_in

    python = _python_in(env or env_dir(name))
    try:
        return probe_in(str(python), check.target, {**worker_env(), **check.env}, timeout)
    except BackendUnavailable as exc:
        raise EnvError(f"the {name} device probe failed: {exc}") from None


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


# --- status and setup ------------------------------------------------------------------------
@dataclass
class EnvStatus:
    name: str
    path: Path
    python: Path
    ready: bool
    versions: dict[str, str] = field(default_factory=dict)
    devices: list[str] = field(default_factory=list)
    message: str = ""


def status(name: str, check: Probe, path: Optional[Path] = None, verify: bool = True) -> EnvStatus:
    """The state of environment ``name`` (at ``path`` if given); changes nothing.

    With ``verify`` the device probe runs inside the env (about a second); without it the
    devices come from the marker that the last successful setup wrote.
    """
    env = Path(path).expanduser().absolute() if path else env_dir(name)
    st = EnvStatus(name, env, _python_in(env), ready=False)
    problem = _marker_problem(name, env)
    if _python_in(env).exists():
        names = requirement_names(name) if requirements_digest(name) else [check.backend]
        st.versions = {d: v for d in names if (v := _dist_version(env, d))}
    if problem:
        st.message = f"not ready: {problem}; run `benchbackend setup {name}`"
        return st
    st.devices = list((_read_marker(env) or {}).get("devices", []))
    if verify:
        try:
            st.devices = list(probe(name, check, env)["devices"])
        except EnvError as exc:
            st.message = f"broken: {exc}; run `benchbackend setup {name}` to repair it"
            return st
    st.ready = True
    version = st.versions.get(check.backend, "?")
    st.message = f"ready: {check.backend} {version} at {env}; devices: {', '.join(st.devices) or 'none'}"
    return st


def setup(name: str, check: Probe, *, path: Optional[Path] = None, check_only: bool = False,
          log: Callable[[str], None] = _quiet) -> EnvStatus:
    """Build (or reuse, or repair) the isolated environment ``name``; return its status.

    A healthy env is reused without reinstalling. An incomplete or outdated one gets the pins
    installed over it; when the probe still fails, it is rebuilt from scratch once. Only a folder
    that is empty, absent or carries this module's marker is touched: anything else raises
    ``EnvError`` before a file is written. ``check_only`` reports the state and changes nothing.
    Failures raise ``EnvError`` naming the step and the log.
    """
    if check_only:
        return status(name, check, path, verify=True)
    env = Path(path).expanduser().absolute() if path else env_dir(name)
    not_ours = _ownership_problem(name, env)
    if not_ours:
        raise EnvError(not_ours)
    install_steps(requirements_file(name))  # a malformed install step fails before anything changes
    if _marker_problem(name, env) is None:
        st = status(name, check, env, verify=True)
        if st.ready:
            log(f"{name}: reusing the environment at {env}")
            _remember(name, env)
            return st
        log(f"{name}: {st.message}")
    logfile = env.parent / f"{env.name}-setup.log"
    env.parent.mkdir(parents=True, exist_ok=True)
    logfile.write_text(f"# benchbackend setup {name} at {env}, {datetime.datetime.now().isoformat()}\n")
    rebuilt = _prepare(name, env, logfile, log)
    try:
        info = _install_and_probe(name, check, env, logfile, log)
    except EnvError:
        if rebuilt:
            raise
        log(f"{name}: still broken after installing the pins; rebuilding it from scratch")
        _prepare(name, env, logfile, log, fresh=True)
        info = _install_and_probe(name, check, env, logfile, log)
    _write_marker(env, name, requirements=requirements_digest(name), version=info.get("version"),
                  devices=info.get("devices", []), python=_python_version(env),
                  built=datetime.datetime.now().isoformat(timespec="seconds"))
    _remember(name, env)
    st = status(name, check, env, verify=False)
    log(f"{name}: {st.message}")
    return st


def _ownership_problem(name: str, env: Path) -> Optional[str]:
    """Why ``setup`` must not touch ``env`` (one line), or None: absent, empty, or ours for ``name``.

    Ours means our marker: the stub written at creation (``created_by``) or a finished build
    (markers from before the stub existed carry ``built``).
    """
    try:
        if not env.exists() or (env.is_dir() and not any(env.iterdir())):
            return None
    except OSError as exc:
        return f"cannot read {env}: {exc}"
    marker = _read_marker(env)
    if marker is None or not (marker.get("created_by") == CREATED_BY or marker.get("built")):
        return (f"{env} is not empty and was not created by benchbackend (it has no {MARKER}); it is left "
                f"as it is: move it away or choose another place with `benchbackend setup {name} --path DIR`")
    if marker.get("name", name) != name:
        return (f"{env} holds benchbackend's {marker.get('name')} environment, not {name}; choose another "
                f"place with `benchbackend setup {name} --path DIR`")
    return None


def _write_marker(env: Path, name: str, **fields: Any) -> None:
    """Write the marker: a stub (``created_by`` + ``name``) at creation, completed by ``fields`` later."""
    marker = {"created_by": CREATED_BY, "name": name, **fields}
    (env / MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _prepare(name: str, env: Path, logfile: Path, log: Callable[[str], None], fresh: bool = False) -> bool:
    """Make ``env`` (absent, empty or ours) a working venv with a stub marker; True when (re)created."""
    if not fresh and _python_in(env).exists() and _python_runs(env):
        log(f"{name}: repairing the environment at {env}")
        _write_marker(env, name)  # back to a stub: not ready until the probe passes again
        return False
    if env.exists() and any(env.iterdir()):
        problem = _ownership_problem(name, env)
        if problem:  # checked by setup already; never delete what is not ours
            raise EnvError(problem)
        shutil.rmtree(env)
    log(f"{name}: creating a virtual environment at {env} (Python {sys.version.split()[0]})")
    # The stub goes in before `venv` runs, so that an interrupted setup leaves a folder that the
    # next setup recognizes as its own and repairs.
    env.mkdir(parents=True, exist_ok=True)
    _write_marker(env, name)
    _run([sys.executable, "-m", "venv", str(env)], logfile, f"creating the {name} virtual environment",
         _VENV_TIMEOUT_S)
    return True


def _install_and_probe(name: str, check: Probe, env: Path, logfile: Path, log: Callable[[str], None]) -> dict[str, Any]:
    req = requirements_file(name)
    log(f"{name}: installing {req} and the worker's imports (pip log: {logfile})")
    pip = [str(_python_in(env)), "-m", "pip", "install", "--no-input"]
    _run([*pip, "-r", str(req), *WORKER_REQUIREMENTS], logfile, f"pip install into the {name} environment",
         _PIP_TIMEOUT_S)
    for args in install_steps(req):
        log(f"{name}: pip install {shlex.join(args)}")
        _run([*pip, *args], logfile, f"pip install {shlex.join(args)} (an install step of {req.name}) into the "
             f"{name} environment", _PIP_TIMEOUT_S)
    log(f"{name}: verifying: listing the devices {check.backend} sees")
    try:
        info = probe(name, check, env)
    except EnvError as exc:
        with open(logfile, "a") as f:
            f.write(f"\n# probe\n{exc}\n")
        raise EnvError(f"{exc} (setup log: {logfile})") from None
    return info


def _run(cmd: list[str], logfile: Path, step: str, timeout: float) -> None:
    env = {k: v for k, v in os.environ.items() if k not in _LEAKY_VARS}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    with open(logfile, "a") as f:
        f.write(f"\n# {step}: {' '.join(cmd)}\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            raise EnvError(f"{step} ran past {timeout:.0f} s; see the end of {logfile}") from None
        except OSError as exc:
            raise EnvError(f"{step} could not start: {exc}") from None
    if rc != 0:
        tail = _last_line(logfile.read_text(errors="replace"))
        raise EnvError(f"{step} failed (exit {rc}): {tail}; see the end of {logfile}")


def _python_runs(env: Path) -> bool:
    try:
        return subprocess.run([str(_python_in(env)), "-c", "import sys"], capture_output=True,
                              timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _python_version(env: Path) -> str:
    cfg = env / "pyvenv.cfg"
    try:
        for line in cfg.read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() in ("version", "version_info"):
                return value.strip()
    except OSError:
        pass
    return ""


def _remember(name: str, env: Path) -> None:
    """Record a non-default location so that ``env_dir`` (the runner, ``list``) finds it."""
    pointer = _pointer(name)
    default = envs_root() / name
    try:
        if env.absolute() == default.absolute():
            pointer.unlink(missing_ok=True)
        else:
            pointer.parent.mkdir(parents=True, exist_ok=True)
            pointer.write_text(str(env.absolute()) + "\n")
    except OSError as exc:
        raise EnvError(f"cannot record the location of the {name} environment in {pointer}: {exc}") from None

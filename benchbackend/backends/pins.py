"""The pins of an isolated environment: ``configs/<name>-requirements.txt``.

Plain lines are pip requirements. Install steps that a plain ``pip install -r`` cannot express
(one package built without build isolation, say) are directive lines, ``#! pip install ARGS``,
which pip reads as comments; ``install_steps`` returns them in file order, and only
``pip install`` is allowed after ``#!``. ``envs`` builds from these and records their digest.
"""
from __future__ import annotations

import hashlib
import re
import shlex
from pathlib import Path
from typing import Optional

from ..errors import EnvError
from ..paths import configs_dirs

#: What ``benchbackend.run.worker`` itself imports (keep in step with pyproject's dependencies).
WORKER_REQUIREMENTS: tuple[str, ...] = ("numpy>=1.23", "pyyaml>=6", "pydantic>=2.5")
DIRECTIVE = "#!"


def requirements_file(name: str) -> Path:
    """``configs/<name>-requirements.txt``, from the first folder of ``paths.configs_dirs`` that has it."""
    tried = [d / f"{name}-requirements.txt" for d in configs_dirs()]
    for path in tried:
        if path.is_file():
            return path
    raise EnvError(f"cannot find the pins for the {name} environment; looked for "
                   f"{', '.join(str(p) for p in tried)}")


def requirements_digest(name: str) -> Optional[str]:
    """What an environment built from these pins records (its marker), to tell when they changed."""
    try:
        text = requirements_file(name).read_text()
    except (EnvError, OSError):
        return None  # no pins to compare with (an installed package without configs/)
    blob = text + "\n".join(WORKER_REQUIREMENTS)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# pip install options that take a value, so that the value is not read as a package.
_VALUE_OPTIONS = frozenset({"-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-c", "--constraint",
                            "-r", "--requirement", "-C", "--config-settings", "--global-option", "--platform",
                            "--python-version", "--implementation", "--abi", "--only-binary", "--no-binary"})


def install_steps(path: Path) -> list[list[str]]:
    """The ``pip install`` arguments of each ``#! pip install ...`` line of a pins file, in order.

    Only ``pip install`` is allowed, so a pins file cannot run arbitrary commands; anything else
    after ``#!`` is an ``EnvError`` naming the file and the line.
    """
    steps: list[list[str]] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.startswith(DIRECTIVE):
            continue
        try:
            words = shlex.split(line[len(DIRECTIVE):])
        except ValueError as exc:
            raise EnvError(f"{path}:{number}: cannot parse the install step ({exc})") from None
        if words[:2] != ["pip", "install"] or len(words) < 3:
            raise EnvError(f"{path}:{number}: an install step must read '#! pip install ARGS'; got {line.strip()!r}")
        steps.append(words[2:])
    return steps


def _step_packages(args: list[str]) -> list[str]:
    packages, skip = [], False
    for word in args:
        if skip:
            skip = False
        elif word.startswith("-"):
            skip = word in _VALUE_OPTIONS
        else:
            packages.append(word)
    return packages


def requirement_names(name: str) -> list[str]:
    """The distributions an environment built from these pins holds: its pins, the worker's own
    requirements and the packages of its install steps."""
    req = requirements_file(name)
    lines = req.read_text().splitlines() + list(WORKER_REQUIREMENTS)
    lines += [pkg for step in install_steps(req) for pkg in _step_packages(step)]
    names = [re.split(r"[<>=!~;@\[\s]", ln.strip(), maxsplit=1)[0] for ln in lines]
    return list(dict.fromkeys(n for n in names if n and not n.startswith(("#", "-"))))


# --- cheap state: files only -----------------------------------------------------------------

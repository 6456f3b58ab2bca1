"""Where things live: shipped configs and workloads, isolated environments. One place for all paths.

Nothing here touches the file system beyond reading environment variables and ``Path`` arithmetic.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

#: The folder that holds the ``benchbackend`` package (a checkout's root, or site-packages).
PACKAGE_PARENT = Path(__file__).resolve().parent.parent


def _share() -> Path:
    return Path(sys.prefix) / "share" / "benchbackend"  # a non-editable install puts data here


def configs_dirs() -> list[Path]:
    """Where ``configs/`` is looked up: next to the package (a checkout), the working dir, an install."""
    return [PACKAGE_PARENT / "configs", Path.cwd() / "configs", _share() / "configs"]


def workload_dirs() -> list[Path]:
    """Where named workloads are looked up, in order ($BENCHBACKEND_WORKLOADS first)."""
    dirs = []
    env = os.environ.get("BENCHBACKEND_WORKLOADS")
    if env:
        dirs.append(Path(env))
    dirs += [Path.cwd() / "workloads", PACKAGE_PARENT / "workloads", _share() / "workloads"]
    seen, out = set(), []
    for d in dirs:
        key = str(d.resolve()) if d.exists() else str(d)
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def envs_root() -> Path:
    """The folder holding the isolated environments (and ``<name>.location`` pointers)."""
    env = os.environ.get("BENCHBACKEND_ENVS")
    if env:
        return Path(env).expanduser()
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data).expanduser() / "benchbackend" / "envs"


def compile_cache_dir() -> Path:
    """Where frameworks keep compiled programs between runs (torch inductor's cache, JAX's compilation
    cache, TVM's tuning databases): $BENCHBACKEND_COMPILE_CACHE, which the worker points at an empty
    folder for a ``--compile-cache cold`` cell, else ``cache_dir() / "compile"``."""
    env = os.environ.get("BENCHBACKEND_COMPILE_CACHE")
    return Path(env).expanduser() if env else cache_dir() / "compile"


def cache_dir() -> Path:
    """Per-user cache (tuning databases, peak-FLOPs probes): $BENCHBACKEND_CACHE or ~/.cache/benchbackend."""
    env = os.environ.get("BENCHBACKEND_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "benchbackend"

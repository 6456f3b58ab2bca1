"""Ask a backend's own interpreter what it sees (its version and devices) without importing it here.

``list`` and ``setup`` use it; the worker answers ``python -m benchbackend.run.worker --probe module:Class``.
"""
from __future__ import annotations

import json
import subprocess
from typing import Any, Mapping

from ..errors import BackendUnavailable


def worker_command(python: str) -> list[str]:
    return [python, "-m", "benchbackend.run.worker"]


def probe_in(python: str, backend: str, env: Mapping[str, str], timeout: float) -> dict[str, Any]:
    """Run ``python -m benchbackend.run.worker --probe BACKEND``: ``{"version", "devices"}``.

    Raises ``BackendUnavailable`` with one line saying why (the worker's own error, the last
    stderr line, or the exit status) when the probe cannot run or fails.
    """
    try:
        proc = subprocess.run([*worker_command(python), "--probe", backend], env=dict(env),
                              capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BackendUnavailable(f"could not run: {str(exc).splitlines()[0]}") from None
    error = ""
    for line in proc.stdout.splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if proc.returncode == 0 and isinstance(msg, dict) and "devices" in msg:
            return msg
        error = (msg.get("message", "") if isinstance(msg, dict) else "") or error
    stderr = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    raise BackendUnavailable(error or (stderr[-1].strip() if stderr else f"exit status {proc.returncode}"))

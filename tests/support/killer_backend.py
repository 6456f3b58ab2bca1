"""A backend registered only by the Ray tests: the NumPy reference whose worker, once, kills the
Ray worker running its task (its parent, or the preloader's parent) in its second epoch, as a lost
node would.

``KILLER_MARK`` names a file: the first worker to reach its second epoch creates it (atomically:
workers on two nodes may race), writes the Ray worker's PID into it, and kills; every later worker
finds it and trains normally. Beside it, ``<mark>.nice`` holds that worker's niceness.
``KILLER_GRACE`` seconds pass before the kill so that the first epoch's row has reached the driver
(a real fault strikes long after it), or so that a test can remove the node meanwhile.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchbackend.backends.numpy.reference import NumpyBackend


class KillerNumpyBackend(NumpyBackend):
    name = "killer"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.epochs = 0

    def train_epoch(self, order: np.ndarray) -> tuple[Any, Any]:
        self.epochs += 1
        mark = Path(os.environ["KILLER_MARK"])
        if self.epochs == 2 and self._first(mark):
            time.sleep(float(os.environ.get("KILLER_GRACE", "2")))
            os.kill(ray_worker(), signal.SIGKILL)
            os._exit(1)
        return super().train_epoch(order)

    @staticmethod
    def _first(mark: Path) -> bool:
        try:
            fd = os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        mark.with_suffix(".nice").write_text(str(os.getpriority(os.PRIO_PROCESS, 0)))  # before the PID: read after it
        os.write(fd, str(ray_worker()).encode())
        os.close(fd)
        return True


def ray_worker() -> int:
    """The PID of the Ray worker this worker runs under: its nearest ancestor that is one."""
    import psutil

    proc = psutil.Process().parent()
    while proc is not None and not _is_ray_worker(proc):
        proc = proc.parent()
    if proc is None:
        raise RuntimeError("not running under a Ray worker")
    return proc.pid


def _is_ray_worker(proc) -> bool:
    try:
        return proc.name().startswith("ray::") or "default_worker.py" in " ".join(proc.cmdline())
    except Exception:  # noqa: BLE001 - gone or not ours to read
        return False

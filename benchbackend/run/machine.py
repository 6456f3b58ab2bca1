"""What else the machine does while a cell is timed: other processes' CPU, the load, the clocks.

A verdict compares timings taken on a machine that was the run's own. Another job on the same
cores does not slow every framework alike (torch's OpenMP threads spin-wait for cores another
process holds, TensorFlow's pool yields; issue "Verdicts that survive a busy machine" saw torch's
epoch 27x slower and TensorFlow's 1.4x under one load), and interleaved repeats cannot cancel a
load that lasts the whole run. So the worker reads, around every timed region and outside its
clock, the CPU time that processes other than this run's own used:

- the machine's busy CPU time (``/proc/stat``: every state but idle and iowait), less
- the CPU time of this run's processes: the driver (``DRIVER_ENV``, set in the worker's
  environment) and everything below it (preloaders, workers, a cell's replica processes), each
  counted with the children it has reaped, so a subprocess that ended inside the window counts
  as the run's own.

``foreign_cpu_share`` is the share of the cell's cores that other processes held: the other
processes' cores (their CPU seconds over the region's wall seconds) beyond those the cell leaves
free, over the cell's cores (its threads x replicas, at most the machine's). 0 is a quiet
machine; 1 means other processes held every core the cell ran on. Above ``BUSY_SHARE`` the cell
is *busy*: the run notes it and ``compare`` withholds the verdicts it would feed (README "Trust").

Linux exposes these readings; elsewhere each is None (not measured), never a guess. Nothing here
imports a framework; the GPU's readings (other processes on the device, its clocks) come from
NVML where ``pynvml`` is installed.
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..analysis.busy import BUSY_SHARE

#: The driver's pid, in every worker's environment: the root of this run's own processes.
DRIVER_ENV = "BENCHBACKEND_DRIVER_PID"
#: ``run`` warns before it starts when other processes hold more than this share of the cores.
BUSY_BEFORE = 0.25
#: The columns of a cell's start (the ``info`` message) and of each timed region (its row).
CELL_COLUMNS = ("load_avg", "cpu_mhz", "gpu_other_procs", "gpu_clock_mhz", "cpu_bf16")
#: The ``/proc/cpuinfo`` flags of bf16 arithmetic: AVX-512 BF16, AMX's bf16 tiles, Arm's BF16 (``Features``).
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
REGION_COLUMNS = ("foreign_cpu_share", "throttle_events")
_PROC = Path("/proc")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Process:
    """One process as ``/proc/PID/stat`` says it: its parent, name and CPU ticks."""

    pid: int
    ppid: int
    name: str
    #: user + system ticks of the process itself
    own: int
    #: ``own`` plus the ticks of the children it has reaped (``cutime + cstime``)
    total: int


@dataclass(frozen=True)
class Snapshot:
    """The machine's busy ticks and this run's processes' ticks at one moment."""

    wall: float
    busy: int
    ours: dict[int, int]


def _read_stat(pid: str) -> Optional[Process]:
    try:
        text = (_PROC / pid / "stat").read_text()
    except OSError:  # gone since the directory was listed
        return None
    # "pid (name) state ppid ...": the name may hold spaces and parentheses, so split after the last ")"
    head, _, rest = text.rpartition(")")
    fields = rest.split()
    if len(fields) < 15:
        return None
    utime, stime, cutime, cstime = (int(v) for v in fields[11:15])
    return Process(int(pid), int(fields[1]), head.partition("(")[2], utime + stime, utime + stime + cutime + cstime)


def processes() -> dict[int, Process]:
    """Every process the machine shows, by pid (empty where there is no ``/proc``)."""
    try:
        pids = [p for p in os.listdir(_PROC) if p.isdigit()]
    except OSError:
        return {}
    found = (_read_stat(p) for p in pids)
    return {p.pid: p for p in found if p is not None}


def busy_ticks() -> Optional[int]:
    """The machine's CPU ticks in every state but idle and iowait, since boot (None: not Linux)."""
    try:
        with open(_PROC / "stat") as fh:
            fields = fh.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return sum(values) - values[3] - values[4]


def own_roots() -> set[int]:
    """The roots of this run's processes: this process, and the driver that started it."""
    roots = {os.getpid()}
    with contextlib.suppress(ValueError):
        roots.add(int(os.environ.get(DRIVER_ENV, "")))
    return roots


def tree(table: dict[int, Process], roots: set[int]) -> set[int]:
    """``roots`` and every process below them."""
    children: dict[int, list[int]] = {}
    for p in table.values():
        children.setdefault(p.ppid, []).append(p.pid)
    out, todo = set(), [r for r in roots if r in table]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo.extend(children.get(pid, []))
    return out


def snapshot(roots: Optional[set[int]] = None) -> Optional[Snapshot]:
    """The machine's busy ticks and this run's processes' ticks now (None where not measurable)."""
    busy = busy_ticks()
    if busy is None:
        return None
    table = processes()
    mine = tree(table, own_roots() if roots is None else roots)
    return Snapshot(time.perf_counter(), busy, {pid: table[pid].total for pid in mine})


def foreign_cores(start: Optional[Snapshot], end: Optional[Snapshot]) -> Optional[float]:
    """How many cores other processes kept busy, on average, between two snapshots."""
    if start is None or end is None or end.wall <= start.wall:
        return None
    # A process of ours that ended between the two is in its parent's reaped ticks at ``end``, and
    # its ticks at ``start`` are subtracted here: what remains is what it used inside the window.
    ours = sum(end.ours.values()) - sum(start.ours.values())
    other = max(0, (end.busy - start.busy) - ours) / _TICK
    return other / (end.wall - start.wall)


def foreign_share(start: Optional[Snapshot], end: Optional[Snapshot], cell_cores: Optional[float],
                  cores: Optional[int] = None) -> Optional[float]:
    """The share of a cell's ``cell_cores`` that other processes held between two snapshots (module
    docstring): their cores beyond the ones the cell leaves free, over the cell's; 0 to 1."""
    used = foreign_cores(start, end)
    machine = cores or os.cpu_count() or 1
    if used is None:
        return None
    mine = min(float(cell_cores or machine), machine)
    return min(1.0, max(0.0, used - (machine - mine)) / mine)


@dataclass(frozen=True)
class Busy:
    """Other processes' use of the machine over a short look: their cores, and the busiest of them."""

    cores: float
    machine: int
    load_avg: Optional[float]
    top: list[tuple[str, int, float]]

    @property
    def share(self) -> float:
        return min(1.0, self.cores / self.machine)

    def text(self) -> str:
        """``other processes held 1.9 of 2 cores (load average 2.31): python3 (pid 811) 98%, ...``."""
        load = f" (load average {self.load_avg:.2f})" if self.load_avg is not None else ""
        top = ", ".join(f"{name} (pid {pid}) {share:.0%}" for name, pid, share in self.top)
        return f"other processes held {self.cores:.1f} of {self.machine} cores{load}" + (f": {top}" if top else "")


def load_avg() -> Optional[float]:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def look(seconds: float = 0.3, roots: Optional[set[int]] = None, top: int = 3) -> Optional[Busy]:
    """What other processes do now: a look of ``seconds`` at the machine (None where not measurable)."""
    roots = own_roots() if roots is None else roots
    before, start = processes(), snapshot(roots)
    time.sleep(seconds)
    after, end = processes(), snapshot(roots)
    cores = foreign_cores(start, end)
    if cores is None or end is None or start is None:
        return None
    mine = tree(after, roots) | tree(before, roots)
    wall = end.wall - start.wall
    used = [(p.name, pid, (p.own - before[pid].own) / _TICK / wall) for pid, p in after.items()
            if pid in before and pid not in mine and p.own > before[pid].own]
    used.sort(key=lambda item: -item[2])
    return Busy(cores, os.cpu_count() or 1, load_avg(), used[:top])


def cpu_mhz() -> Optional[float]:
    """The cores' mean current clock in MHz (cpufreq where the OS exposes it, else ``/proc/cpuinfo``)."""
    freqs = []
    for f in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cpufreq/scaling_cur_freq"):
        with contextlib.suppress(OSError, ValueError):
            freqs.append(int(f.read_text()) / 1000)
    if not freqs:
        with contextlib.suppress(OSError), open(_PROC / "cpuinfo") as fh:
            freqs = [float(line.split(":")[1]) for line in fh if line.startswith("cpu MHz")]
    return sum(freqs) / len(freqs) if freqs else None


def throttle_count() -> Optional[int]:
    """Thermal throttling events of every core since boot (None where the OS does not count them)."""
    counts = []
    for f in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/thermal_throttle/core_throttle_count"):
        with contextlib.suppress(OSError, ValueError):
            counts.append(int(f.read_text()))
    return sum(counts) if counts else None


def gpu_readings(index: int = 0) -> dict[str, Optional[float]]:
    """Other processes on GPU ``index`` and its SM clock, from NVML (None where ``pynvml`` or the GPU is absent)."""
    out: dict[str, Optional[float]] = {"gpu_other_procs": None, "gpu_clock_mhz": None}
    try:
        import pynvml  # nvidia-ml-py: not a dependency; present on most GPU machines

        pynvml.nvmlInit()
    except Exception:  # no NVML library, no driver, no GPU: not measured
        return out
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        own = tree(processes(), own_roots())
        out["gpu_other_procs"] = float(sum(1 for p in procs if p.pid not in own))
        out["gpu_clock_mhz"] = float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))
    except Exception:  # a reading NVML refuses is not measured
        pass
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return out


def cpu_flags() -> Optional[frozenset[str]]:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``) from ``/proc/cpuinfo``; None where unreadable."""
    with contextlib.suppress(OSError), open(_PROC / "cpuinfo") as fh:
        for line in fh:
            name, _, value = line.partition(":")
            if name.strip() in ("flags", "Features"):
                return frozenset(value.split())
    return None


def native_bf16() -> Optional[bool]:
    """Whether the CPU has bf16 arithmetic (``BF16_FLAGS``); False: a framework's bf16 is emulated
    there (converted to fp32 and back), often several times slower than fp32. None where unknown."""
    flags = cpu_flags()
    return None if flags is None else bool(flags & BF16_FLAGS)


def cell_readings(device: str) -> dict[str, Optional[float]]:
    """What the machine is like as a cell starts: load average, clock, throttling, the GPU's state,
    and on a CPU cell whether the CPU has bf16 instructions (``cpu_bf16``)."""
    out: dict[str, Optional[float]] = {"load_avg": load_avg(), "cpu_mhz": cpu_mhz()}
    if device == "cpu":
        out["cpu_bf16"] = native_bf16()
    if device.startswith(("gpu", "cuda")):
        index = device.partition(":")[2]
        out.update(gpu_readings(int(index) if index.isdigit() else 0))
    return out


def busy_warning(seconds: float = 0.2) -> str:
    """What ``run`` says before it starts when other processes hold more than ``BUSY_BEFORE`` of the
    cores now ("" otherwise), naming the busiest of them."""
    seen = look(seconds)
    if seen is None or seen.share <= BUSY_BEFORE:
        return ""
    return (f"the machine is busy: {seen.text()}. Timings taken beside them are spoiled, and unequally so "
            f"between frameworks; compare gives no verdict on a cell whose timed work saw other processes "
            f"hold over {BUSY_SHARE:.0%} of its cores")

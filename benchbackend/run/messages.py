"""The typed messages an executor hands the runner, one cell at a time.

An executor (``executors/local.py``, ``executors/ray.py``) is an iterator of these; the runner
consumes them and knows nothing of processes, nodes or JSON. Per cell the order is ``Started``,
then any number of ``Info``, ``Peak``, ``Row`` and ``Heartbeat``, then one ``Ended``. A cell that
never starts (nothing can run it) is ``Started`` and ``Ended`` with an ``unavailable`` outcome.
A cell whose first attempt ended ``retried`` starts again: ``Started`` ... ``Ended`` once more.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional, Union

if TYPE_CHECKING:
    from .plan import Cell


@dataclass(frozen=True)
class Outcome:
    """How a worker ended. ``status`` is ``done``, ``unavailable``, ``timeout``, ``crashed``,
    ``interrupted`` or ``retried`` (its node was lost and the executor runs the cell again: another
    ``Started`` follows); ``message`` says why when it is not ``done``."""

    status: str
    message: str = ""
    returncode: Optional[int] = None


@dataclass(frozen=True)
class Started:
    """A cell's worker is starting; ``environment`` is the host, os and cpu of the machine it runs on."""

    cell: "Cell"
    environment: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Info:
    """What the worker found: the framework's version, the device it really uses, its threads."""

    cell: "Cell"
    backend_version: str
    device: str
    gpu: str
    python: str
    threads: Optional[int]
    environment: Mapping[str, str]
    math_mode: str = ""  # what the cell set for its float32 math (``backends/precision.py``)
    #: The data placement rule the cell followed (``Backend.place_data``): its arrays on the device
    #: before the clock (True) or each batch copied inside it (False); None from an older worker.
    data_on_device: Optional[bool] = None
    #: The machine as the cell started (``machine.cell_readings``): load average, CPU clock, the GPU's
    #: other processes and clock; each None where not measured.
    machine: Mapping[str, Optional[float]] = field(default_factory=dict)
    #: ``--compile-cache`` where the cell's framework keeps compiled programs ("" where it keeps none),
    #: and whether its folder held some as the cell started (None: no such cache).
    compile_cache: str = ""
    compile_cache_hit: Optional[bool] = None

    def columns(self) -> dict[str, Any]:
        """The CSV columns this fills on every later row of the cell."""
        return {"backend_version": self.backend_version, "device": self.device, "gpu": self.gpu,
                "python": self.python, "threads": self.threads, "math_mode": self.math_mode,
                "data_on_device": self.data_on_device, "compile_cache": self.compile_cache,
                "compile_cache_hit": self.compile_cache_hit, **self.machine, **self.environment}


@dataclass(frozen=True)
class Peak:
    """The peak FLOP/s MFU is measured against, where it came from, and its cache key ("" if none)."""

    cell: "Cell"
    flops: float
    source: str
    cache_key: str = ""


@dataclass(frozen=True)
class Row:
    """One measurement (phase build, tune, parity, train_epoch or inference): CSV columns and values."""

    cell: "Cell"
    fields: Mapping[str, Any]


@dataclass(frozen=True)
class Heartbeat:
    """The worker has been silent for a while; it is still running."""

    cell: "Cell"
    seconds: float


@dataclass(frozen=True)
class Ended:
    """The cell's worker has ended."""

    cell: "Cell"
    outcome: Outcome


Message = Union[Started, Info, Peak, Row, Heartbeat, Ended]


#: A message without its cell, for the wire (Ray): (cell order, message class name, fields).
Encoded = tuple[int, str, dict[str, Any]]
_KINDS = {cls.__name__: cls for cls in (Started, Info, Peak, Row, Heartbeat, Ended)}


def encode(message: Message) -> Encoded:
    """``message`` as a small picklable tuple: its cell stays behind, named by its order."""
    fields = {f: getattr(message, f) for f in message.__dataclass_fields__ if f != "cell"}
    return message.cell.order, type(message).__name__, fields


def decode(encoded: Encoded, cells: Mapping[int, "Cell"]) -> Message:
    """The message ``encode`` made, with its cell found again by order in ``cells``."""
    order, kind, fields = encoded
    return _KINDS[kind](cell=cells[order], **fields)

"""The Backend contract. Every adapter (``backends/<name>.py``) implements it for one framework.

What a backend *is* (its name, whether it trains, its modes with a one-line description each,
its precisions, its devices, how to install it) is declared in its registry entry
(:class:`benchbackend.backends.BackendSpec`), so that ``--help``, ``list`` and the CLI's checks
know it without importing the framework. What a backend *does* is this class.

The worker (``benchbackend.run.worker``) drives an adapter through one repeat of one cell
(workload x backend x mode x precision):

1. ``__init__(workload, device, mode, precision, options)``: resolve the device or raise
   ``BackendUnavailable``; ``mode`` and ``precision`` have been validated against the spec.
2. ``build(weights)``: build the network from ``workload.model`` and load the shared initial
   weights (canonical layout, see ``benchbackend.spec.model``), converting as the framework needs.
   Returns the parameter count. Compilation that does not depend on data belongs here (timed as
   the ``build`` row).
3. ``tune()``: optional schedule search etc. (the ``tune`` row), for modes that need it.
4. ``set_data(x_train, y_train)``: keep the training arrays where the framework's fast path
   wants them. Only called when the backend trains.
5. ``to_device(x)``: an input array (float32 NHWC in [0, 1]) as the framework wants it for
   ``scores`` (a tensor on the device, say). Called once per split, before any timed epoch or
   pass (the validation and test splits in the ``build`` row's region, see below).

   The data placement rule (one for every backend): before ``build``, the worker calls
   ``place_data(nbytes)`` with the size of the arrays the cell will hold (training, validation and
   test); it decides :attr:`data_on_device`. When True, ``set_data`` and ``to_device`` put the
   arrays on the device and ``train_epoch``/``scores`` read them there (gathers and slices on the
   device); when False (they do not fit, or the backend cannot hold them), ``set_data`` and
   ``to_device`` keep host arrays and each batch is copied to the device inside the clock. The
   worker calls ``set_data`` and ``to_device`` of the validation and test splits inside the
   ``build`` row's timed region, so the one-off copy is timed apart from the epochs and passes.
6. ``scores(x, batch_size)``: class probabilities for a ``to_device`` array, in batches of
   ``batch_size``, dropout off. It may return a lazy/asynchronous value.
7. ``train_epoch(order)``: one epoch over the training arrays in exactly the given sample order,
   with the workload's batch size, optimizer and loss. Returns ``(mean loss, accuracy)``, which
   may be lazy values (device scalars).
   ``step_losses()`` (optional) then returns the loss of each of its steps, for the loss audit
   (``benchbackend.run.loss_audit``): the values the epoch already computed, kept without a host
   sync inside the clock (a list of device scalars, stacked only when the worker asks, outside it).
8. ``to_host(value)``: a NumPy array or Python float for a value ``scores``/``train_epoch``
   returned. ``sync()``: wait until the device is idle (a real call into the framework wherever
   the framework can have work in flight, copies included).
9. ``train_steps(batches)``: optional; losses of the first K steps with dropout off, for the
   trajectory check (``--parity-steps``). ``train_scores(x)``: probabilities of a training-mode
   forward pass (batchnorm on batch statistics, dropout off, nothing updated), for the
   training-mode parity of networks with batchnorm.
10. ``peak_device_mb()``: the peak device memory of the cell from the framework's own counter
   (None on a CPU and where the framework has none), read for every row that carries
   ``peak_rss_mb``; ``reset_device_peak()`` restarts the counter where the framework allows, so
   that the peak is the cell's own (the worker calls it before ``build`` and after the GEMM probe).

The worker ends every timed region itself: adapter call, ``to_host`` on what it returned,
``sync()``, then the clock (see :func:`benchbackend.run.timing.timed_region`). An adapter cannot
forget the sync because it is not the adapter's to do. Forward parity, validation and the timed
inference passes are all derived from ``scores`` in one place (``benchbackend.run.worker``).

Adapters import their framework at module top: only the worker imports an adapter, after the
backend's environment variables (``BackendSpec.env``) are in its process environment.

Over 400 lines: the contract is one class, each method documented where an adapter reads it, beside
the helpers every adapter shares (``batches``, ``accuracy``, ``cross_entropy``, the GEMM probe).
"""
from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence

import numpy as np

from ..spec.workload import Workload
from .spec import gpu_index

__all__ = ["Backend", "CupyMemory", "accuracy", "batches", "cross_entropy", "gemm_rate", "gpu_index"]


@dataclass(frozen=True)
class Options:
    """The run's options for one cell, as the adapter reads them (``Backend.options``): threads, the
    steps a dispatch runs (``jax:scan``), the tuning budget (``tvm:tuned``), the peak, the replicas'
    engine settings. The runner makes one per cell (``run.plan``); a typed record, never a dict."""

    threads: Optional[int] = None
    steps_per_execution: int = 32
    tune_trials: int = 64
    peak_tflops: Optional[float] = None
    #: The cell's data-parallel replicas (set per cell by the runner) and ``--scale-lr`` (``replicas``).
    replicas: int = 1
    scale_lr: str = "none"
    #: ``--scaling``: strong (the global batch fixed, split over the replicas) or weak (the
    #: per-replica batch fixed: the global batch is N times the workload's) (``replicas``).
    scaling: str = "strong"
    #: This replica's rank and the address of a process group made outside the worker (Ray Train's
    #: workers, one per replica, each running the whole cell: ``executors/ray_train.py``); "" when
    #: the cell's worker starts the other replicas itself.
    rank: int = 0
    rendezvous: str = ""
    loadgen_dir: str = ""  # --scenario: LoadGen's logs beside the CSV ("": a temporary folder)
    #: ``--compile-cache``: ``warm`` keeps compiled programs in ``paths.compile_cache_dir()`` across
    #: runs; ``cold`` gives the cell an empty one (``Backend.compile_cache``).
    compile_cache: str = "warm"


def as_options(options: "Options | Mapping[str, Any] | None") -> Options:
    """``options`` as the record (a plug-in or a test may still hand a mapping of its fields)."""
    return options if isinstance(options, Options) else Options(**dict(options or {}))


class Backend(ABC):
    #: Registry name, e.g. "torch".
    name: ClassVar[str] = ""

    def __init__(self, workload: Workload, device: str, mode: str, precision: str = "fp32",
                 options: "Options | Mapping[str, Any] | None" = None):
        self.workload = workload
        self.requested_device = device
        self.mode = mode
        self.precision = precision
        #: Run options that some modes use (``steps_per_execution``, ``tune_trials``, ``threads``, ...).
        self.options: Options = as_options(options)

    # --- identity -------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def probe(cls) -> dict:
        """``{"version": str, "devices": [str, ...]}`` as this framework sees them (for ``list``)."""

    @abstractmethod
    def version(self) -> str:
        """Framework version string for ``backend_version``."""

    @abstractmethod
    def device_id(self) -> str:
        """The device actually used, as written to the ``device`` column (e.g. "cpu", "cuda:0")."""

    def gpu_name(self) -> str:
        """Human name of the GPU in use, or "" on CPU."""
        return ""

    #: What this cell set for its float32 matmuls and convolutions (``backends/precision.py``):
    #: ``ieee`` or ``tf32``, assigned by an adapter that follows the rule; "" for one that does not.
    math: str = ""

    def math_mode(self) -> str:
        """The math mode of this cell's float32 matmuls and convolutions (:attr:`math`)."""
        return self.math

    def compile_cache(self) -> Optional[Path]:
        """Point the framework's persistent cache of compiled programs at this cell's folder under
        ``paths.compile_cache_dir()`` and return that folder; None (the default) where the mode
        compiles nothing a later run could reuse. The worker calls it before ``build``: the folder
        empty then is a ``cold`` cell, else ``warm`` (the ``compile_cache`` column)."""
        return None

    def cache_folder(self, framework: str) -> Path:
        """``framework``'s folder for this cell's compiled programs: one per workload definition, mode
        and precision, so that ``warm`` means this very cell compiled before."""
        from ..paths import compile_cache_dir

        return compile_cache_dir() / framework / f"{self.workload.hash()}-{self.mode}-{self.precision}"

    def details(self) -> dict[str, Any]:
        """Extra facts for the ``notes`` of the build row (a compile target, the precision
        actually used by a runtime, ...). Values are short strings."""
        return {}

    # --- lifecycle ------------------------------------------------------------------------
    @abstractmethod
    def build(self, weights: Sequence[np.ndarray]) -> int:
        """Build the model, load ``weights`` (canonical layout); return its parameter count."""

    def tune(self) -> Optional[str]:
        """Search schedules (or similar) for the current mode; return a one-line summary, or None
        when this mode has nothing to tune. Timed as the ``tune`` row."""
        return None

    def set_data(self, x_train: np.ndarray, y_train: np.ndarray) -> None:
        """Keep the training arrays (float32 NHWC, int64 labels) for ``train_epoch``."""
        raise NotImplementedError(f"{self.name} does not train")

    def to_device(self, x: np.ndarray) -> Any:
        """``x`` (float32 NHWC) where ``scores`` wants it. Default: the host array itself."""
        return x

    def take(self, x: Any, indices: np.ndarray) -> Any:
        """Samples ``indices`` of ``x`` (``to_device``'s) gathered where ``scores`` reads them, inside the
        clock (``run/scenario.py``); None: the worker copies them from the host (``to_device``, noted)."""
        return x[indices] if isinstance(x, np.ndarray) else None

    @abstractmethod
    def scores(self, x: Any, batch_size: int) -> Any:
        """Class probabilities (n, classes) for ``x`` (from ``to_device``), dropout off; may be lazy."""

    def train_epoch(self, order: np.ndarray) -> tuple[Any, Any]:
        """Train one epoch over the training samples in ``order``; return (mean loss, accuracy)."""
        raise NotImplementedError(f"{self.name} does not train")

    def step_losses(self) -> Any:
        """The loss of each step of the last ``train_epoch``, in order, as that epoch computed them
        (may be lazy: the worker brings them to the host outside the clock), for the loss audit. None
        (the default): this adapter keeps none, and its epochs are noted as not audited."""
        return None

    def to_host(self, value: Any) -> Any:
        """A host value (NumPy array or float) for what ``scores``/``train_epoch`` returned."""
        return np.asarray(value)

    def sync(self) -> None:
        """Block until every queued device operation has finished."""

    def train_scores(self, x: Any) -> Any:
        """Class probabilities of a *training-mode* forward pass on ``x`` (from ``to_device``):
        batchnorm on the batch's statistics, dropout off, no state changed (the moving statistics
        stay as they are). The worker checks it against the reference for networks with batchnorm,
        beside the inference-mode parity. Every backend that trains implements it."""
        raise NotImplementedError(f"{self.name} has no training mode")

    def train_steps(self, batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[float]:
        """Loss of each of the first K training steps on these batches, dropout disabled."""
        raise NotImplementedError(f"{self.name} does not support the trajectory check")

    # --- generation: greedy decoding with a key/value cache (``--generate``; decoder workloads) ---
    #: Why this backend cannot generate ("" when it can): the generation cell is ``unavailable``
    #: with this reason. An adapter that generates implements the four methods below.
    generation_note: str = "generation (a key/value cache) is not implemented for this backend"

    def start_generation(self, batch: int, positions: int) -> None:
        """Before a generation pass (untimed): make a key/value cache for ``batch`` sequences of
        ``positions`` tokens (prompt + new tokens), in ``workload.generation.cache`` (``fp32`` unless
        the spec says otherwise, at every precision), and compile what needs compiling. Called once
        per prompt length; every pass starts from position 0 again, so a cache need not be cleared."""
        from ..errors import BackendUnavailable

        raise BackendUnavailable(f"{self.name}: {self.generation_note}")

    def prefill(self, ids: np.ndarray) -> Any:
        """The prompt pass: ``ids`` are host int32 token ids (B, P) (their copy to the device is
        the adapter's, inside the clock: time to first token counts it). Runs the prompt through
        the network with the causal mask, writes the keys and values of positions 0..P-1 into the
        cache, and returns the greedy next token of each sequence, int32 (B,), where ``decode``
        reads it (argmax of the last position's output; the softmax may be skipped)."""
        raise NotImplementedError

    def decode(self, ids: Any, position: int) -> Any:
        """One decode step: ``ids`` (B,) is what ``prefill`` or the last ``decode`` returned, the
        token at ``position`` (P for the first step). Writes its keys and values at ``position``
        (rotary angle and position embedding of ``position``), attends to positions 0..position,
        and returns the next tokens (B,). The worker reads each step's tokens on the host inside
        the step's clock (a streamed token)."""
        raise NotImplementedError

    def decode_steps(self, ids: Any, position: int, steps: int) -> Any:
        """Optional: ``steps`` decode steps in one dispatch (``jax:scan``), returning (B, steps)
        tokens; None (the default) makes the worker call ``decode`` step by step."""
        return None

    def cache_bytes(self) -> tuple[int, int]:
        """(bytes, positions) of the key/value cache as it is held now, after a pass: the bytes
        of every layer's key and value arrays (their real dtype: a bf16 cache where the spec says
        fp32 is caught by this), and the positions they hold (the static cache's ``positions``;
        a cache grown by concatenation holds P + G - 1)."""
        raise NotImplementedError

    # --- data placement and device memory ----------------------------------------------------
    #: The placement rule this cell follows (``data_on_device`` column): True, its arrays are on the
    #: device before the clock; False, every batch is copied to the device inside the clock.
    data_on_device: bool = True
    #: Why the arrays are not on the device ("" when they are), for the build row's notes.
    data_note: str = ""

    def free_device_bytes(self) -> Optional[int]:
        """Free memory of the device in bytes as the framework reports it; None on a CPU (host
        memory: the arrays are already there) and where the framework does not say."""
        return None

    def place_data(self, nbytes: int) -> bool:
        """Decide the placement rule for arrays of ``nbytes`` in all (called once, before
        ``build``): on the device when they take at most half of the free device memory (the
        other half is left to the model, its activations and the epoch's gathered copy), and
        always where the framework reports no free memory (a CPU). Sets and returns
        :attr:`data_on_device`. An adapter that cannot hold arrays on its device overrides this
        to return False, with the reason in :attr:`data_note`."""
        free = self.free_device_bytes()
        self.data_on_device = free is None or nbytes <= free / 2
        if not self.data_on_device:
            self.data_note = f"{nbytes / 2**20:.0f} MiB of arrays exceed half of the {free / 2**20:.0f} MiB free"
        return self.data_on_device

    def peak_device_mb(self) -> Optional[float]:
        """Peak device memory of this cell in MiB, from the framework's own counter; None on a CPU
        and for a framework without one."""
        return None

    def reset_device_peak(self) -> None:
        """Restart the device-memory peak counter, where the framework allows it."""

    def get_weights(self) -> list[np.ndarray]:
        """Current weights converted back to the canonical layout (tests use it)."""
        raise NotImplementedError

    def barrier(self) -> None:
        """Wait until every replica of a cell whose replicas each run the whole cell (Ray Train's:
        ``options.rendezvous``) has come here. The worker calls it just before each epoch's clock,
        so that untimed work one replica finishes later (validation, say) is not in the epoch."""

    def comm_seconds(self) -> Optional[float]:
        """Seconds this replica spent in gradient communication since the last call, where the
        data-parallel engine exposes them (torch DDP's comm hook); None elsewhere. The worker
        records them per epoch (``comm_s``)."""
        return None

    def close(self) -> None:
        """Release what the cell started beyond this process (a data-parallel adapter's replica
        processes); the worker calls it when the cell ends, however it ends."""

    # --- capabilities (declared in the registry entry's ``Capabilities``) -------------------------
    def gemm_peak(self, precision: str) -> float:
        """``peak_probe``: best FLOP/s of a square matmul in ``precision`` on this device, synced."""
        raise NotImplementedError(f"{self.name} has no GEMM probe")

    def threads(self) -> int:
        """``thread_control``: the intra-op threads this framework really uses."""
        raise NotImplementedError(f"{self.name} does not report its threads")


class CupyMemory:
    """``Backend``'s device-memory methods by CuPy's own counters, mixed in (before ``Backend``) by
    the NumPy reference and Chainer, which set ``cupy`` to the CuPy module on a GPU (None: a CPU
    cell, which has none). CuPy's pool reports what it holds now (``total_bytes``), not a peak, so
    the peak is the largest value read so far, at row time: a peak between two rows can be missed."""

    cupy: Any = None
    _cupy_peak = 0

    def free_device_bytes(self) -> Optional[int]:
        return None if self.cupy is None else int(self.cupy.cuda.runtime.memGetInfo()[0])

    def peak_device_mb(self) -> Optional[float]:
        if self.cupy is None:
            return None
        self._cupy_peak = max(self._cupy_peak, int(self.cupy.get_default_memory_pool().total_bytes()))
        return self._cupy_peak / 2**20

    def reset_device_peak(self) -> None:
        self._cupy_peak = 0


def batches(order: np.ndarray, batch_size: int):
    """Consecutive index slices of ``order``; the last batch may be short (as Keras fit does)."""
    for start in range(0, len(order), batch_size):
        yield order[start:start + batch_size]


def accuracy(scores: np.ndarray, labels: np.ndarray) -> float:
    """The share of predictions whose top score is the label: one per sample, or one per position
    of a token sequence (scores (N, T, V), labels (N, T))."""
    labels = np.asarray(labels)
    return float(np.mean(np.argmax(scores, axis=-1) == labels)) if labels.size else float("nan")


#: The probability clip of Keras' cross-entropy (``backend.epsilon()``).
KERAS_CLIP = 1e-7


def cross_entropy(probs: np.ndarray, labels: np.ndarray, clip: float = KERAS_CLIP) -> float:
    """Mean categorical cross-entropy of class probabilities, clipped to [clip, 1 - clip] as Keras
    clips (``clip=0``: unclipped, as a loss from the logits; a probability that underflowed to 0 gives
    ``inf``): over the samples, or over every position of token sequences (the next-token loss)."""
    labels = np.asarray(labels)
    if labels.size == 0:
        return float("nan")
    picked = np.take_along_axis(np.asarray(probs, np.float64), labels[..., None].astype(np.int64), axis=-1)
    with np.errstate(divide="ignore"):
        return float(-np.mean(np.log(np.clip(picked, clip, 1.0 - clip))))


#: GEMM-probe sizes (n, matmuls per trial). On a CPU the best size differs by library and dtype
#: (one size can read 15% below the other), so both are tried and the better one counts.
CPU_GEMM_SIZES = ((2048, 2), (4096, 1))
GPU_GEMM_SIZES = ((8192, 10),)


def gemm_rate(make: Callable[[int, int], Callable[[], None]], cpu: bool, budget_s: float = 1.5) -> float:
    """Best FLOP/s of square matmuls over the sizes for a CPU or an accelerator. ``make(n, reps)``
    prepares the operands and returns a function that runs ``reps`` n x n matmuls and waits for
    them. One warm-up call per size, then at least 3 timed trials, more while under ``budget_s``;
    the best trial counts.

    A precision the hardware only emulates can run two to three orders of magnitude slower than
    fp32 (bf16 on a CPU without AVX512_BF16 or AMX), where one 4096 x 4096 matmul would take
    minutes; so one small matmul first sizes the probe: a size whose call would take more than a
    third of the budget is replaced by the largest power of two that fits (256 at least). The
    pilot doubles while the next size fits, keeping its best rate: a 256 x 256 matmul lasts a
    fraction of a millisecond, and on a loaded machine it alone read 10-50x low, which left only
    small sizes to time and a peak several times too low (MFU several times too high)."""
    sizes = CPU_GEMM_SIZES if cpu else GPU_GEMM_SIZES
    n, rate = _PILOT_N, 0.0
    while True:
        small = make(n, 1)
        small()
        rate = max(rate, 2.0 * n ** 3 / max(_best_time(small, 1), 1e-9))
        if 2 * n >= min(size for size, _ in sizes) or 2.0 * (2 * n) ** 3 / rate > budget_s / 3:
            break
        n *= 2
    fits = [(n, reps) for n, reps in sizes if 2.0 * n ** 3 * reps / rate <= budget_s / 3]
    if not fits:
        n = _PILOT_N
        while 2.0 * (2 * n) ** 3 / rate <= budget_s / 3:
            n *= 2
        fits = [(n, 1)]
    best_rate = 0.0
    for n, reps in fits:
        run = make(n, reps)
        run()  # library init, thread pool, kernel selection
        best_rate = max(best_rate, 2.0 * n ** 3 * reps / _best_time(run, budget_s))
    return best_rate


#: The size of the matmul that sizes a GEMM probe (see ``gemm_rate``).
_PILOT_N = 256


def _best_time(run: Callable[[], None], budget_s: float) -> float:
    """The best of at least 3 timed calls of ``run``, more (up to 20) while under ``budget_s``."""
    best, spent = math.inf, 0.0
    for trial in range(20):
        t0 = time.perf_counter()
        run()
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
        if trial >= 2 and spent > budget_s:
            break
    return best

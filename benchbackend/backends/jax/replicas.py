"""JAX data parallel: the batch sharded over N devices of one process with ``jax.shard_map``, the
gradients averaged with ``lax.pmean``, held to the one semantics of :mod:`benchbackend.spec.replicas`.

The N replicas are N devices of this worker's process, on a mesh of one axis: on a CPU, N host
devices (``jax_num_cpu_devices``); on GPUs, one GPU per replica (``gpu:i`` .. ``gpu:i+N-1``), else
the cell is ``unavailable``. Replica 0 is ``self.device``: the forward parity, validation and
inference passes run there on its copy of the parameters, with ``JaxBackend``'s own functions;
the training steps are ``jax_sharding``'s.

A step: each replica takes its contiguous shard of the global batch (``_split``:
``replicas.shards``, weights ``replicas.weights``), computes its weighted mean loss and gradients
on its own rows (batchnorm on its own batch statistics), the gradients are averaged (``_reduce``:
``lax.pmean``), and every replica applies the same update at the workload's learning rate
(``_lr``). An epoch's loss and accuracy totals are the global batch's (a ``pmean``/``psum`` per
step). A short last batch that N does not divide is split as evenly as possible and run exactly
(see ``jax_sharding``). ``scan`` runs K full global batches per dispatch in ``lax.scan`` inside the
same ``shard_map``; the rest go through the single-batch step, so both modes train alike.

Data: each epoch the batches' rows are gathered on replica 0's device in replica-major order (one
gather, as ``JaxBackend`` does) and split over the devices (one copy of 1/N of the epoch to each);
each step then slices its block on its own device. Off the device (``data_on_device`` False) each
step's rows are copied from the host inside the clock instead.

The CPU devices must exist before JAX starts its CPU backend, which ``JaxBackend.__init__`` does
(``jax_device``): so ``jax_num_cpu_devices`` is set first. A preloaded worker (``preload.py``) is
fine: the preloader only imports this module, and importing JAX starts no backend; the fork then
sets the count before its first JAX operation. A process whose CPU backend already runs with
fewer devices (an in-process test after another JAX cell) gets a one-line ``unavailable``.

Threads: XLA's CPU client has one intra-op (Eigen) thread pool, sized when the backend starts
(``PJRT_NPROC``, else the schedulable cores, at least the device count), shared by its N devices;
the N replicas' programs run concurrently (the all-reduce needs every one in flight) and draw on
that one pool. JAX has no per-device thread count, so ``threads`` (already split per replica by
the runner) times N sizes the one pool (``PJRT_NPROC``, set by ``JaxBackend``); ``details`` says
what the pool is. For the same reason the GEMM probe
(``gemm_peak``) runs on all N devices at once and reports one replica's share, which the worker
multiplies by N, as it does for engines whose replicas each own their threads.

Tests plant the traps the trajectory check must catch by overriding ``_reduce`` (a ``psum``),
``_lr`` (times N) or ``_split`` (overlapping shards, a dropped remainder).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ...errors import BackendUnavailable
from ...spec.replicas import shards
from ...spec.replicas import weights as shard_weights
from ...spec.workload import Workload
from ..base import Options, as_options, gemm_rate
from ..spec import gpu_index
from .adapter import JaxBackend
from .graph import Params
from .sharding import AXIS, compile_steps, layout, make_step


def _set_cpu_devices(n: int) -> None:
    """Ask JAX for ``n`` host devices: only possible before its CPU backend starts (the first JAX
    operation). Later, the backend keeps the count it started with, which ``_replica_devices`` checks."""
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # the backend is up already in this process
        pass


def _replica_devices(first: Any, n: int, backend: str) -> list[Any]:
    """The N devices of the replicas, from replica 0's on, or ``BackendUnavailable``."""
    found = jax.devices(first.platform)
    at = found.index(first)
    if at + n > len(found):
        kind = first.platform.upper()
        if first.platform == "cpu":
            raise BackendUnavailable(f"{backend}: --replicas {n} needs {n} CPU devices; JAX's CPU backend in this "
                                     f"process started with {len(found)} before jax_num_cpu_devices could be set")
        raise BackendUnavailable(f"{backend}: --replicas {n} from {first.platform}:{at} needs {n} {kind}s "
                                 f"(one per replica); jax sees {len(found)}")
    return found[at:at + n]


def _cpu_pool(n: int) -> int:
    """Threads of XLA's CPU intra-op pool (``DefaultThreadPoolSize``, at least the device count)."""
    for var in ("PJRT_NPROC", "NPROC"):
        if os.environ.get(var, "").isdigit():
            return max(int(os.environ[var]), n)
    return max(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, n)


class JaxShardedBackend(JaxBackend):
    name = "jax"

    def __init__(self, workload: Workload, device: str, mode: str = "jit", precision: str = "fp32",
                 options: "Options | Mapping[str, Any] | None" = None):
        opts = as_options(options)
        #: The number of replicas: devices of the mesh.
        self.world = opts.replicas or 1
        if opts.rendezvous:  # Ray Train's one process per replica: jax.distributed, not done here
            raise BackendUnavailable("jax: --replicas across processes (a rendezvous) is not implemented; "
                                     "the jax engine runs its replicas as devices of one process")
        if workload.next_token:  # sharding.py's loss and accuracy are per sample, not per position
            raise BackendUnavailable("jax: --replicas for language models (next-token training) is not "
                                     "implemented yet; run them without --replicas")
        if not device.startswith("tpu") and gpu_index(device, self.name) is None:
            _set_cpu_devices(self.world)  # before JaxBackend resolves the device, which starts the backend
        super().__init__(workload, device, mode, precision, opts)
        self.devices = _replica_devices(self.device, self.world, self.name)
        self.mesh = Mesh(np.array(self.devices), (AXIS,))
        self.replicated = NamedSharding(self.mesh, P())  # parameters, optimizer state, totals, key
        self.split_rows = NamedSharding(self.mesh, P(AXIS))  # replica r's segment of the rows on device r
        self.state: tuple[Params, Any] = ([], {})  # (parameters, optimizer state), replicated

    def details(self) -> dict[str, Any]:
        kind = self.device.platform.upper()
        out = {**super().details(), "replicas": f"{self.world} (shard_map over {self.world} {kind} devices, pmean)"}
        if self.device.platform == "cpu":
            out["xla_cpu_threads"] = (f"one intra-op pool of {_cpu_pool(self.world)} threads, shared by the "
                                      f"{self.world} devices")
        return out

    def gemm_peak(self, precision: str) -> float:
        """One replica's share of the N devices' best GEMM rate, every device multiplying at once:
        the worker counts a replica cell's peak as the probe's times N. On a CPU the N host devices
        share XLA's one thread pool, so one device alone would reach the whole machine's rate."""
        dtype = {"fp32": jnp.float32, "tf32": jnp.float32, "bf16": jnp.bfloat16}[precision]
        matmul = jax.jit(jax.shard_map(jnp.matmul, mesh=self.mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=P(AXIS)))

        def make(n: int, reps: int) -> Callable[[], None]:
            rng = np.random.default_rng(0)
            a, b = (jax.device_put(rng.random((self.world * n, n), np.float32), self.split_rows).astype(dtype)
                    for _ in range(2))

            def run() -> None:
                for _ in range(reps):
                    c = matmul(a, b)
                c.block_until_ready()
            return run

        return gemm_rate(make, cpu=self.device.platform == "cpu")

    # --- the override points of the tests' traps -------------------------------------------------
    def _split(self, size: int) -> list[tuple[int, int, float]]:
        """(start, stop, weight) of each replica's shard of a global batch of ``size`` (``replicas``)."""
        return [(a, b, w) for (a, b), w in zip(shards(size, self.world), shard_weights(size, self.world))]

    def _reduce(self, grads: Params) -> Params:
        """The gradients' all-reduce, inside ``shard_map``: their average over the replicas."""
        return [lax.pmean(g, AXIS) for g in grads]

    def _lr(self) -> float:
        """The learning rate the replicas step with: the workload's (``--scale-lr`` is applied before)."""
        return self.workload.training.lr

    # --- model ------------------------------------------------------------------------------------
    def build(self, weights: Sequence[np.ndarray]) -> int:
        count = super().build(weights)  # replica 0's parameters and its inference functions
        step = make_step(self.workload, self.compute, self._lr(), self._reduce)
        self._one, self._block, self._fixed = compile_steps(step, self.mesh, self.k, self.unroll)
        self.state = jax.device_put((self.params, self.opt), self.replicated)
        self.rep_key = jax.device_put(self.key, self.replicated)
        return count

    def _settle(self, params: Params, opt: Any) -> None:
        """Keep the replicated state; ``params`` becomes replica 0's copy (views of its buffers)."""
        self.state = (params, opt)
        self.params = [next(s.data for s in p.addressable_shards if s.device == self.device) for p in params]

    def _shard_rows(self, order: np.ndarray, spans: Sequence[tuple[int, int]]) -> tuple[Any, Any, list[int], list]:
        """The rows of the global batches ``spans`` ((start, size) in ``order``), each replica's
        segment on its device: (x, y, each batch's block offset in a segment, each batch's plan)."""
        idx, offsets, plans = layout(order, spans, self._split, self.world)
        if self.data_on_device:
            x, y = self._gather(self.x, self.y, jax.device_put(idx, self.device))
        else:
            x, y = self.x[idx], self.y[idx]
        x, y = jax.device_put((x, y), self.split_rows)
        return x, y, offsets, plans

    # --- run ----------------------------------------------------------------------------------------
    def train_epoch(self, order: np.ndarray) -> tuple[jax.Array, jax.Array]:
        n, bs, k = len(order), self.workload.training.batch_size, self.k
        spans = [(s, min(bs, n - s)) for s in range(0, n, bs)]
        blocks = (n // bs) // k if k > 1 else 0
        groups = [spans[b * k:(b + 1) * k] for b in range(blocks)] + [[s] for s in spans[blocks * k:]]
        params, opt = self.state
        acc = jax.device_put((np.zeros((), np.float32), np.zeros((), np.int32)), self.replicated)
        whole = self._shard_rows(order, spans) if self.data_on_device else None
        done, step = 0, self.step_count
        for group in groups:
            # On the device: the epoch's rows, fed once; else this group's, copied now.
            x, y, offsets, plans = whole if whole is not None else self._shard_rows(order, group)
            at = done if whole is not None else 0
            run = self._block if len(group) > 1 else self._one
            params, opt, acc = run(params, opt, acc, x, y, np.int32(offsets[at]), self.rep_key, np.int32(step),
                                   plan=plans[at])
            done, step = done + len(group), step + len(group)
        self.step_count = step
        self._settle(params, opt)
        self._pending = acc
        return acc[0] / n, acc[1].astype(jnp.float32) / n  # lazy: the worker fetches and syncs

    def train_steps(self, batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[float]:
        params, opt = self.state
        losses = []
        for xb, yb in batches:
            idx, _, (plan,) = layout(np.arange(len(xb)), [(0, len(xb))], self._split, self.world)
            x, y = jax.device_put((np.ascontiguousarray(xb[idx], np.float32), np.asarray(yb[idx], np.int32)),
                                  self.split_rows)
            params, opt, loss = self._fixed(params, opt, x, y, plan=plan)
            losses.append(float(loss))
        self._settle(params, opt)
        self._pending = self.params
        return losses

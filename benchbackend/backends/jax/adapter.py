"""JAX adapter: the spec's layers in ``jax.lax``/``jax.numpy``, Keras' optimizers written out, XLA-compiled steps.

No flax and no optax. The network walks the resolved graph with the canonical weights as they
are (``jax_graph``: ``lax.conv_general_dilated`` takes NHWC x HWIO natively, and flattening NHWC
needs no row permutation), so a layer library would add a second layout to convert to and
nothing else. Batchnorm's moving statistics ride in the parameter list, outside the gradient:
each training step updates them from the batch statistics its forward pass returns.
optax's Adam adds epsilon to the *bias-corrected* sqrt(v) and Keras' to the raw one; matching it
would take a per-step epsilon, so the three Keras update rules are written out (``optimizers.py``).

Modes:

- ``jit``: one jitted train step per batch (one host dispatch per step);
- ``scan``: ``lax.scan`` runs K = ``options.steps_per_execution`` steps per dispatch (the
  analogue of Keras' ``steps_per_execution``, one of the two reasons a TPU is fast). The full
  batches left after the last whole block and the final short batch go through the same jitted
  step as ``jit``, so both modes train on the same batches with the same updates and the same
  dropout keys (``fold_in(key, global step)``).

``bf16`` keeps fp32 parameters and optimizer state; the forward pass casts parameters and inputs
to bfloat16 inside the step, and the loss and the update are fp32. Token ids (the input of a
language model's embedding) stay float32 until the embedding casts them to int32: bfloat16 holds
whole numbers exactly only up to 256.

A language model (``workload.next_token``) outputs (N, T, vocab): the loss is the mean
cross-entropy over every position, the training accuracy the share of positions whose argmax is
the label, and ``scores`` returns (n, T, vocab) probabilities.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...errors import BackendUnavailable
from ...spec.graph import INPUT
from ...spec.model import kernel_mask, trainable_mask
from ...spec.workload import Workload
from ..base import Backend, gemm_rate, gpu_index
from ..precision import capability_of, check_tf32, math_mode
from .cache import KeepsCompiled
from .generation import Generates
from .graph import Params, make_forward
from .optimizers import _init_state, _update  # noqa: F401 (sharding.py imports _update from here)
from .threads import pool_threads, size_pool

_INSTALL = {"gpu": "pip install 'jax[cuda12]'", "tpu": "pip install 'jax[tpu]' (on a Cloud TPU VM)"}
DEFAULT_STEPS_PER_EXECUTION = 32


def jax_device(device: str, backend: str) -> jax.Device:
    """The JAX device ``--device`` names (``cpu``, ``gpu[:N]``, ``cuda[:N]``, ``tpu[:N]``), or
    ``BackendUnavailable`` saying what JAX sees instead (shared by the jax and keras-jax adapters)."""
    if device == "tpu" or device.startswith("tpu:"):
        platform, index = "tpu", int(device[4:] or 0)
    else:
        gpu = gpu_index(device, backend)
        platform, index = ("cpu", 0) if gpu is None else ("gpu", gpu)
    try:
        found = jax.devices(platform)
    except RuntimeError as exc:
        first = (str(exc).splitlines() or [""])[0]
        raise BackendUnavailable(f"{backend}: jax sees no {platform.upper()} ({first}); "
                                 f"{_INSTALL.get(platform, '')}".rstrip("; ")) from None
    if index >= len(found):
        raise BackendUnavailable(f"{backend}: jax sees {len(found)} {platform} device(s); there is no "
                                 f"{platform}:{index}")
    return found[index]


def memory(device: Any) -> tuple[Optional[int], Optional[float]]:
    """(free bytes, peak MiB in use since the process started: JAX has no reset) of ``device`` by
    JAX's own counters; (None, None) on a CPU, which keeps none. Shared by jax and keras-jax."""
    s = device.memory_stats() or {}
    free = s["bytes_limit"] - s["bytes_in_use"] if "bytes_limit" in s and "bytes_in_use" in s else None
    return free, s["peak_bytes_in_use"] / 2**20 if "peak_bytes_in_use" in s else None


def _split(n: int, batch: int, k: int) -> tuple[int, int, int]:
    """(whole blocks of k full batches, full batches after them, size of the last short batch)."""
    full = n // batch
    blocks = full // k if k > 1 else 0
    return blocks, full - blocks * k, n - full * batch


def set_math(device: Any, precision: str, backend: str) -> str:
    """The precision rule (``backends/precision.py``) in JAX: the default precision of every matmul
    and convolution traced after it, ``highest`` (IEEE fp32; XLA's GPU default is TF32 on Ampere+)
    or ``tensorfloat32`` for ``tf32`` on a GPU that has it. Shared by jax and keras-jax."""
    if precision == "tf32":
        gpu = device.platform == "gpu"
        check_tf32(backend, str(device.device_kind) if gpu else None,
                   capability_of(getattr(device, "compute_capability", None)) if gpu else None, device.platform)
    jax.config.update("jax_default_matmul_precision", "tensorfloat32" if precision == "tf32" else "highest")
    return math_mode(precision)


class JaxBackend(KeepsCompiled, Generates, Backend):
    name = "jax"

    def __init__(self, workload: Workload, device: str, mode: str = "jit", precision: str = "fp32",
                 options: Optional[dict[str, Any]] = None):
        super().__init__(workload, device, mode, precision, options)
        size_pool(self.options.threads, self.options.replicas)  # before jax_device starts the backend
        self.device = jax_device(device, self.name)
        if mode not in ("jit", "scan"):
            raise BackendUnavailable(f"jax: unknown mode '{mode}'; use jit or scan")
        if precision not in ("fp32", "tf32", "bf16"):
            raise BackendUnavailable(f"jax: precision '{precision}' is not supported; use fp32, tf32 or bf16")
        self.math = set_math(self.device, precision, self.name)
        spe = self.options.steps_per_execution or DEFAULT_STEPS_PER_EXECUTION
        self.k = int(spe) if mode == "scan" else 1
        if self.k < 1:
            raise BackendUnavailable(f"jax: steps_per_execution must be >= 1; got {spe}")
        self.compute = jnp.bfloat16 if precision == "bf16" else jnp.float32
        # XLA:CPU runs a rolled while-loop body several times slower than the same step jitted
        # alone (measured 4-6x on mnist); unrolled, the block runs as fast as K jitted steps or
        # faster. GPUs and TPUs run the rolled loop well and compile it once.
        self.unroll = self.k if self.device.platform == "cpu" else 1
        self._pending: Any = None  # the newest array this adapter produced, for sync()
        self._placed: list[Any] = []  # arrays being copied to the device (device_put is asynchronous)

    # --- identity -----------------------------------------------------------------------------
    @classmethod
    def probe(cls) -> dict:
        devices = [f"{d.platform}:{d.id} ({d.device_kind})" for d in jax.devices()]
        return {"version": jax.__version__, "devices": devices}

    def version(self) -> str:
        return jax.__version__

    def device_id(self) -> str:
        return f"{self.device.platform}:{self.device.id}" if self.device.platform != "cpu" else "cpu"

    def gpu_name(self) -> str:
        return "" if self.device.platform == "cpu" else str(self.device.device_kind)

    def threads(self) -> int:  # per replica: the one pool, shared, over the replicas
        return max(1, pool_threads() // self.options.replicas)

    def details(self) -> dict[str, Any]:
        out = {"platform": self.device.platform}
        if self.mode == "scan":
            out["steps_per_execution"] = str(self.k)
            out["scan_unroll"] = str(self.unroll)
        if self.precision == "bf16":
            out["compute"] = "bfloat16 (fp32 parameters, loss and update)"
        return out

    def gemm_peak(self, precision: str) -> float:
        """Best FLOP/s of a jitted square matmul in ``precision`` on this device, waited for
        (n 2048 and 4096 on CPU, 8192 elsewhere; a few seconds)."""
        dtype = {"fp32": jnp.float32, "tf32": jnp.float32, "bf16": jnp.bfloat16}[precision]
        matmul = jax.jit(jnp.matmul)

        def make(n: int, reps: int) -> Callable[[], None]:
            rng = np.random.default_rng(0)
            a, b = (jax.device_put(jnp.asarray(rng.random((n, n), np.float32), dtype), self.device) for _ in range(2))

            def run() -> None:
                for _ in range(reps):
                    c = matmul(a, b)
                c.block_until_ready()
            return run

        return gemm_rate(make, cpu=self.device.platform == "cpu")

    # --- model --------------------------------------------------------------------------------
    def build(self, weights: Sequence[np.ndarray]) -> int:
        t = self.workload.training
        logits_fn, g = make_forward(self.workload)
        compute, bs = self.compute, t.batch_size
        out_shape = g.output.out_shape  # (classes,), or (T, vocab) for a language model
        self._out_shape, self._positions = out_shape, int(np.prod(out_shape[:-1]))
        # Token ids are cast by the embedding that reads them, never to bfloat16 on the way.
        ids = any(n.kind == "embedding" and INPUT in n.inputs for n in g.nodes)
        mask = trainable_mask(g)
        kernels = [k for k, tr in zip(kernel_mask(g), mask) if tr]  # among the trainable arrays
        momenta = [n.layer.momentum for n in g.nodes if n.kind == "batchnorm" for _ in (0, 1)]
        decay = t.weight_decay
        l2 = decay.rate if decay is not None and decay.kind == "l2" else 0.0
        decoupled = decay.rate * t.lr if decay is not None and decay.kind == "decoupled" else 0.0

        def merge(train: Params, frozen: Params) -> Params:
            it_t, it_f = iter(train), iter(frozen)
            return [next(it_t) if m else next(it_f) for m in mask]

        def split(params: Params) -> tuple[Params, Params]:
            return [p for p, m in zip(params, mask) if m], [p for p, m in zip(params, mask) if not m]

        def logits(params: Params, x: jax.Array, key: Optional[jax.Array], train: bool):
            cast = [p.astype(compute) for p in params]
            z, stats = logits_fn(cast, x if ids else x.astype(compute), key, train)
            return z.astype(jnp.float32), stats

        def loss_fn(train: Params, frozen: Params, x: jax.Array, y: jax.Array, key: Optional[jax.Array]):
            z, stats = logits(merge(train, frozen), x, key, True)
            # Cross-entropy from the logits behind the final softmax, as Keras 3 on TensorFlow; a
            # language model's is the mean over every position.
            loss = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), y[..., None], axis=-1))
            if l2:  # Keras' L2 kernel regularizer
                loss = loss + l2 * sum(jnp.sum(jnp.square(p)) for p, k in zip(train, kernels) if k)
            return loss, (z, stats)

        def step(params: Params, opt: dict, acc: tuple, x: jax.Array, y: jax.Array,
                 key: Optional[jax.Array]):
            train, frozen = split(params)
            (loss, (z, stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(train, frozen, x, y, key)
            if decoupled:  # Keras 3's weight_decay, before the update
                train = [p * (1.0 - decoupled) if k else p for p, k in zip(train, kernels)]
            train, opt = _update(t.optimizer, t.lr, t.momentum, train, grads, opt, t.nesterov)
            batch = [s for pair in stats for s in pair]
            frozen = [m * f + (1.0 - m) * b for f, b, m in zip(frozen, batch, momenta)]
            hits = jnp.sum(jnp.argmax(z, axis=-1) == y).astype(jnp.int32)
            acc = (acc[0] + loss * x.shape[0], acc[1] + hits)
            return merge(train, frozen), opt, acc, loss

        def key_at(key: jax.Array, i: jax.Array) -> jax.Array:
            return jax.random.fold_in(key, i)

        # Both modes slice the epoch's gathered arrays inside the compiled function, so a step
        # is one dispatch (no separate slice op per batch).
        @partial(jax.jit, static_argnames=("size",), donate_argnums=(0, 1, 2))
        def train_one(params, opt, acc, x, y, start, key, i, size):
            xb = lax.dynamic_slice_in_dim(x, start, size)
            yb = lax.dynamic_slice_in_dim(y, start, size)
            params, opt, acc, loss = step(params, opt, acc, xb, yb, key_at(key, i))
            return params, opt, acc, loss  # the step's loss too: the loss audit's (``step_losses``)

        @partial(jax.jit, donate_argnums=(0, 1, 2))
        def train_block(params, opt, acc, x, y, first, key, s0):
            k = self.k
            xs = lax.dynamic_slice_in_dim(x, first * bs, k * bs).reshape((k, bs) + x.shape[1:])
            ys = lax.dynamic_slice_in_dim(y, first * bs, k * bs).reshape((k, bs) + y.shape[1:])

            def body(carry, batch):
                p, o, a = carry
                xb, yb, j = batch  # j: batch index within the epoch; s0 + j is the global step
                p, o, a, loss = step(p, o, a, xb, yb, key_at(key, s0 + j))
                return (p, o, a), loss

            steps = first + jnp.arange(k, dtype=jnp.int32)
            (params, opt, acc), losses = lax.scan(body, (params, opt, acc), (xs, ys, steps), unroll=self.unroll)
            return params, opt, acc, losses

        @jax.jit
        def no_dropout_step(params, opt, x, y):
            zero = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
            params, opt, _, loss = step(params, opt, zero, x, y, None)
            return params, opt, loss

        @partial(jax.jit, static_argnames=("size",))
        def predict(params, x, start, size):
            return jax.nn.softmax(logits(params, lax.dynamic_slice_in_dim(x, start, size), None, False)[0], axis=-1)

        @partial(jax.jit, static_argnames=("size",))
        def predict_block(params, x, start, size):
            xs = lax.dynamic_slice_in_dim(x, start, size * self.k).reshape((self.k, size) + x.shape[1:])
            return lax.map(lambda xb: jax.nn.softmax(logits(params, xb, None, False)[0], axis=-1),
                           xs).reshape((-1,) + out_shape)

        @jax.jit
        def train_probs(params, x):
            return jax.nn.softmax(logits(params, x, None, True)[0], axis=-1)

        @jax.jit
        def gather(x, y, order):
            return jnp.take(x, order, axis=0), jnp.take(y, order, axis=0)

        self._train_one, self._train_block, self._no_dropout_step = train_one, train_block, no_dropout_step
        self._predict, self._predict_block, self._gather = predict, predict_block, gather
        self._train_probs = train_probs
        self.params = [jax.device_put(np.asarray(w, np.float32), self.device) for w in weights]
        # Committed to the device as the train step's outputs are: Adam's step count was made on the
        # default device, uncommitted, so the epoch after the first (whose state is the step's output)
        # compiled the step again: 27 s of gpt-nano's second epoch under scan (one block per epoch).
        self.opt = jax.device_put(_init_state(t.optimizer, t.momentum, split(self.params)[0]), self.device)
        self.key = jax.device_put(jax.random.key(self.workload.seed), self.device)
        self.step_count = 0  # global step: the dropout key of step i is fold_in(key, i) in both modes
        self._pending = self.params
        return int(sum(int(np.prod(p.shape)) for p in self.params))

    def get_weights(self) -> list[np.ndarray]:
        return [np.asarray(p) for p in self.params]

    # --- data ---------------------------------------------------------------------------------
    # ``data_on_device``: jax.Arrays that the compiled steps slice on the device (``_feed``); else
    # NumPy arrays, and ``_feed`` copies each batch (or scan block) to the device inside the clock.
    def _put(self, a: np.ndarray) -> Any:
        if not self.data_on_device:
            return a
        out = jax.device_put(a, self.device)
        self._placed.append(out)  # sync() waits for the copy: the worker times it in the build row
        return out

    def set_data(self, x_train: np.ndarray, y_train: np.ndarray) -> None:
        self.x = self._put(np.ascontiguousarray(x_train, np.float32))
        self.y = self._put(np.asarray(y_train, np.int32))

    def to_device(self, x: np.ndarray) -> Any:
        return self._put(np.ascontiguousarray(x, np.float32))

    def take(self, x: jax.Array, indices: np.ndarray) -> jax.Array:
        return jnp.take(x, jnp.asarray(indices), axis=0)

    def _feed(self, a: Any, start: int, size: int) -> tuple[Any, np.int32]:
        """(array, offset) to read ``size`` rows at: the device array, or the rows copied there now."""
        if self.data_on_device:
            return a, np.int32(start)
        return jax.device_put(a[start:start + size], self.device), np.int32(0)

    def free_device_bytes(self) -> Optional[int]:
        return memory(self.device)[0]

    def peak_device_mb(self) -> Optional[float]:
        return memory(self.device)[1]

    # --- run ----------------------------------------------------------------------------------
    def train_epoch(self, order: np.ndarray) -> tuple[jax.Array, jax.Array]:
        n, bs, k = len(order), self.workload.training.batch_size, self.k
        if self.data_on_device:
            x, y = self._gather(self.x, self.y, jax.device_put(np.asarray(order, np.int32), self.device))
        else:
            x, y = self.x[order], self.y[order]  # host: each batch goes to the device in _feed
        acc = jax.device_put((np.zeros((), np.float32), np.zeros((), np.int32)), self.device)
        params, opt, key, s0 = self.params, self.opt, self.key, self.step_count
        blocks, singles, short = _split(n, bs, k)
        self._losses = kept = []  # each dispatch's step losses, on the device (``step_losses``)
        for b in range(blocks):
            # Batch `first` of the fed array is the epoch's batch b*k: its dropout key stays s0 + b*k + j.
            (xs, at), (ys, _) = self._feed(x, b * k * bs, k * bs), self._feed(y, b * k * bs, k * bs)
            first = at // bs
            params, opt, acc, losses = self._train_block(params, opt, acc, xs, ys, first, key,
                                                         np.int32(s0 + b * k - first))
            kept.append(losses)
        for b in range(blocks * k, blocks * k + singles):
            (xb, at), (yb, _) = self._feed(x, b * bs, bs), self._feed(y, b * bs, bs)
            params, opt, acc, loss = self._train_one(params, opt, acc, xb, yb, at, key, np.int32(s0 + b), size=bs)
            kept.append(loss)
        if short:
            b = blocks * k + singles
            (xb, at), (yb, _) = self._feed(x, b * bs, short), self._feed(y, b * bs, short)
            params, opt, acc, loss = self._train_one(params, opt, acc, xb, yb, at, key, np.int32(s0 + b), size=short)
            kept.append(loss)
        self.params, self.opt = params, opt
        self.step_count = s0 + (n + bs - 1) // bs
        self._pending = acc
        # lazy: the worker fetches and syncs; accuracy over every predicted position
        return acc[0] / n, acc[1].astype(jnp.float32) / (n * self._positions)

    def step_losses(self) -> Optional[jax.Array]:
        kept = getattr(self, "_losses", None)
        return None if kept is None else jnp.concatenate([jnp.ravel(v).astype(jnp.float32) for v in kept])

    def scores(self, x: jax.Array, batch_size: int) -> jax.Array:
        n = int(x.shape[0])
        if n == 0:
            return jnp.zeros((0,) + self._out_shape, jnp.float32)
        k = self.k
        blocks, singles, short = _split(n, batch_size, k)
        parts = []
        for b in range(blocks):
            parts.append(self._predict_block(self.params, *self._feed(x, b * k * batch_size, k * batch_size),
                                             size=batch_size))
        for b in range(blocks * k, blocks * k + singles):
            parts.append(self._predict(self.params, *self._feed(x, b * batch_size, batch_size), size=batch_size))
        if short:
            parts.append(self._predict(self.params, *self._feed(x, n - short, short), size=short))
        out = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
        self._pending = out
        return out

    def to_host(self, value: Any) -> Any:
        return np.asarray(value)

    def sync(self) -> None:
        if self._pending is not None:
            jax.block_until_ready(self._pending)
        if self._placed:
            jax.block_until_ready(self._placed)
            self._placed = []

    def train_scores(self, x: jax.Array) -> jax.Array:
        out = self._train_probs(self.params, jax.device_put(x, self.device))
        self._pending = out
        return out

    def train_steps(self, batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[float]:
        losses = []
        for xb, yb in batches:
            self.params, self.opt, loss = self._no_dropout_step(self.params, self.opt, self.to_device(xb),
                                                                jax.device_put(np.asarray(yb, np.int32), self.device))
            losses.append(float(loss))
        self._pending = self.params
        return losses

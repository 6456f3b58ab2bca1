"""The data-parallel train step of ``jax_replicas``: one replica's share of a global batch inside
``jax.shard_map``, its gradients averaged with ``lax.pmean``; and the layout that puts each
replica's shards of the epoch's batches on its device.

Why ``shard_map`` and not ``jit`` over a batch-sharded array: under ``jit`` XLA keeps the program's
global meaning, so batchnorm would take its statistics over the *global* batch (a SyncBN), while
the one semantics (``benchbackend.spec.replicas``) wants each replica's own, as DDP without SyncBN. In
``shard_map`` the body is one replica's program, on its own rows.

Three facts of JAX the step states explicitly:

- ``shard_map`` (``check_vma``) differentiates a replicated (invariant) input by *summing* the
  replicas' gradients: the transpose of its implicit broadcast is a ``psum``. So the step casts
  the parameters to per-replica values (``lax.pcast(..., to="varying")``) before differentiating;
  each replica's gradient is then its own, and the reduction is the explicit ``reduce`` argument
  (``lax.pmean``, the average; a test plants ``psum``).
- All shards must have one shape. A global batch of L samples that N does not divide splits into
  shards of ``ceil(L/N)`` and ``floor(L/N)`` (``replicas.shards``). Each replica's block is padded
  to the largest shard with the batch's first sample, and the replica takes, through
  ``lax.switch`` on its ``axis_index``, the branch compiled for its own shard's size: that branch
  slices exactly its real rows, so its loss, gradients and batchnorm statistics never see a pad.
  A replica left without a sample (L < N) runs that first sample as a stand-in with weight 0.
  Nothing is dropped or approximated: the step is exact for every L.
- Batchnorm's moving statistics are replica 0's (DDP broadcasts its buffers): a ``psum`` of the
  statistics masked to replica 0 (adding zeros is exact) gives every replica replica 0's.

Each distinct ``Plan`` (shard sizes and weights of a global batch) compiles once: the full batches
share one, the epoch's short last batch has its own.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...spec.model import kernel_mask, trainable_mask
from ...spec.workload import Workload
from .adapter import _update
from .graph import Params, make_forward

#: The mesh axis of the replicas.
AXIS = "replica"


class Plan(NamedTuple):
    """How one global batch is spread over the replicas; static, so one compiled step per plan."""

    counts: tuple[int, ...]  # samples of each replica's shard
    weights: tuple[float, ...]  # each replica's weight on its mean loss (``replicas.weights``)
    rows: int  # rows of each replica's block: the largest shard (at least 1: the stand-in)
    size: int  # samples of the global batch (the epoch's loss total weighs the step's loss by it)


def layout(order: np.ndarray, spans: Sequence[tuple[int, int]], split: Callable[[int], list],
           replicas: int) -> tuple[np.ndarray, list[int], list[Plan]]:
    """Where each replica's shards go: (indices into the training arrays, replica-major, so that
    splitting them into N equal contiguous parts gives replica r its segment; the offset of each
    global batch's block within a segment; each batch's plan). ``spans`` are the global batches as
    (start, size) in ``order``; ``split(size)`` gives each replica's (start, stop, weight) in one.
    A block is the replica's shard padded to the plan's rows with the batch's first sample."""
    segments: list[list[np.ndarray]] = [[] for _ in range(replicas)]
    offsets, plans, at = [], [], 0
    for start, size in spans:
        parts = split(size)
        counts = tuple(b - a for a, b, _ in parts)
        rows = max(max(counts), 1)
        for r, (a, b, _) in enumerate(parts):
            shard = np.asarray(order[start + a:start + b])
            segments[r].append(np.concatenate([shard, np.full(rows - len(shard), order[start], shard.dtype)]))
        plans.append(Plan(counts, tuple(float(w) for _, _, w in parts), rows, size))
        offsets.append(at)
        at += rows
    return np.concatenate([np.concatenate(s) for s in segments]).astype(np.int32), offsets, plans


def make_step(workload: Workload, compute: Any, lr: float, reduce: Callable[[Params], Params]) -> Callable:
    """``step(params, opt, acc, x, y, start, key, plan)``, inside ``shard_map``: this replica's
    block of ``x``/``y`` (its rows from ``start``), its weighted loss and gradients, the gradients
    reduced by ``reduce``, the update (Keras' rules, as ``jax.py``) at learning rate ``lr``;
    returns (params, opt, acc, the global batch's loss). ``key=None``: dropout off."""
    t = workload.training
    logits_fn, g = make_forward(workload)
    mask = trainable_mask(g)
    kernels = [k for k, tr in zip(kernel_mask(g), mask) if tr]
    momenta = [n.layer.momentum for n in g.nodes if n.kind == "batchnorm" for _ in (0, 1)]
    decay = t.weight_decay
    l2 = decay.rate if decay is not None and decay.kind == "l2" else 0.0
    decoupled = decay.rate * lr if decay is not None and decay.kind == "decoupled" else 0.0

    def merge(train: Params, frozen: Params) -> Params:
        it_t, it_f = iter(train), iter(frozen)
        return [next(it_t) if m else next(it_f) for m in mask]

    def split(params: Params) -> tuple[Params, Params]:
        return [p for p, m in zip(params, mask) if m], [p for p, m in zip(params, mask) if not m]

    def loss_fn(train: Params, frozen: Params, x: jax.Array, y: jax.Array, key: Optional[jax.Array]):
        z, stats = logits_fn([p.astype(compute) for p in merge(train, frozen)], x.astype(compute), key, True)
        z = z.astype(jnp.float32)
        loss = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z), y[:, None], axis=1))
        if l2:
            loss = loss + l2 * sum(jnp.sum(jnp.square(p)) for p, k in zip(train, kernels) if k)
        return loss, (z, stats)

    def shard(params: Params, x: jax.Array, y: jax.Array, start: jax.Array, key: Optional[jax.Array],
              count: int) -> tuple:
        """This replica's (mean loss, gradients, batch statistics, hits) on its ``count`` real rows."""
        n = max(count, 1)  # 0: the stand-in, weighted 0
        xb, yb = lax.dynamic_slice_in_dim(x, start, n), lax.dynamic_slice_in_dim(y, start, n)
        # Per-replica values, so that differentiating does not sum the replicas' gradients.
        train, frozen = split([lax.pcast(p, AXIS, to="varying") for p in params])
        (loss, (z, stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(train, frozen, xb, yb, key)
        hits = jnp.sum(jnp.argmax(z, axis=1) == yb).astype(jnp.int32) * (1 if count else 0)
        return loss, grads, [s for pair in stats for s in pair], hits

    def step(params: Params, opt: dict, acc: tuple, x: jax.Array, y: jax.Array, start: Any,
             key: Optional[jax.Array], plan: Plan):
        r = lax.axis_index(AXIS)
        sizes = sorted(set(plan.counts))
        branches = [partial(shard, count=c) for c in sizes]
        if len(branches) == 1:
            loss, grads, batch, hits = branches[0](params, x, y, start, key)
        else:  # shards of different sizes: each replica runs the branch of its own size
            which = jnp.asarray([sizes.index(c) for c in plan.counts], jnp.int32)[r]
            loss, grads, batch, hits = lax.switch(which, branches, params, x, y, start, key)
        if set(plan.weights) != {1.0}:
            weight = jnp.asarray(plan.weights, jnp.float32)[r]
            loss, grads = loss * weight, [gi * weight for gi in grads]
        grads = reduce(grads)
        loss = lax.pmean(loss, AXIS)  # sum over r of (n_r / L) * loss_r: the global batch's mean loss
        hits = lax.psum(hits, AXIS)
        batch = [lax.psum(jnp.where(r == 0, s, jnp.zeros_like(s)), AXIS) for s in batch]  # replica 0's
        train, frozen = split(params)
        if decoupled:  # Keras 3's weight_decay, before the update
            train = [p * (1.0 - decoupled) if k else p for p, k in zip(train, kernels)]
        train, opt = _update(t.optimizer, lr, t.momentum, train, grads, opt, t.nesterov)
        frozen = [m * f + (1.0 - m) * b for f, b, m in zip(frozen, batch, momenta)]
        acc = (acc[0] + loss * plan.size, acc[1] + hits)
        return merge(train, frozen), opt, acc, loss

    return step


def compile_steps(step: Callable, mesh: Any, k: int, unroll: int) -> tuple[Callable, Callable, Callable]:
    """The jitted ``shard_map``s of ``step``: ``one`` (a global batch at a block offset, dropout key
    ``fold_in(fold_in(key, i), replica)``), ``block`` (K full batches in ``lax.scan``, the same keys)
    and ``fixed`` (one batch, dropout off: the trajectory check). Parameters, optimizer state,
    totals and key are replicated; the arrays' rows are split over the replicas."""
    from jax.sharding import PartitionSpec as P

    rep, rows = P(), P(AXIS)

    def sharded(body: Callable, n_rep_tail: int, n_out: int) -> Callable:
        return jax.shard_map(body, mesh=mesh, in_specs=(rep, rep, rep, rows, rows) + (rep,) * n_rep_tail,
                             out_specs=(rep,) * n_out)

    def key_of(key: jax.Array, i: Any) -> jax.Array:
        return jax.random.fold_in(jax.random.fold_in(key, i), lax.axis_index(AXIS))

    @partial(jax.jit, static_argnames=("plan",), donate_argnums=(0, 1, 2))
    def one(params, opt, acc, x, y, start, key, i, plan):
        def body(params, opt, acc, x, y, start, key, i):
            return step(params, opt, acc, x, y, start, key_of(key, i), plan)[:3]
        return sharded(body, 3, 3)(params, opt, acc, x, y, start, key, i)

    @partial(jax.jit, static_argnames=("plan",), donate_argnums=(0, 1, 2))
    def block(params, opt, acc, x, y, start, key, s0, plan):
        def body(params, opt, acc, x, y, start, key, s0):
            n = plan.rows
            xs = lax.dynamic_slice_in_dim(x, start, k * n).reshape((k, n) + x.shape[1:])
            ys = lax.dynamic_slice_in_dim(y, start, k * n).reshape(k, n)

            def scan_body(carry, batch):
                p, o, a = carry
                xb, yb, j = batch
                p, o, a, _ = step(p, o, a, xb, yb, 0, key_of(key, s0 + j), plan)
                return (p, o, a), None

            carry, _ = lax.scan(scan_body, (params, opt, acc), (xs, ys, jnp.arange(k, dtype=jnp.int32)),
                                unroll=unroll)
            return carry
        return sharded(body, 3, 3)(params, opt, acc, x, y, start, key, s0)

    @partial(jax.jit, static_argnames=("plan",))
    def fixed(params, opt, x, y, plan):
        def body(params, opt, x, y):
            zero = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
            params, opt, _, loss = step(params, opt, zero, x, y, 0, None, plan)
            return params, opt, loss
        return jax.shard_map(body, mesh=mesh, in_specs=(rep, rep, rows, rows), out_specs=(rep, rep, rep))(
            params, opt, x, y)

    return one, block, fixed

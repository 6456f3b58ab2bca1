"""Apache TVM adapter (inference only): the spec as a Relax graph, compiled for the host CPU.

Modes: ``default`` compiles with TVM's Relax pipeline for the ``llvm`` target (legalize, fuse,
lower) plus a fixed CPU schedule, parallel and vectorized (``schedule.py``; TVM's own CPU
pipeline schedules nothing); no schedule search. ``tuned`` additionally searches schedules with
MetaSchedule in ``tune()`` (``tuning.py``: the fixed schedule's register-tile sizes searched, trials
where the runtime goes, and a searched schedule kept only for a kernel where it measured faster than
the fixed one), recompiles with the resulting
database (the fixed schedule for every other kernel), and keeps the tuned executable only if it runs
a batch faster than the default one. The database is cached per workload definition, target and
trial budget, so a later run reuses it (the ``tune`` row's notes say which).

A CNN's graph is built directly with ``relax.BlockBuilder`` in NHWC/HWIO, the canonical layout, so the
shared weights go in unchanged and the input needs no transpose. A transformer (any of
``spec.TRANSFORMER_LAYERS``) is the spec's ONNX graph (``onnx_graph.py``, the one onnxruntime and
OpenVINO run) read by TVM's Relax ONNX frontend, its initializers passed as ``main``'s parameters;
so is a decoder language model (any of ``spec.DECODER_LAYERS``: token ids in, ``(T, vocab)``
probabilities out per sample).
The executable is compiled for one static batch, the workload's inference batch size: MetaSchedule
tunes static shapes only, and one shape means parity checks the very kernels that inference times.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import tvm
from tvm import relax

from ...errors import BackendUnavailable
from ...paths import compile_cache_dir
from ...spec.graph import INPUT as GRAPH_INPUT
from ...spec.graph import Node, resolve
from ...spec.layers import ActivationLayer, Add, BatchNorm, Conv2D, Dense, Dropout, Flatten, GlobalAvgPool, MaxPool2D
from ...spec.model import vocabulary
from ...spec.workload import Workload
from ..base import Backend
from ..spec import DECODER_LAYERS, TRANSFORMER_LAYERS
from . import tuning
from .schedule import compile_module

#: Layouts of the Relax graph; the canonical ones, so weights and inputs need no conversion.
DATA_LAYOUT = "NHWC"
KERNEL_LAYOUT = "HWIO"
DEFAULT_TUNE_TRIALS = 64


@dataclass
class Batches:
    """An input split into device tensors of the compiled batch size (the last one zero-padded)."""

    chunks: list[Any]
    n: int


@dataclass
class Scores:
    """Per-chunk output tensors of one ``scores`` call; ``to_host`` joins them and drops the padding."""

    chunks: list[Any]
    n: int


def _activation(x: relax.Expr, name: str) -> relax.Expr:
    if name == "none":
        return x
    if name == "softmax":
        return relax.op.nn.softmax(x, axis=-1)
    return {"relu": relax.op.nn.relu, "tanh": relax.op.tanh, "sigmoid": relax.op.sigmoid}[name](x)


def _pads(node: Node) -> tuple[int, int, int, int]:
    (top, bottom), (left, right) = node.pads  # type: ignore[misc]
    return top, left, bottom, right


def _relax_node(bb: relax.BlockBuilder, node: Node, ins: list, w: list, batch: int) -> relax.Expr:
    """One graph node's Relax expression (before its activation), NHWC/HWIO throughout."""
    layer, h = node.layer, ins[0]
    if isinstance(layer, Conv2D):
        h = bb.emit(relax.op.nn.conv2d(h, w[0], strides=layer.stride, padding=_pads(node),
                                       data_layout=DATA_LAYOUT, kernel_layout=KERNEL_LAYOUT))
        return relax.op.add(h, w[1]) if layer.use_bias else h
    if isinstance(layer, MaxPool2D):
        # TVM pads a max-pool with the lowest value: a pad never wins a max.
        return relax.op.nn.max_pool2d(h, layer.pool_size, layer.stride or layer.pool_size, padding=_pads(node),
                                      layout=DATA_LAYOUT)
    if isinstance(layer, Dense):
        return relax.op.add(relax.op.matmul(h, w[0]), w[1])
    if isinstance(layer, BatchNorm):
        # Inference mode, written out: (x - mean) * gamma / sqrt(var + eps) + beta on the moving statistics.
        gamma, beta, mean, var = w
        scale = bb.emit(relax.op.divide(gamma, relax.op.sqrt(relax.op.add(var, relax.const(layer.epsilon, "float32")))))
        return relax.op.add(relax.op.multiply(relax.op.subtract(h, mean), scale), beta)
    if isinstance(layer, Add):
        for other in ins[1:]:
            h = bb.emit(relax.op.add(h, other))
        return h
    if isinstance(layer, GlobalAvgPool):
        return relax.op.mean(h, axis=[1, 2])
    if isinstance(layer, Flatten):
        return relax.op.reshape(h, (batch, -1))  # NHWC order, as the dense rows expect
    if isinstance(layer, (Dropout, ActivationLayer)):
        return h  # dropout: the identity at inference
    raise TypeError(f"{node.label()}: no Relax translation")


def relax_module(workload: Workload, batch: int) -> tvm.IRModule:
    """``main(x, w0, w1, ...)`` -> class probabilities, for a static batch of ``batch``; the
    parameters are the canonical weight list, in order."""
    f32 = "float32"
    graph = resolve(workload)
    x = relax.Var("x", relax.TensorType((batch, *workload.input_shape), f32))
    params = [relax.Var(f"p{i}", relax.TensorType(shape, f32)) for i, shape in enumerate(graph.weight_shapes())]
    bb = relax.BlockBuilder()
    with bb.function("main", [x, *params]):
        with bb.dataflow():
            values: dict[int, relax.Expr] = {GRAPH_INPUT: x}
            for node in graph.nodes:
                out = _relax_node(bb, node, [values[j] for j in node.inputs], graph.weights_of(node, params), batch)
                values[node.index] = bb.emit(_activation(out, node.activation))
            out = bb.emit_output(values[graph.output.index])
        bb.emit_func_output(out)
    return bb.get()


def onnx_module(workload: Workload, weights: Sequence[np.ndarray], batch: int) -> tuple[tvm.IRModule, list[Any]]:
    """The spec's ONNX graph for a static batch of ``batch`` through TVM's Relax ONNX frontend:
    ``main(x, *params)`` and its params (the graph's initializers, converted as that graph has them)."""
    try:
        from tvm.relax.frontend.onnx import from_onnx

        from ..onnx import graph as onnx_graph
    except ImportError as exc:
        raise BackendUnavailable(f"tvm: a transformer is read from its ONNX graph, which needs {exc.name} "
                                 "(pip install onnx)") from None
    proto = onnx_graph.build_model(workload, weights, batch_size=batch)
    mod = from_onnx(proto, shape_dict={onnx_graph.INPUT: [batch, *workload.input_shape]}, keep_params_in_input=True)
    mod, params = relax.frontend.detach_params(mod)
    return mod, list(params["main"])


def device_params(weights: Sequence[np.ndarray], dev: Any) -> list[Any]:
    """The shared weights as device tensors, in the order of ``main``'s parameters (no conversion:
    the graph's layouts are the canonical ones)."""
    return [tvm.runtime.tensor(np.ascontiguousarray(w, np.float32), dev) for w in weights]


def host_target(threads: int) -> tvm.target.Target:
    """``llvm`` for this CPU (LLVM's host CPU name) with ``num-cores`` for parallel schedules."""
    cpu = tvm.target.codegen.llvm_get_system_cpu()
    return tvm.target.Target({"kind": "llvm", "mcpu": cpu, "num-cores": threads})


class TVMBackend(Backend):
    name = "tvm"
    #: --generate: not built. The Relax module is compiled for one fixed input shape (the whole
    #: context); a cached decode needs a second module taking the cache, at a growing past length.
    generation_note = ("no key/value cache path: its Relax module is compiled for the whole context's fixed "
                       "shape, and a decode module with the cache as inputs is not built")

    def __init__(self, workload: Workload, device: str, mode: str = "default", precision: str = "fp32",
                 options: Optional[Mapping[str, Any]] = None):
        super().__init__(workload, device, mode, precision, options)
        if device != "cpu":
            raise BackendUnavailable(f"tvm: this adapter compiles for the host CPU (llvm) only, not '{device}'; "
                                     "use --device cpu")
        self._threads = int(self.options.threads or os.cpu_count() or 1)
        # TVM's runtime thread pool reads this when it starts (at the first parallel kernel);
        # MetaSchedule's measuring processes inherit it.
        os.environ["TVM_NUM_THREADS"] = str(self._threads)
        self.target = host_target(self._threads)
        self.batch = workload.inference.batch_size
        self.dev = tvm.cpu(0)
        self._mod: Optional[tvm.IRModule] = None
        self._vm: Optional[relax.VirtualMachine] = None
        self._params: list[Any] = []

    # --- identity ---------------------------------------------------------------------------
    @classmethod
    def probe(cls) -> dict:
        return {"version": tvm.__version__, "devices": [f"cpu (llvm -mcpu={tvm.target.codegen.llvm_get_system_cpu()})"]}

    def version(self) -> str:
        return tvm.__version__

    def device_id(self) -> str:
        return "cpu"

    def threads(self) -> int:
        return self._threads

    def details(self) -> dict[str, Any]:
        return {"target": f"llvm -mcpu={self.target.attrs['mcpu']} -num-cores={self._threads}",
                "batch": str(self.batch)}

    # --- lifecycle --------------------------------------------------------------------------
    def build(self, weights: Sequence[np.ndarray]) -> int:
        """Compile with the fixed CPU schedule (both modes: ``tuned`` recompiles in ``tune()``)."""
        if vocabulary(self.workload) & set(TRANSFORMER_LAYERS + DECODER_LAYERS):
            self._mod, params = onnx_module(self.workload, weights, self.batch)
            self._params = params  # tensors on the host CPU, self.dev
        else:
            self._mod = relax_module(self.workload, self.batch)
            self._params = device_params(weights, self.dev)
        executable = compile_module(self._mod, self.target)
        self._vm = relax.VirtualMachine(executable, self.dev)
        return int(sum(w.size for w in weights))

    def tune(self) -> Optional[str]:
        """``tuned``: search (or reuse the cached database), recompile with it, and keep whichever of
        the tuned and the default executable runs a batch faster (``tuning``: the per-task choice)."""
        if self.mode != "tuned":
            return None
        assert self._mod is not None and self._vm is not None, "build() first"
        trials = int(self.options.tune_trials or DEFAULT_TUNE_TRIALS)
        folder = self.database_dir(trials)
        started = time.perf_counter()
        if (folder / "summary.json").is_file():
            summary = json.loads((folder / "summary.json").read_text())
            what = (f"reused database {folder} ({summary['records']} trials over {summary['tasks']} tasks, "
                    f"searched schedule kept for {summary['searched']})")
        else:
            summary = tuning.tune(self._mod, self.target, folder, trials, self._threads, self.workload.seed)
            what = (f"searched {summary['records']} trials (budget {summary['trials']}) over {summary['tasks']} "
                    f"tasks in {summary['seconds']:.1f} s (cost model {summary['cost_model']}), searched schedule "
                    f"kept for {summary['searched']} ({_choices(summary)}); database {folder}")
        searched = time.perf_counter() - started
        if not summary["searched"]:
            return f"{what}; every kernel keeps the default schedule, as tvm:default"
        tuned = relax.VirtualMachine(compile_module(self._mod, self.target, tuning.chosen_database(folder)), self.dev)
        compiled = time.perf_counter() - started - searched
        t_tuned, t_default = self._batch_seconds([tuned, self._vm])
        keep = t_tuned < t_default
        if keep:
            self._vm = tuned
        return (f"{what}; compiled with it in {compiled:.1f} s; a batch: tuned {t_tuned * 1e3:.2f} ms, default "
                f"{t_default * 1e3:.2f} ms, {'tuned' if keep else 'default'} executable kept")

    def _batch_seconds(self, vms: list[relax.VirtualMachine], rounds: int = 7) -> list[float]:
        """Median seconds of one call of each executable on a batch of the compiled size (random
        data), after a warm-up, the executables called in turn round after round, so that a burst of
        load on a shared machine lands on both: the module-level check between the tuned and the
        default executable, outside timed passes."""
        x = tvm.runtime.tensor(np.random.default_rng(0).random((self.batch, *self.workload.input_shape),
                                                              dtype=np.float32), self.dev)
        mains = [vm["main"] for vm in vms]
        for main in mains:
            main(x, *self._params)
        times: list[list[float]] = [[] for _ in mains]
        for _ in range(rounds):
            for main, spent in zip(mains, times):
                start = time.perf_counter()
                main(x, *self._params)
                self.dev.sync()
                spent.append(time.perf_counter() - start)
        return [float(np.median(t)) for t in times]

    def database_dir(self, trials: int) -> Path:
        """Cache folder of the tuning database: what the kernels depend on (the layers, the input
        shape, the compiled batch) x target x trial budget. Not the whole workload hash: --limit or
        --epochs change nothing the compiled kernels see, and must not force a new search."""
        w = self.workload
        kernels = json.dumps([w.model_dump(mode="json")["model"], list(w.input_shape), w.inference.batch_size])
        digest = hashlib.sha256((kernels + str(self.target)).encode()).hexdigest()[:12]
        return compile_cache_dir() / "tvm" / f"{w.name}-{digest}-t{trials}"

    def compile_cache(self) -> Optional[Path]:
        """``tuned``: the tuning database (the search is what a warm run skips)."""
        return self.database_dir(int(self.options.tune_trials or DEFAULT_TUNE_TRIALS)) if self.mode == "tuned" else None

    # --- inference --------------------------------------------------------------------------
    def to_device(self, x: np.ndarray) -> Batches:
        """Chunks of the compiled batch size on the device; the last one padded with zeros."""
        x = np.ascontiguousarray(x, np.float32)
        n, b = len(x), self.batch
        chunks = []
        for start in range(0, n, b):
            part = x[start:start + b]
            if len(part) < b:  # one shape, one set of (tuned) kernels; the padded rows are dropped
                part = np.concatenate([part, np.zeros((b - len(part), *x.shape[1:]), np.float32)])
            chunks.append(tvm.runtime.tensor(part, self.dev))
        return Batches(chunks, n)

    def scores(self, x: Batches, batch_size: int) -> Scores:
        """Probabilities, one VM call per chunk of the compiled batch size.

        The worker times only the workload's inference batch size, which is the compiled one;
        other sizes (parity, validation) run as chunks of it, on the same kernels.
        """
        assert self._vm is not None, "build() first"
        main = self._vm["main"]
        return Scores([main(chunk, *self._params) for chunk in x.chunks], x.n)

    def to_host(self, value: Any) -> Any:
        if isinstance(value, Scores):
            if not value.chunks:
                return np.zeros((0, *resolve(self.workload).output.out_shape), np.float32)
            return np.concatenate([c.numpy() for c in value.chunks])[: value.n]
        return np.asarray(value)

    def sync(self) -> None:
        self.dev.sync()


def _choices(summary: Mapping[str, Any]) -> str:
    """Each searched task's choice, as ``name trials: default 1.20 ms / searched 0.90 ms -> searched``."""
    parts = []
    for t in summary["per_task"]:
        if t["trials"]:
            d, s = t["duel_default_s"], t["duel_searched_s"]
            times = f"default {d * 1e3:.3g} ms / searched {s * 1e3:.3g} ms" if d is not None and s is not None \
                else "no searched schedule"
            parts.append(f"{t['name']} x{t['trials']}: {times} -> {t['chosen']}")
    return "; ".join(parts)

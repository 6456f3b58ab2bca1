"""Apache TVM adapter (inference only): the spec as a Relax graph, compiled for the host CPU.

Modes: ``default`` compiles with TVM's Relax pipeline for the ``llvm`` target (legalize, fuse,
lower) plus a fixed CPU schedule, parallel and vectorized (``tvm_schedule.py``; TVM's own CPU
pipeline schedules nothing); no schedule search. ``tuned`` additionally searches schedules with
MetaSchedule in ``tune()`` and recompiles with the resulting database (the fixed schedule for any
kernel the search left without a record), which is cached per workload definition, target and trial
budget, so a later run reuses it.

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

import contextlib
import hashlib
import importlib
import inspect
import json
import linecache
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

import numpy as np
import tvm
from tvm import relax
from tvm.s_tir import meta_schedule as ms

from ...errors import BackendUnavailable
from ...paths import cache_dir
from ...spec.graph import INPUT as GRAPH_INPUT
from ...spec.graph import Node, resolve
from ...spec.layers import ActivationLayer, Add, BatchNorm, Conv2D, Dense, Dropout, Flatten, GlobalAvgPool, MaxPool2D
from ...spec.model import vocabulary
from ...spec.workload import Workload
from ..base import Backend
from ..spec import DECODER_LAYERS, TRANSFORMER_LAYERS
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
        """``tuned``: search (or reuse the cached database), then recompile with it."""
        if self.mode != "tuned":
            return None
        assert self._mod is not None, "build() first"
        trials = int(self.options.tune_trials or DEFAULT_TUNE_TRIALS)
        folder = self.database_dir(trials)
        started = time.perf_counter()
        if (folder / "summary.json").is_file():
            summary = json.loads((folder / "summary.json").read_text())
            what = f"reused database {folder} ({summary['records']} trials over {summary['tasks']} tasks)"
        else:
            summary = self._search(folder, trials)
            what = (f"searched {summary['records']} trials (budget {summary['trials']}) over {summary['tasks']} "
                    f"tasks in {summary['seconds']:.1f} s (cost model {summary['cost_model']}); database {folder}")
        searched = time.perf_counter() - started
        database = ms.database.JSONDatabase(str(folder / "workloads.json"), str(folder / "records.json"),
                                            allow_missing=False)
        executable = compile_module(self._mod, self.target, database)
        self._vm = relax.VirtualMachine(executable, self.dev)
        compiled = time.perf_counter() - started - searched
        return f"{what}; compiled with it in {compiled:.1f} s"

    def database_dir(self, trials: int) -> Path:
        """Cache folder of the tuning database: what the kernels depend on (the layers, the input
        shape, the compiled batch) x target x trial budget. Not the whole workload hash: --limit or
        --epochs change nothing the compiled kernels see, and must not force a new search."""
        w = self.workload
        kernels = json.dumps([w.model_dump(mode="json")["model"], list(w.input_shape), w.inference.batch_size])
        digest = hashlib.sha256((kernels + str(self.target)).encode()).hexdigest()[:12]
        return cache_dir() / "tvm" / f"{w.name}-{digest}-t{trials}"

    def _search(self, folder: Path, trials: int) -> dict[str, Any]:
        assert self._mod is not None
        started = time.perf_counter()
        # TVM 0.27 extracts tasks from fused TIR only; these are the passes compile_relax runs
        # before applying the database, so the tuned workloads match what gets compiled.
        prepare = tvm.transform.Sequential(relax.pipeline.library_dispatch_passes(self.target)
                                           + relax.pipeline.legalize_passes(self.target))
        with self.target:
            fused = prepare(self._mod)
        tasks = ms.relax_integration.extract_tasks(fused, self.target)
        with _cheap_stack():  # MetaSchedule's schedule rules import the intrinsics on first use
            importlib.import_module("tvm.s_tir.tensor_intrin")
        cost_model = "xgb" if _has_xgboost() else "random"
        folder.parent.mkdir(parents=True, exist_ok=True)
        # Search into a scratch folder and move it in place at the end, so that an interrupted
        # search never leaves a database that a later run would take as complete.
        scratch = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
        try:
            # The evolutionary search's population scales with the budget (512 is TVM's default):
            # a population of 512 per task costs minutes on two cores for a handful of trials.
            per_task = max(1, trials // max(1, len(tasks)))
            strategy = ms.search_strategy.EvolutionarySearch(population_size=min(512, max(32, 16 * per_task)))
            contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(
                tasks, work_dir=str(scratch), strategy=strategy, num_threads=self._threads, seed=self.workload.seed)
            database = ms.database.JSONDatabase(str(scratch / "workloads.json"), str(scratch / "records.json"))
            # An equal share per task, measured in one round, so that a small budget still
            # reaches every task (the scheduler otherwise spends it on the first ones).
            ms.tune.tune_tasks(tasks=contexts, task_weights=weights, work_dir=str(scratch),
                               builder=ms.builder.LocalBuilder(max_workers=self._threads, f_build=build_trial),
                               max_trials_global=max(trials, per_task), max_trials_per_task=per_task,
                               num_trials_per_iter=min(64, per_task), database=database, cost_model=cost_model)
            summary = {"trials": trials, "tasks": len(contexts), "records": len(database),
                       "seconds": time.perf_counter() - started, "cost_model": cost_model,
                       "target": str(self.target), "tvm": tvm.__version__}
            (scratch / "summary.json").write_text(json.dumps(summary, indent=1))
            shutil.rmtree(scratch / "logs", ignore_errors=True)
            if folder.exists():  # a concurrent run finished first; theirs is as good
                shutil.rmtree(scratch)
            else:
                scratch.rename(folder)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        return summary

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


def build_trial(mod: tvm.IRModule, target: tvm.target.Target, params: Any) -> Any:
    """MetaSchedule's default trial build, without its ``import tvm.s_tir.tensor_intrin``.

    That import parses every vendor's tensor intrinsics (tens of seconds) in each fresh builder
    process (MetaSchedule starts one per round), which runs past the builder's 30 s timeout on a
    busy machine, so every trial fails. Trials arrive already scheduled (tensorized or not), so
    building them needs no intrinsic registry.
    """
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    return tvm.tirx.build(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod), target=target)


@contextlib.contextmanager
def _cheap_stack() -> Iterator[None]:
    """``inspect.stack()`` without its per-frame module search, while TVM's tensor intrinsics import.

    Each of their ~500 ``@T.prim_func`` decorators calls ``inspect.stack()``, whose frame records
    look up each frame's module over all of ``sys.modules``: 21 s of a tuned cell here (2 s with
    this). TVMScript reads only the frame, file, line number and the line's text of each record,
    which are taken straight from the frame and ``linecache`` here.
    """
    real = inspect.stack

    def stack(context: int = 1) -> list[inspect.FrameInfo]:
        frame, out = sys._getframe(1), []
        while frame is not None:
            code = frame.f_code
            line = linecache.getline(code.co_filename, frame.f_lineno) if context else ""
            lines, index = ([line], 0) if line else (None, None)
            try:
                info = inspect.FrameInfo(frame, code.co_filename, frame.f_lineno, code.co_name, lines, index,
                                         positions=None)
            except TypeError:  # Python < 3.11: no positions
                info = inspect.FrameInfo(frame, code.co_filename, frame.f_lineno, code.co_name, lines, index)
            out.append(info)
            frame = frame.f_back
        return out

    inspect.stack = stack
    try:
        yield
    finally:
        inspect.stack = real


def _has_xgboost() -> bool:
    import importlib.util

    return importlib.util.find_spec("xgboost") is not None

"""OpenVINO adapter (inference only): the spec's ONNX graph compiled by an OpenVINO plugin.

OpenVINO's CPU plugin runs bf16 by default wherever the CPU can (AMX, and also AVX512_BF16):
fp32 results would then miss the fp32 parity tolerance. The precision is therefore always
set (``INFERENCE_PRECISION_HINT``) and the one the compiled model actually uses is read back.

Data placement (``Backend.place_data``): the CPU plugin's device memory is host memory, and
``share_inputs=True`` hands it the NumPy split's batches without a copy, so the arrays are on the
device. The GPU plugin (Intel GPUs) would copy each NumPy batch to the GPU inside the clock (a
``RemoteTensor`` in the GPU's context would hold it there; not done here): ``data_on_device`` is
False there, with the reason in the build notes. OpenVINO has no memory counter.

Generation (``onnx/generation.py``: optimum's prefill and decode graphs, each compiled with the
cell's precision and performance hints, on the first ``start_generation``) uses plain inputs and
outputs, not OpenVINO's stateful-model transformation (which would keep the cache inside the
request as a ``ReadValue``/``Assign`` state; on gpt-nano it decoded no faster: 0.40 against 0.37 ms
a token): the ``present`` tensors of one step are set, without a copy, as the ``past`` inputs of
the next. Two decode requests take turns, so that a step never
writes outputs over the tensors it is reading; the ids come back as a NumPy copy (``batch`` int32).
With the bf16 hint the graphs' inputs and outputs, the cache included, stay float32.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Mapping, Optional, Sequence

import numpy as np

# `import openvino` sends a usage-telemetry event from a forked process (its converter imports
# openvino_telemetry): network traffic a benchmark must not make, and a fork() of a process that
# may already run other frameworks' threads (it crashed once beside JAX). With the module marked
# absent, OpenVINO falls back to its own no-op stub.
sys.modules.setdefault("openvino_telemetry", None)  # type: ignore[arg-type]
sys.modules.setdefault("openvino_telemetry.backend", None)  # type: ignore[arg-type]
import openvino as ov  # noqa: E402

from ...errors import BackendUnavailable  # noqa: E402
from ...spec.workload import Workload  # noqa: E402
from ..base import Backend, gpu_index  # noqa: E402
from ..onnx import generation as onnx_generation  # noqa: E402
from ..onnx import graph as onnx_graph  # noqa: E402

_PRECISIONS = {"fp32": "f32", "bf16": "bf16"}
_HINTS = {"latency": "LATENCY", "throughput": "THROUGHPUT"}


class OpenVinoBackend(Backend):
    name = "openvino"
    generation_note = ""

    def __init__(self, workload: Workload, device: str, mode: str = "latency", precision: str = "fp32",
                 options: Optional[Mapping[str, Any]] = None):
        super().__init__(workload, device, mode, precision, options)
        self.core = ov.Core()
        index = gpu_index(device, self.name)
        # OpenVINO names a second GPU "GPU.1"; its GPU plugin drives Intel GPUs only.
        plugin = "CPU" if index is None else ("GPU" if index == 0 else f"GPU.{index}")
        if plugin not in self.core.available_devices:
            have = ", ".join(self.core.available_devices)
            raise BackendUnavailable(f"OpenVINO sees no {plugin} device (it has {have}); "
                                     "its GPU plugin drives Intel GPUs only")
        if precision == "bf16" and "BF16" not in self.core.get_property(plugin, "OPTIMIZATION_CAPABILITIES"):
            raise BackendUnavailable(f"OpenVINO's {plugin} plugin has no bf16 on this machine")
        self.plugin, self.index = plugin, index
        self.compiled: Optional[ov.CompiledModel] = None
        self.weights: Sequence[np.ndarray] = ()
        #: The generation graphs' requests: prefill, then the two decode requests that take turns.
        self.generator: list[ov.InferRequest] = []
        self.present: list[ov.Tensor] = []  # the cache after the last step: present.{i}.key/value
        self.layers = 0  # attention layers: the cache's

    @classmethod
    def probe(cls) -> dict:
        core = ov.Core()
        devices = [f"{d} ({core.get_property(d, 'FULL_DEVICE_NAME')})" for d in core.available_devices]
        return {"version": ov.get_version(), "devices": devices}

    def version(self) -> str:
        return ov.get_version().split("-")[0]

    def device_id(self) -> str:
        return "cpu" if self.index is None else f"gpu:{self.index}"

    def threads(self) -> int:
        return int(self.options.threads or os.cpu_count() or 1)

    def details(self) -> dict[str, Any]:
        if self.compiled is None:
            return {}
        c = self.compiled
        return {"inference_precision": self.inference_precision(),
                "performance_hint": str(c.get_property("PERFORMANCE_HINT")), "streams": c.get_property("NUM_STREAMS"),
                "requests": c.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS"), "opset": onnx_graph.OPSET}

    def inference_precision(self) -> str:
        """The precision the compiled model runs in, as OpenVINO reports it ("f32", "bf16", ...)."""
        assert self.compiled is not None
        return self.compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()

    def build(self, weights: Sequence[np.ndarray]) -> int:
        model = onnx_graph.build_model(self.workload, weights)
        self.compiled = self._compile(model)
        self.request = self.compiled.create_infer_request()
        self.queue = ov.AsyncInferQueue(self.compiled) if self.mode == "throughput" else None
        self.weights = weights  # the generation graphs are built from them when first asked for
        return onnx_graph.param_count(model)

    def _compile(self, model: Any) -> ov.CompiledModel:
        config: dict[str, Any] = {"INFERENCE_PRECISION_HINT": _PRECISIONS[self.precision],
                                  "PERFORMANCE_HINT": _HINTS[self.mode]}
        if self.options.threads:
            config["INFERENCE_NUM_THREADS"] = self.options.threads
        return self.core.compile_model(self.core.read_model(model.SerializeToString()), self.plugin, config)

    def place_data(self, nbytes: int) -> bool:
        if self.plugin == "CPU":
            return super().place_data(nbytes)
        self.data_on_device = False
        self.data_note = f"the {self.plugin} plugin is fed host NumPy batches (no RemoteTensor here)"
        return False

    def to_device(self, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x, np.float32)

    def sync(self) -> None:
        """Wait for the requests: ``infer`` returns when its request is done and ``scores`` waits for
        the throughput queue, so this finds them idle; it is still OpenVINO's own wait."""
        if self.compiled is not None:
            self.request.wait()
            if self.queue is not None:
                self.queue.wait_all()

    def scores(self, x: np.ndarray, batch_size: int) -> np.ndarray:
        out = np.empty((len(x), *onnx_graph.output_shape(self.workload)), np.float32)  # (n, T, vocab): an LM
        starts = range(0, len(x), batch_size)
        if self.queue is None:
            for s in starts:
                out[s:s + batch_size] = self.request.infer({0: x[s:s + batch_size]}, share_inputs=True,
                                                            share_outputs=True)[0]
            return out
        # THROUGHPUT: batches in flight on several streams at once; each lands in its own rows.
        def done(request: ov.InferRequest, s: int) -> None:
            out[s:s + batch_size] = request.get_output_tensor(0).data

        self.queue.set_callback(done)
        for s in starts:
            self.queue.start_async({0: x[s:s + batch_size]}, userdata=s, share_inputs=True)
        self.queue.wait_all()
        return out

    # --- generation: optimum's prefill and decode graphs, plain inputs and outputs ---------------
    def start_generation(self, batch: int, positions: int) -> None:
        onnx_generation.check(self.workload, positions, self.name)
        if not self.generator:
            prefill, decode = (self._compile(onnx_generation.build_model(self.workload, self.weights, d))
                               for d in (False, True))
            self.generator = [prefill.create_infer_request(), decode.create_infer_request(),
                              decode.create_infer_request()]
        self.layers = len(onnx_generation.attention_layers(self.workload))

    def _step(self, request: ov.InferRequest, inputs: dict[str, Any]) -> np.ndarray:
        """Run ``request``; keep its present keys and values (its own tensors, read by the next
        step), return a copy of the ids."""
        request.infer(inputs, share_inputs=True, share_outputs=True)
        self.present = [request.get_tensor(name) for name in onnx_generation.present_names(self.layers)]
        return np.array(request.get_tensor(onnx_generation.NEXT_IDS).data)

    def prefill(self, ids: np.ndarray) -> np.ndarray:
        return self._step(self.generator[0], {onnx_generation.INPUT_IDS: np.ascontiguousarray(ids, np.int32)})

    def decode(self, ids: np.ndarray, position: int) -> np.ndarray:
        request = self.generator[1 + position % 2]  # not the request whose outputs are this step's past
        inputs: dict[str, Any] = {onnx_generation.INPUT_IDS: np.ascontiguousarray(ids, np.int32).reshape(-1, 1),
                                  onnx_generation.POSITION: np.array([position], np.int64)}
        inputs.update(zip(onnx_generation.past_names(self.layers), self.present))
        return self._step(request, inputs)

    def cache_bytes(self) -> tuple[int, int]:
        return sum(int(t.byte_size) for t in self.present), int(self.present[0].shape[2]) if self.present else 0

"""ONNX Runtime adapter (inference only): the spec's ONNX graph in an ``InferenceSession``.

Data placement (``Backend.place_data``): ``to_device`` makes each split one ``OrtValue`` on the
session's device (``OrtValue.ortvalue_from_numpy(x, "cuda", index)``: one copy, before the clock),
and ``scores`` feeds it batch by batch through an ``IOBinding`` bound at offsets into that buffer,
each batch's output written at its offset into one output ``OrtValue`` on the device; so nothing
is copied inside the clock but the scores that ``to_host`` fetches. ``session.run`` with NumPy
inputs would copy every batch to the GPU inside the clock. On a CPU the same code runs (an
``OrtValue`` on "cpu" wraps the NumPy array without a copy), which keeps the CUDA path tested.
ONNX Runtime reports no free device memory and no memory counter: the arrays are taken to fit,
and ``peak_device_mb`` stays empty.

Generation (``onnx/generation.py``: optimum's prefill and decode graphs, one session each, built on
the first ``start_generation``): each graph runs through an ``IOBinding`` whose outputs ORT
allocates on the session's device; the ``present`` keys and values stay there (``OrtValue`` objects)
and are bound as the next step's ``past`` (no copy to the host), and the ids a step returns are
bound as the next step's ``input_ids`` ``[batch, 1]`` at their own buffer. Only the prompt
(prefill) and the position (decode) come from the host, inside the run.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import onnxruntime as ort

from ...errors import BackendUnavailable
from ...spec.workload import Workload
from ..base import Backend, gpu_index
from ..onnx import generation as onnx_generation
from ..onnx import graph as onnx_graph


@dataclass
class Placed:
    """An input split held by ONNX Runtime as one float32 ``OrtValue`` (n, H, W, C) on ``device``
    (ONNX Runtime's device name: "cpu" or "cuda")."""

    value: ort.OrtValue
    device: str

    def __len__(self) -> int:
        return int(self.value.shape()[0])


#: ONNX Runtime's element types, in bytes (``OrtValue.data_type()``): the cache's real dtype.
_ITEM_BYTES = {"tensor(float)": 4, "tensor(float16)": 2, "tensor(bfloat16)": 2, "tensor(double)": 8}


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"
    generation_note = ""

    def __init__(self, workload: Workload, device: str, mode: str = "default", precision: str = "fp32",
                 options: Optional[Mapping[str, Any]] = None):
        super().__init__(workload, device, mode, precision, options)
        self.index = gpu_index(device, self.name)
        provider = "CPUExecutionProvider" if self.index is None else "CUDAExecutionProvider"
        if provider not in ort.get_available_providers():
            # The CPU wheel has no CUDA provider; `onnxruntime-gpu` replaces it on CUDA machines.
            raise BackendUnavailable(f"onnxruntime has no {provider} here (available: "
                                     f"{', '.join(ort.get_available_providers())}); "
                                     "pip install onnxruntime-gpu on a CUDA machine")
        self.provider = provider
        self.math = "ieee"  # fp32 only: TF32 off on the CUDA provider (see build), none on a CPU
        #: ONNX Runtime's name of the device the inputs and outputs are bound on.
        self.ort_device = "cpu" if self.index is None else "cuda"
        self.session: Optional[ort.InferenceSession] = None
        self.binding: Optional[Any] = None
        self.out_shape = onnx_graph.output_shape(workload)  # one sample's scores
        self.weights: Sequence[np.ndarray] = ()
        #: The generation graphs' sessions and bindings (prefill, decode), made on first use.
        self.generator: Optional[tuple[ort.InferenceSession, Any, ort.InferenceSession, Any]] = None
        self.present: list[ort.OrtValue] = []  # the cache after the last step: present.{i}.key/value
        self.layers = 0  # attention layers: the cache's

    @classmethod
    def probe(cls) -> dict:
        providers = ort.get_available_providers()
        devices = ["cpu"] + (["cuda:0"] if "CUDAExecutionProvider" in providers else [])
        return {"version": ort.__version__, "devices": devices}

    def version(self) -> str:
        return ort.__version__

    def device_id(self) -> str:
        return "cpu" if self.index is None else f"cuda:{self.index}"

    def threads(self) -> int:
        return int(self.options.threads or os.cpu_count() or 1)

    def details(self) -> dict[str, Any]:
        providers = self.session.get_providers() if self.session is not None else [self.provider]
        return {"provider": providers[0], "opset": onnx_graph.OPSET, "graph_optimization": "ORT_ENABLE_ALL"}

    def build(self, weights: Sequence[np.ndarray]) -> int:
        model = onnx_graph.build_model(self.workload, weights)
        self.session = self._session(model)
        self.binding = self.session.io_binding()
        self.weights = weights  # the generation graphs are built from them when first asked for
        return onnx_graph.param_count(model)

    def _session(self, model: Any) -> ort.InferenceSession:
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if self.options.threads:
            opts.intra_op_num_threads = self.options.threads
        session = ort.InferenceSession(model.SerializeToString(), opts, providers=[self.provider_spec()])
        if session.get_providers()[0] != self.provider:
            # ORT falls back to the CPU silently when the CUDA provider fails to load (no cuDNN, ...).
            raise BackendUnavailable(f"onnxruntime could not start {self.provider}; "
                                     f"the session runs on {session.get_providers()[0]}")
        return session

    def provider_spec(self) -> Any:
        """The session's provider with its options. The CUDA provider's ``device_id``: without it
        ORT runs on GPU 0 whatever --device said. And ``use_tf32`` off: the provider runs float32
        MatMul and Conv in TF32 on Ampere or newer unless told not to, and fp32 here is strict IEEE
        on every backend (``backends/precision.py``)."""
        if self.index is None:
            return self.provider
        return self.provider, {"device_id": self.index, "use_tf32": 0}

    def to_device(self, x: np.ndarray) -> Placed:
        """``x`` as one OrtValue on the session's device (on the host when the data is not on the
        device: ONNX Runtime then copies each bound batch inside the run, inside the clock)."""
        where = self.ort_device if self.data_on_device else "cpu"
        x = np.ascontiguousarray(x, np.float32)
        return Placed(ort.OrtValue.ortvalue_from_numpy(x, where, self._id(where)), where)

    def _id(self, device: str) -> int:
        """ONNX Runtime's device_id: the GPU's index for "cuda", 0 for "cpu"."""
        return (self.index or 0) if device == "cuda" else 0

    def scores(self, x: Placed, batch_size: int) -> Any:
        """Class probabilities as one OrtValue (n, classes) on the session's device (a language
        model's (n, T, vocab)), each batch run on a slice of ``x``'s buffer and written into a slice
        of it (``to_host`` fetches it)."""
        assert self.session is not None and self.binding is not None
        n, classes = len(x), list(self.out_shape)
        if not n:
            return np.zeros((0, *classes), np.float32)
        shape = list(x.value.shape()[1:])
        out_id = self._id(self.ort_device)
        out = ort.OrtValue.ortvalue_from_shape_and_type((n, *classes), np.float32, self.ort_device, out_id)
        in_row, out_row = 4 * int(np.prod(shape)), 4 * int(np.prod(classes))  # float32 bytes per sample
        binding = self.binding
        for s in range(0, n, batch_size):
            m = min(batch_size, n - s)
            binding.bind_input(onnx_graph.INPUT, x.device, self._id(x.device), np.float32, [m, *shape],
                               x.value.data_ptr() + s * in_row)
            binding.bind_output(onnx_graph.OUTPUT, self.ort_device, out_id, np.float32, [m, *classes],
                                out.data_ptr() + s * out_row)
            self.session.run_with_iobinding(binding)
        return out

    def to_host(self, value: Any) -> Any:
        return value.numpy() if isinstance(value, ort.OrtValue) else np.asarray(value)

    def sync(self) -> None:
        """Wait for the bound outputs (the CUDA provider's stream); a real call on a CPU too."""
        if self.binding is not None:
            self.binding.synchronize_outputs()

    # --- generation: optimum's prefill and decode graphs, the cache kept as OrtValues ------------
    def start_generation(self, batch: int, positions: int) -> None:
        onnx_generation.check(self.workload, positions, self.name)
        if self.generator is None:
            prefill, decode = (self._session(onnx_generation.build_model(self.workload, self.weights, d))
                               for d in (False, True))
            self.generator = (prefill, prefill.io_binding(), decode, decode.io_binding())
        self.layers = len(onnx_generation.attention_layers(self.workload))

    def _step(self, session: ort.InferenceSession, binding: Any) -> ort.OrtValue:
        """Run ``session`` on ``binding``'s inputs with every output ORT-allocated on the device anew
        (a rebound output is a new buffer: the ids and cache just bound as inputs are not written);
        keeps the present keys and values, returns the ids."""
        for name in [onnx_generation.NEXT_IDS, *onnx_generation.present_names(self.layers)]:
            binding.bind_output(name, self.ort_device, self._id(self.ort_device))
        session.run_with_iobinding(binding)
        ids, *self.present = binding.get_outputs()
        return ids

    def prefill(self, ids: np.ndarray) -> ort.OrtValue:
        assert self.generator is not None
        session, binding = self.generator[:2]
        ids = np.ascontiguousarray(ids, np.int32)  # held until the run: the binding may read it there
        binding.bind_cpu_input(onnx_generation.INPUT_IDS, ids)
        return self._step(session, binding)

    def decode(self, ids: ort.OrtValue, position: int) -> ort.OrtValue:
        assert self.generator is not None
        session, binding = self.generator[2:]
        batch = int(ids.shape()[0])
        # The (B,) ids as the graph's [B, 1] input, read where they lie (no copy).
        binding.bind_input(onnx_generation.INPUT_IDS, self.ort_device, self._id(self.ort_device), np.int32,
                           [batch, 1], ids.data_ptr())
        where = np.array([position], np.int64)
        binding.bind_cpu_input(onnx_generation.POSITION, where)
        for name, value in zip(onnx_generation.past_names(self.layers), self.present):
            binding.bind_ortvalue_input(name, value)
        return self._step(session, binding)

    def cache_bytes(self) -> tuple[int, int]:
        nbytes = sum(int(np.prod(v.shape())) * _ITEM_BYTES[v.data_type()] for v in self.present)
        return nbytes, int(self.present[0].shape()[2]) if self.present else 0

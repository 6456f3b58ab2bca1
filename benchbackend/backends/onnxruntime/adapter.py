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
from ..onnx import graph as onnx_graph


@dataclass
class Placed:
    """An input split held by ONNX Runtime as one float32 ``OrtValue`` (n, H, W, C) on ``device``
    (ONNX Runtime's device name: "cpu" or "cuda")."""

    value: ort.OrtValue
    device: str

    def __len__(self) -> int:
        return int(self.value.shape()[0])


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"

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
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if self.options.threads:
            opts.intra_op_num_threads = self.options.threads
        provider = self.provider_spec()
        self.session = ort.InferenceSession(model.SerializeToString(), opts, providers=[provider])
        if self.session.get_providers()[0] != self.provider:
            # ORT falls back to the CPU silently when the CUDA provider fails to load (no cuDNN, ...).
            raise BackendUnavailable(f"onnxruntime could not start {self.provider}; "
                                     f"the session runs on {self.session.get_providers()[0]}")
        self.binding = self.session.io_binding()
        return onnx_graph.param_count(model)

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

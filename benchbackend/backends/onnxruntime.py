"""ONNX Runtime adapter (inference only): the spec's ONNX graph in an ``InferenceSession``."""
from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import onnxruntime as ort

from ..errors import BackendUnavailable
from ..workload import Workload
from . import onnx_graph
from .base import Backend, gpu_index


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
        self.session: Optional[ort.InferenceSession] = None

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
        return int(self.options.get("threads") or os.cpu_count() or 1)

    def details(self) -> dict[str, Any]:
        providers = self.session.get_providers() if self.session is not None else [self.provider]
        return {"provider": providers[0], "opset": onnx_graph.OPSET, "graph_optimization": "ORT_ENABLE_ALL"}

    def build(self, weights: Sequence[np.ndarray]) -> int:
        model = onnx_graph.build_model(self.workload, weights)
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if self.options.get("threads"):
            opts.intra_op_num_threads = int(self.options["threads"])
        # The CUDA provider's device_id: without it ORT runs on GPU 0 whatever --device said.
        provider = self.provider if self.index is None else (self.provider, {"device_id": self.index})
        self.session = ort.InferenceSession(model.SerializeToString(), opts, providers=[provider])
        if self.session.get_providers()[0] != self.provider:
            # ORT falls back to the CPU silently when the CUDA provider fails to load (no cuDNN, ...).
            raise BackendUnavailable(f"onnxruntime could not start {self.provider}; "
                                     f"the session runs on {self.session.get_providers()[0]}")
        return onnx_graph.param_count(model)

    def to_device(self, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x, np.float32)

    def scores(self, x: np.ndarray, batch_size: int) -> np.ndarray:
        assert self.session is not None
        if not len(x):
            return np.zeros((0, self.workload.num_classes), np.float32)
        run = self.session.run
        return np.concatenate([run([onnx_graph.OUTPUT], {onnx_graph.INPUT: x[s:s + batch_size]})[0]
                               for s in range(0, len(x), batch_size)])

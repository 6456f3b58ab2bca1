"""PyTorch adapter: a plain training loop over tensors already on the device.

Modes: ``eager`` (NCHW, the default; attention as the plain matmul chain), ``channels_last`` (model
and inputs in ``torch.channels_last``, oneDNN's preferred layout on CPU; only convolutions see it),
``compile`` (``torch.compile`` of the model; the optimizer step stays eager, as its per-step Keras
epsilon would recompile a compiled step) and ``sdpa`` (attention's core in
``F.scaled_dot_product_attention``, torch's fused kernel; networks with attention only). Modes
combine with ``+`` (``compile+channels_last``) for benchmarks. Precisions:
``fp32`` (strict: TF32 off, see ``precision.py``); ``tf32`` (CUDA, Ampere or newer); ``bf16``
(``torch.autocast``, fp32 master weights and optimizer state); ``fp16`` (autocast with a
``GradScaler``, CUDA only).

Over 400 lines: one class, each method converting one of torch's conventions to the contract's.
"""
from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...errors import BackendUnavailable
from ...spec.graph import resolve
from ...spec.model import from_nchw_weights, to_nchw_weights
from ...spec.workload import Workload
from ..base import Backend, gemm_rate, gpu_index
from ..numpy.ops import keras_adam_step_size
from ..precision import check_tf32, math_mode
from .graph import GraphNet, count

_AMP = {"fp32": None, "tf32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
#: Distinct graphs torch.compile may keep per cell: train/eval x every batch shape (training,
#: short last batch, parity, validation, inference). Past dynamo's default (8) it would silently
#: fall back to eager.
_COMPILE_GRAPHS = 64


def cuda_device(device: str, backend: str) -> torch.device:
    """The torch device ``--device`` names (``cpu``, ``gpu[:N]``, ``cuda[:N]``), or
    ``BackendUnavailable`` saying what torch sees instead (shared by torch and keras-torch)."""
    index = gpu_index(device, backend)
    if index is None:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise BackendUnavailable(f"{backend}: torch sees no CUDA GPU (torch.cuda.is_available() is False); "
                                 "use --device cpu or install a CUDA build of torch")
    if index >= torch.cuda.device_count():
        raise BackendUnavailable(f"{backend}: torch sees {torch.cuda.device_count()} CUDA GPU(s); there is no "
                                 f"cuda:{index}")
    return torch.device("cuda", index)


def synchronize(device: torch.device) -> None:
    """Wait for ``device`` (shared by torch and keras-torch); on a CPU every torch op has finished
    when it returns."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cuda_memory(device: torch.device) -> tuple[Optional[int], Optional[float]]:
    """(free bytes, peak MiB allocated since the last ``reset_cuda_peak``) of ``device`` by torch's
    own counters; (None, None) on a CPU, which keeps none. Shared by torch and keras-torch."""
    if device.type != "cuda":
        return None, None
    return torch.cuda.mem_get_info(device)[0], torch.cuda.max_memory_allocated(device) / 2**20


def reset_cuda_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def set_math(device: torch.device, precision: str, backend: str) -> str:
    """The precision rule (``backends/precision.py``) in torch, through its fp32_precision API (the
    legacy ``allow_tf32`` flags cannot be mixed with it): float32 matmuls and cuDNN convolutions
    and RNNs in IEEE fp32, or TF32 for ``tf32`` on a GPU that has it; cuDNN autotuning on. Returns
    the math mode. Shared by torch and keras-torch."""
    if precision == "tf32":
        on_gpu = device.type == "cuda"
        check_tf32(backend, torch.cuda.get_device_name(device) if on_gpu else None,
                   torch.cuda.get_device_capability(device) if on_gpu else None, str(device))
    mode = math_mode(precision)  # torch names the two modes as precision.py does
    torch.backends.cuda.matmul.fp32_precision = mode
    torch.backends.cudnn.conv.fp32_precision = mode
    torch.backends.cudnn.rnn.fp32_precision = mode
    torch.backends.cudnn.benchmark = True
    return mode


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, workload: Workload, device: str, mode: str = "eager", precision: str = "fp32",
                 options: Mapping[str, Any] | None = None):
        super().__init__(workload, device, mode, precision, options)
        if self.options.threads:
            torch.set_num_threads(self.options.threads)
        self.device = cuda_device(device, self.name)
        if self.options.replicas > 1 and workload.next_token:
            # The DDP engine (replicas.py) counts one prediction per sample; not built for tokens yet.
            raise BackendUnavailable("torch: --replicas with a language model (next-token training) is not built "
                                     "yet; run it with one replica")
        if precision not in _AMP:
            raise BackendUnavailable(f"torch: precision '{precision}' is not supported; use fp32, tf32, bf16 or fp16")
        self.math = set_math(self.device, precision, self.name)
        if precision == "fp16" and self.device.type != "cuda":
            # CPU autocast has float16 kernels for few ops and GradScaler is a CUDA tool: bf16 is
            # the CPU's reduced precision.
            raise BackendUnavailable("fp16 needs CUDA (autocast float16 + GradScaler); on CPU use --precision bf16")
        if precision == "bf16" and self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise BackendUnavailable(f"bf16: {torch.cuda.get_device_name(self.device)} has no bfloat16 support")
        parts = set(mode.split("+"))
        self.channels_last = "channels_last" in parts
        self.compiled = "compile" in parts
        self.fused_attention = "sdpa" in parts
        self.amp_dtype = _AMP[precision]
        self.net: GraphNet | None = None

    @classmethod
    def probe(cls) -> dict:
        devices = ["cpu"] + [f"cuda:{i} ({torch.cuda.get_device_name(i)})" for i in range(torch.cuda.device_count())]
        return {"version": torch.__version__, "devices": devices}

    def version(self) -> str:
        return torch.__version__

    def device_id(self) -> str:
        return str(self.device)

    def gpu_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else ""

    def threads(self) -> int:
        return torch.get_num_threads()

    def compile_cache(self) -> Optional[Path]:
        """torch.compile's cache (inductor's FX graphs, AOTAutograd's): the eager modes compile nothing."""
        if not self.compiled:
            return None
        folder = self.cache_folder("torchinductor")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
        return folder

    def details(self) -> dict[str, Any]:
        out: dict[str, Any] = {"cudnn_autotune": "on"} if self.device.type == "cuda" else {}
        if self.device.type == "cpu":
            out["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
            if self.amp_dtype is torch.bfloat16:
                # Without AVX512_BF16/AMX oneDNN emulates bf16, usually slower than fp32.
                out["onednn_bf16"] = "native" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "emulated"
        return out

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def gemm_peak(self, precision: str) -> float:
        """Best FLOP/s of a square matmul in ``precision``, synced (n 2048 and 4096 on CPU, 8192 on
        GPU; a few seconds). Inputs are of the precision's dtype (no autocast), as a GEMM peak is."""
        # tf32: float32 inputs, the matmul in TF32 (set by ``set_math``): the peak of what the cell runs.
        dtype = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        gen = torch.Generator(device=self.device).manual_seed(0)

        def make(n: int, reps: int) -> Any:
            a = torch.rand((n, n), generator=gen, device=self.device).to(dtype)
            b = torch.rand((n, n), generator=gen, device=self.device).to(dtype)

            def run() -> None:
                with torch.no_grad():
                    for _ in range(reps):
                        torch.mm(a, b)
                self.sync()
            return run

        return gemm_rate(make, cpu=self.device.type != "cuda")

    def sync(self) -> None:
        synchronize(self.device)

    def free_device_bytes(self) -> int | None:
        return cuda_memory(self.device)[0]

    def peak_device_mb(self) -> float | None:
        return cuda_memory(self.device)[1]

    def reset_device_peak(self) -> None:
        reset_cuda_peak(self.device)

    def to_host(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.item() if value.dim() == 0 else value.detach().cpu().numpy()
        return np.asarray(value)

    # --- model ------------------------------------------------------------------------------
    def build(self, weights: Sequence[np.ndarray]) -> int:
        if self.net is None:
            graph = resolve(self.workload)
            self.out_shape = graph.output.out_shape  # (classes,), or (T, vocab) for a language model
            self.net = GraphNet(graph, self.fused_attention, self.compiled).to(self.device)
            if self.channels_last:
                self.net = self.net.to(memory_format=torch.channels_last)
            self.model: nn.Module = self.net
            if self.compiled:
                import torch._dynamo as dynamo

                # ``cache_size_limit`` before torch 2.6
                limit = "recompile_limit" if hasattr(dynamo.config, "recompile_limit") else "cache_size_limit"
                setattr(dynamo.config, limit, max(getattr(dynamo.config, limit), _COMPILE_GRAPHS))
                # Static shapes: each batch shape gets its own specialized graph, as the
                # training and inference batch sizes are fixed. Compilation happens on first
                # use, so it lands in the first epoch and first inference pass.
                self.model = torch.compile(self.net, dynamic=False)
        # A second build (after the trajectory check) reloads the weights into the same modules:
        # a compiled model keeps its graphs.
        self.net.load(to_nchw_weights(self.workload, weights))
        self.net.set_mode(dropout=True, update_statistics=True)
        t = self.workload.training
        params = self.net.parameters()
        # Keras defaults, so every backend runs the same optimizer (torch's own defaults differ).
        # Weight decay is not torch's `weight_decay` (an L2 gradient on every parameter): the loss
        # takes the L2 penalty of the kernels, or the kernels are scaled before the step (decoupled).
        if t.optimizer == "sgd":
            self.opt = torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, nesterov=t.nesterov)
        elif t.optimizer == "adam":
            self.opt = torch.optim.Adam(params, lr=t.lr, betas=(0.9, 0.999), eps=1e-7)
        else:
            # Keras divides by sqrt(v + eps), torch by sqrt(v) + eps: no exact mapping exists;
            # the trajectory check (--parity-steps) shows the difference.
            self.opt = torch.optim.RMSprop(params, lr=t.lr, alpha=0.9, eps=1e-7)
        self._adam_steps = 0
        self.kernels = self.net.kernels()
        decay = t.weight_decay
        self.l2 = decay.rate if decay is not None and decay.kind == "l2" else 0.0
        self.decoupled = decay.rate * t.lr if decay is not None and decay.kind == "decoupled" else 0.0
        # fp16 gradients underflow without loss scaling; bf16 has fp32's exponent range.
        self.scaler = torch.amp.GradScaler("cuda") if self.amp_dtype is torch.float16 else None
        return count(self.net)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Cross-entropy from the logits (autocast computes it in float32), plus the L2 penalty; for
        a language model (logits (N, T, vocab), labels (N, T)) the mean over every position."""
        loss = F.cross_entropy(logits.flatten(0, -2), labels.flatten())
        if self.l2:
            loss = loss + self.l2 * sum((k * k).sum() for k in self.kernels)
        return loss

    def _backward_step(self, loss: torch.Tensor) -> None:
        self.opt.zero_grad(set_to_none=True)
        if self.scaler is None:
            loss.backward()
            self._decay()
            self._keras_adam_step()
            self.opt.step()
            return
        self.scaler.scale(loss).backward()
        self._decay()
        self._keras_adam_step()
        self.scaler.step(self.opt)  # skipped when the scaled gradients hold inf/NaN
        self.scaler.update()

    def _decay(self) -> None:
        """Decoupled weight decay, as Keras 3 applies it before the update: ``k -= k * rate * lr``."""
        if self.decoupled:
            with torch.no_grad():
                torch._foreach_mul_(self.kernels, 1.0 - self.decoupled)

    def _keras_adam_step(self) -> None:
        """Make torch's Adam take Keras' step t: ``alpha_t * m / (sqrt(v) + eps)``.

        torch computes ``(lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)``, bias corrections exact in
        float64. Keras adds eps to sqrt(v) *before* bias correction, and computes
        ``alpha_t = lr * sqrt(1 - b2^t) / (1 - b1^t)`` in float32, where 0.999 is 0.99900001287:
        6.4e-6 below the exact value at t=1, enough to move a 20-step cifar10 trajectory by 1e-2.
        So each step sets torch's eps to ``eps / sqrt(bc2)`` and its lr to ``alpha_t * bc1 / sqrt(bc2)``.
        """
        if not isinstance(self.opt, torch.optim.Adam):
            return
        if self.scaler is None:
            self._adam_steps += 1
        else:  # GradScaler may skip a step: take t from the optimizer's own count
            state = self.opt.state.get(self.opt.param_groups[0]["params"][0])
            self._adam_steps = int(state["step"]) + 1 if state else 1
        t, lr = self._adam_steps, self.workload.training.lr
        bc1, bc2 = 1.0 - 0.9 ** t, 1.0 - 0.999 ** t  # as torch computes them
        group = self.opt.param_groups[0]
        group["eps"] = 1e-7 / math.sqrt(bc2)
        group["lr"] = keras_adam_step_size(lr, 0.9, 0.999, t) * bc1 / math.sqrt(bc2)

    def get_weights(self) -> list[np.ndarray]:
        assert self.net is not None
        return from_nchw_weights(self.workload, [t.detach().cpu().numpy() for t in self.net.arrays()])

    # --- data -------------------------------------------------------------------------------
    # With ``data_on_device`` the arrays live on the device and an epoch gathers and slices them
    # there; without it they stay in host memory (``_held``) and each batch is copied in the clock.
    def _held(self) -> torch.device:
        return self.device if self.data_on_device else torch.device("cpu")

    def to_device(self, x: np.ndarray) -> torch.Tensor:
        if x.ndim != 4:  # token ids (N, T) as float32 whole numbers (the embedding casts them), or features
            return torch.from_numpy(np.ascontiguousarray(x)).to(self._held())
        if self.channels_last:  # NHWC memory seen as NCHW: channels_last already, no copy
            return torch.from_numpy(np.ascontiguousarray(x)).permute(0, 3, 1, 2).to(self._held())
        return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2))).to(self._held())

    def take(self, x: torch.Tensor, indices: np.ndarray) -> torch.Tensor:
        return x.index_select(0, torch.from_numpy(indices).to(x.device))

    def set_data(self, x_train: np.ndarray, y_train: np.ndarray) -> None:
        self.x_train = self.to_device(x_train)
        self.y_train = torch.from_numpy(y_train.astype(np.int64)).to(self._held())

    # --- run --------------------------------------------------------------------------------
    def train_epoch(self, order: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.net is not None
        self.net.train()
        idx = torch.from_numpy(order).to(self.x_train.device)
        # One gather per epoch, then views: cheaper per step than indexing every batch.
        x, y = self.x_train[idx], self.y_train[idx]
        y = y.to(self.device)  # the labels for the accuracy below (already there when on the device)
        bs = self.workload.training.batch_size
        losses, preds = [], []
        for start in range(0, len(idx), bs):
            xb, yb = x[start:start + bs].to(self.device), y[start:start + bs]  # .to: a no-op on the device
            with self._autocast():
                logits = self.model(xb)
                loss = self._loss(logits, yb)
            self._backward_step(loss)
            losses.append(loss.detach())
            preds.append(logits.detach().argmax(-1))  # a class per sample, or per position of a sequence
        n = len(idx)
        sizes = torch.tensor([len(p) for p in preds], dtype=torch.float32, device=self.device)
        loss_sum = (torch.stack(losses) * sizes).sum()  # a batch's loss is its mean over samples (positions)
        correct = (torch.cat(preds) == y).sum()
        self._losses = losses  # device scalars, stacked outside the clock (``step_losses``)
        return loss_sum / n, correct / max(y.numel(), 1)  # device scalars: the worker fetches them and syncs

    def step_losses(self) -> Optional[torch.Tensor]:
        losses = getattr(self, "_losses", None)
        return None if losses is None else torch.stack(losses).float()

    @torch.no_grad()
    def scores(self, x: torch.Tensor, batch_size: int) -> torch.Tensor:
        assert self.net is not None
        self.net.eval()
        if not len(x):
            return torch.zeros((0, *self.out_shape), device=self.device)
        with self._autocast():
            logits = torch.cat([self.model(x[s:s + batch_size].to(self.device))
                                for s in range(0, len(x), batch_size)])
        return torch.softmax(logits.float(), dim=-1)

    def train_steps(self, batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[float]:
        assert self.net is not None
        self.net.train()  # batchnorm on batch statistics, as a training step
        self.net.set_mode(dropout=False, update_statistics=True)
        losses = []
        for xb, yb in batches:
            with self._autocast():
                logits = self.model(self.to_device(xb).to(self.device))
                loss = self._loss(logits, torch.from_numpy(yb.astype(np.int64)).to(self.device))
            self._backward_step(loss)
            losses.append(loss.item())
        self.net.set_mode(dropout=True, update_statistics=True)
        return losses

    # --- generation: a static key/value cache on the same modules (``generation.py``) -----------
    generation_note = ""

    def start_generation(self, batch: int, positions: int) -> None:
        from .generation import DTYPES, generator

        if self.channels_last:
            raise BackendUnavailable("torch: channels_last is a convolution layout; generate with eager, sdpa or "
                                     "compile")
        if getattr(self, "_generator", None) is None:
            self.net.eval()
            self._generator = generator(self.net, self._autocast, self.compiled)
        self._generator.start(batch, positions, DTYPES[self.workload.generating.cache], self.device)

    def prefill(self, ids: np.ndarray) -> torch.Tensor:
        return self._generator.prefill(torch.from_numpy(ids).to(self.device))

    def decode(self, ids: torch.Tensor, position: int) -> torch.Tensor:
        return self._generator.decode(ids, position, self.device)

    def cache_bytes(self) -> tuple[int, int]:
        return self._generator.nbytes()

    @torch.no_grad()
    def train_scores(self, x: torch.Tensor) -> torch.Tensor:
        """Probabilities of a training-mode forward pass (batch statistics), dropout off, nothing updated."""
        assert self.net is not None
        self.net.train()
        self.net.set_mode(dropout=False, update_statistics=False)
        try:
            with self._autocast():
                logits = self.model(x.to(self.device))
        finally:
            self.net.set_mode(dropout=True, update_statistics=True)
        return torch.softmax(logits.float(), dim=-1)

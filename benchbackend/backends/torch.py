"""PyTorch adapter: a plain training loop over tensors already on the device."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import BackendUnavailable
from ..model import describe, flatten_input_shape, nhwc_to_nchw_rows, same_pads
from ..workload import ActivationLayer, Conv2D, Dense, Dropout, Flatten, MaxPool2D, Workload
from .base import Backend

_ACT = {"relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}
_EVAL_BATCH = 1024


def _activation(name: str, last: bool) -> list[nn.Module]:
    if name == "none" or (name == "softmax" and last):
        return []  # the final softmax is fused into the loss (cross_entropy on logits)
    if name == "softmax":
        return [nn.Softmax(dim=1)]
    return [_ACT[name]()]


class TorchBackend(Backend):
    name = "torch"
    mode = "eager"

    def __init__(self, workload: Workload, device: str):
        super().__init__(workload, device)
        if device == "cpu":
            self.device = torch.device("cpu")
        elif device in ("gpu", "cuda") or device.startswith("cuda:"):
            if not torch.cuda.is_available():
                raise BackendUnavailable("torch sees no CUDA GPU (torch.cuda.is_available() is False); "
                                         "use --device cpu or install a CUDA build of torch")
            self.device = torch.device("cuda:0" if device in ("gpu", "cuda") else device)
        else:
            raise BackendUnavailable(f"torch: unknown device '{device}'; use cpu, gpu or cuda:N")
        self.net: nn.Sequential | None = None

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

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # --- model ------------------------------------------------------------------------------
    def _layers(self) -> list[nn.Module]:
        mods: list[nn.Module] = []
        n = len(self.workload.model)
        for i, (layer, info) in enumerate(zip(self.workload.model, describe(self.workload))):
            last = i == n - 1
            if isinstance(layer, Conv2D):
                c_in = info.in_shape[2]
                pad: int | str = 0
                if layer.padding == "same":
                    ph = same_pads(info.in_shape[0], layer.kernel_size, layer.stride)
                    pw = same_pads(info.in_shape[1], layer.kernel_size, layer.stride)
                    if ph[0] == ph[1] and pw[0] == pw[1]:
                        pad = (ph[0], pw[0])  # type: ignore[assignment]
                    else:  # TF puts the odd pixel after; torch pads symmetrically
                        mods.append(nn.ZeroPad2d((pw[0], pw[1], ph[0], ph[1])))
                mods.append(nn.Conv2d(c_in, layer.filters, layer.kernel_size, layer.stride, pad))
                mods += _activation(layer.activation, last)
            elif isinstance(layer, MaxPool2D):
                mods.append(nn.MaxPool2d(layer.pool_size, layer.stride or layer.pool_size))
            elif isinstance(layer, Dropout):
                mods.append(nn.Dropout(layer.rate))
            elif isinstance(layer, Flatten):
                mods.append(nn.Flatten())
            elif isinstance(layer, Dense):
                mods.append(nn.Linear(info.in_shape[0], layer.units))
                mods += _activation(layer.activation, last)
            elif isinstance(layer, ActivationLayer):
                mods += _activation(layer.function, last)
        return mods

    def _weighted(self) -> list[nn.Module]:
        assert self.net is not None
        return [m for m in self.net if isinstance(m, (nn.Conv2d, nn.Linear))]

    def build(self, weights: Sequence[np.ndarray]) -> int:
        self.net = nn.Sequential(*self._layers()).to(self.device)
        self._load(weights)
        t = self.workload.training
        params = self.net.parameters()
        # Keras defaults, so every backend runs the same optimizer (torch's own defaults differ).
        if t.optimizer == "sgd":
            self.opt = torch.optim.SGD(params, lr=t.lr, momentum=t.momentum)
        elif t.optimizer == "adam":
            self.opt = torch.optim.Adam(params, lr=t.lr, betas=(0.9, 0.999), eps=1e-7)
        else:
            # Keras divides by sqrt(v + eps), torch by sqrt(v) + eps: no exact mapping exists;
            # the trajectory check (--parity-steps) shows the difference.
            self.opt = torch.optim.RMSprop(params, lr=t.lr, alpha=0.9, eps=1e-7)
        self._adam_steps = 0
        return sum(p.numel() for p in self.net.parameters())

    def _step(self) -> None:
        if isinstance(self.opt, torch.optim.Adam):
            # Keras adds eps to sqrt(v) *before* bias correction, torch after: torch's eps
            # equals Keras' eps / sqrt(1 - beta2^t), so set it per step for the same update.
            self._adam_steps += 1
            self.opt.param_groups[0]["eps"] = 1e-7 / math.sqrt(1.0 - 0.999 ** self._adam_steps)
        self.opt.step()

    def _flatten_perm(self) -> np.ndarray | None:
        shape = flatten_input_shape(self.workload)
        return None if shape is None else nhwc_to_nchw_rows(*shape)

    def _load(self, weights: Sequence[np.ndarray]) -> None:
        perm = self._flatten_perm()
        first_dense = True
        with torch.no_grad():
            for mod, (k, b) in zip(self._weighted(), zip(weights[0::2], weights[1::2])):
                if isinstance(mod, nn.Conv2d):
                    w = np.transpose(k, (3, 2, 0, 1))  # HWIO -> OIHW
                else:
                    # Rows of the dense layer after flatten follow NHWC order; torch flattens NCHW.
                    w = (k[perm] if first_dense and perm is not None else k).T
                    first_dense = False
                mod.weight.copy_(torch.from_numpy(np.ascontiguousarray(w)))
                mod.bias.copy_(torch.from_numpy(b))

    def get_weights(self) -> list[np.ndarray]:
        perm = self._flatten_perm()
        out: list[np.ndarray] = []
        first_dense = True
        for mod in self._weighted():
            w = mod.weight.detach().cpu().numpy()
            if isinstance(mod, nn.Conv2d):
                k = np.transpose(w, (2, 3, 1, 0))
            else:
                k = w.T
                if first_dense and perm is not None:
                    k = k[np.argsort(perm)]
                first_dense = False
            out += [np.ascontiguousarray(k), mod.bias.detach().cpu().numpy().copy()]
        return out

    # --- data -------------------------------------------------------------------------------
    def _tensor(self, x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2))).to(self.device)

    def set_data(self, x_train, y_train, x_val, y_val, x_test, y_test) -> None:
        self.x = {"train": self._tensor(x_train), "val": self._tensor(x_val), "test": self._tensor(x_test)}
        self.y = {k: torch.from_numpy(v.astype(np.int64)).to(self.device)
                  for k, v in (("train", y_train), ("val", y_val), ("test", y_test))}

    # --- run --------------------------------------------------------------------------------
    def train_epoch(self, order: np.ndarray) -> tuple[float, float]:
        assert self.net is not None
        self.net.train()
        idx = torch.from_numpy(order).to(self.device)
        # One gather per epoch, then views: cheaper per step than indexing every batch.
        x, y = self.x["train"][idx], self.y["train"][idx]
        bs = self.workload.training.batch_size
        losses, preds = [], []
        for start in range(0, len(idx), bs):
            xb, yb = x[start:start + bs], y[start:start + bs]
            logits = self.net(xb)
            loss = F.cross_entropy(logits, yb)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self._step()
            losses.append(loss.detach())
            preds.append(logits.detach().argmax(1))
        n = len(idx)
        sizes = torch.tensor([len(p) for p in preds], dtype=torch.float32, device=self.device)
        loss_sum = (torch.stack(losses) * sizes).sum()
        correct = (torch.cat(preds) == y).sum()
        return loss_sum.item() / n, correct.item() / n  # .item() fetches to the host: the sync

    @torch.no_grad()
    def _logits(self, x: torch.Tensor, batch: int) -> torch.Tensor:
        assert self.net is not None
        self.net.eval()
        return torch.cat([self.net(x[s:s + batch]) for s in range(0, len(x), batch)]) if len(x) else \
            torch.zeros((0, self.workload.num_classes), device=self.device)

    def evaluate(self, split: str) -> tuple[float, float]:
        logits = self._logits(self.x[split], _EVAL_BATCH)
        y = self.y[split]
        return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()

    def predict(self) -> np.ndarray:
        probs = torch.softmax(self._logits(self.x["test"], self.workload.inference.batch_size), dim=1)
        return probs.cpu().numpy()

    def forward(self, x: np.ndarray) -> np.ndarray:
        logits = self._logits(self._tensor(x.astype(np.float32)), _EVAL_BATCH)
        return torch.softmax(logits, dim=1).double().cpu().numpy()

    def train_steps(self, batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[float]:
        assert self.net is not None
        self.net.eval()  # dropout off; there is no layer whose gradient depends on the mode
        losses = []
        for xb, yb in batches:
            loss = F.cross_entropy(self.net(self._tensor(xb)), torch.from_numpy(yb.astype(np.int64)).to(self.device))
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self._step()
            losses.append(loss.item())
        return losses

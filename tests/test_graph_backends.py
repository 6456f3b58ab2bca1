"""Graph workloads on every backend: batchnorm's conventions (Keras' momentum, the biased moving
variance, the spec's epsilon) seen through validation after one epoch, and a ResNet-8 smoke run.

The batchnorm trap: a tiny network whose batchnorm sees 8 values per channel (batch 2 on a 2x2
map: an unbiased variance is 8/7 of the biased one), with momentum 0.8 and epsilon 0.01, trained
for one epoch at a learning rate so small that the weights stay put: validation after that epoch
then reads nothing but the moving statistics, and each backend's validation loss must be the
NumPy reference's. A backend that kept its framework's batchnorm defaults (torch's momentum,
torch's or Chainer's unbiased running variance, Keras 2's variance correction, torch's epsilon)
lands far from it; the torch controls below plant each of those and see the check fail.
"""
from __future__ import annotations

import pytest

from benchbackend.spec import workload
from benchbackend.spec.workload import Workload
from conftest import INFERENCE, TRAINING, any_cell, backend_params, run_cell


def trap() -> Workload:
    return workload.parse({
        "name": "bn-trap", "seed": 3,
        "data": {"dataset": "synthetic", "input_shape": [4, 4, 3], "num_classes": 4,
                 "train": 32, "validation": 64, "test": 8},
        "model": [{"type": "conv2d", "filters": 4, "kernel_size": 3, "stride": 2, "use_bias": False},
                  {"type": "batchnorm", "momentum": 0.8, "epsilon": 0.01, "activation": "relu"},
                  {"type": "flatten"}, {"type": "dense", "units": 4, "activation": "softmax"}],
        "training": {"optimizer": "sgd", "lr": 1e-9, "batch_size": 2, "epochs": 1},
        "inference": {"batch_size": 8, "repeats": 1}})


@pytest.fixture(scope="module")
def reference_val_loss(tmp_path_factory: pytest.TempPathFactory) -> float:
    rows = run_cell(tmp_path_factory.mktemp("ref"), trap(), "numpy")[1]
    return next(r["val_loss"] for r in rows if r["phase"] == "train_epoch")


def val_loss(rows: list[dict]) -> float:
    return next(r["val_loss"] for r in rows if r["phase"] == "train_epoch")


@pytest.mark.parametrize("backend", backend_params(TRAINING, build_isolated=True))
def test_batchnorm_follows_keras_conventions_on_every_training_backend(tmp_path, envs_root, reference_val_loss,
                                                                       backend):
    w = trap()
    rows = any_cell(tmp_path, w, backend, envs_root)
    parity = [r for r in rows if r["phase"] == "parity"]
    assert len(parity) == 2 and "training mode" in parity[1]["notes"]  # both batchnorm modes checked
    for r in parity:
        assert r["parity_max_rel"] < 1e-4, r
    assert val_loss(rows) == pytest.approx(reference_val_loss, rel=1e-4)


#: Each of torch's own batchnorm defaults, planted in the torch adapter: (momentum as torch reads
#: it, unbiased running variance, epsilon).
TORCH_DEFAULTS = {"torch's momentum": ("torch", False, None), "unbiased running variance": (None, True, None),
                  "torch's epsilon": (None, False, 1e-5)}


@pytest.mark.torch
@pytest.mark.parametrize("planted", list(TORCH_DEFAULTS))
def test_the_check_fails_when_torch_keeps_its_batchnorm_default(tmp_path, monkeypatch, reference_val_loss, planted):
    import torch
    import torch.nn.functional as F

    from benchbackend.backends.torch import graph as torch_graph

    momentum_kind, unbiased, eps = TORCH_DEFAULTS[planted]

    def forward(self, x):  # nn.BatchNorm2d's behaviour, one default at a time
        m = self.momentum if momentum_kind == "torch" else 1.0 - self.momentum
        if not self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                                eps or self.epsilon)
        if unbiased:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, True, m,
                                eps or self.epsilon)
        with torch.no_grad():
            var, mean = torch.var_mean(x, dim=[0, 2, 3], correction=0)
            self.running_mean.mul_(1 - m).add_(mean, alpha=m)
            self.running_var.mul_(1 - m).add_(var, alpha=m)
        return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, eps or self.epsilon)

    monkeypatch.setattr(torch_graph.BatchNormKeras, "forward", forward)
    rows = run_cell(tmp_path, trap(), "torch")[1]
    # Each lands at least 10x the 1e-4 that correct backends meet (measured: momentum 7%, epsilon 3%,
    # unbiased variance 0.18%: a 14% larger moving variance moves the loss less than its scale).
    assert abs(val_loss(rows) / reference_val_loss - 1) > 1e-3, planted


# --- ResNet-8 on every backend, tiny ----------------------------------------------------------------
def tiny_resnet8() -> Workload:
    w = workload.load("resnet8")
    return w.model_copy(update={
        "data": w.data.model_copy(update={"train": 64, "validation": 32, "test": 32}),
        "training": w.training.model_copy(update={"epochs": 1}),
        "inference": w.inference.model_copy(update={"repeats": 1})})


@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params(TRAINING + INFERENCE, build_isolated=True))
def test_resnet8_smoke(tmp_path, envs_root, backend):
    w = tiny_resnet8()
    trains = backend in TRAINING
    rows = any_cell(tmp_path, w, backend, envs_root, parity_steps=2 if trains else 0)
    phases = [r["phase"] for r in rows]
    assert phases.count("train_epoch") == (1 if trains else 0) and "inference" in phases, phases
    parity = [r for r in rows if r["phase"] == "parity" and not r.get("steps")]
    assert len(parity) == (2 if trains else 1)
    for r in parity:
        assert r["parity_max_rel"] < w.checks.parity_rtol, r
    if trains:
        traj = next(r for r in rows if r.get("steps"))
        assert traj["parity_step"] is None, traj["notes"]  # two Adam steps agree at the workload's tolerance

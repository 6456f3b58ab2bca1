"""torch.compile's gradients are eager's: torch 2.13's inductor on a CPU computed zero gradients for
every weight before a ReLU followed by a max pool (cifar10's four convolutions never trained under
``torch:compile``, while its checks passed: forward parity is untouched, the dense head learns above
chance, and Adam's chaotic first steps on cifar10 keep a 3-step trajectory within its 5% bound).
The adapter pools before the ReLU when it compiles (``graph._pool_before_relu``); this test holds
every weight's gradient to eager's."""
from __future__ import annotations

import numpy as np
import pytest

from benchbackend.backends.base import Options
from benchbackend.spec import workload as W
from conftest import requires_torch

pytestmark = [pytest.mark.slow, requires_torch]


def conv_relu_pool(activation_layer: bool) -> W.Workload:
    """conv -> ReLU -> max pool -> dense, the ReLU a conv's activation or a layer of its own."""
    w = W.load("cifar10")
    conv = {"type": "conv2d", "filters": 8, "kernel_size": 3, "padding": "same"}
    relu = [{**conv, "activation": "relu"}] if not activation_layer else [
        conv, {"type": "activation", "function": "relu"}]
    model = [*relu, {"type": "maxpool2d", "pool_size": 2}, {"type": "dropout", "rate": 0.25}, {"type": "flatten"},
             {"type": "dense", "units": 10, "activation": "softmax"}]
    return W.Workload.model_validate({**w.to_dict(), "name": "conv-relu-pool", "model": model})


@pytest.mark.parametrize("activation_layer", [False, True], ids=["conv-activation", "activation-layer"])
def test_compiled_gradients_are_eagers_for_every_weight(activation_layer: bool) -> None:
    import torch

    from benchbackend.backends.torch.adapter import TorchBackend
    from benchbackend.spec.model import initial_weights

    w = conv_relu_pool(activation_layer)
    weights = initial_weights(w, 0)
    rng = np.random.default_rng(0)
    x = rng.random((8, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, 8)
    grads = {}
    for mode in ("eager", "compile"):
        b = TorchBackend(w, "cpu", mode, "fp32", Options())
        b.build(weights)
        b.net.train()
        b.net.set_mode(dropout=False, update_statistics=True)
        loss = b._loss(b.model(b.to_device(x)), torch.from_numpy(y.astype(np.int64)))
        loss.backward()
        grads[mode] = [p.grad.detach().clone() for p in b.net.parameters()]
    for i, (eager, compiled) in enumerate(zip(grads["eager"], grads["compile"])):
        assert float(eager.norm()) > 0, i
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-6, msg=f"weight {i}'s gradient")

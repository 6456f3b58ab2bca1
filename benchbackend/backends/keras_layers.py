"""The layer vocabulary in the Keras layer API, shared by Keras 3 (tensorflow) and Keras 2.2.4 (plaidml).

Imports no framework: the caller passes its own ``keras.layers`` module.
"""
from __future__ import annotations

from typing import Any, Optional

from ..workload import ActivationLayer, Conv2D, Dense, Dropout, Flatten, MaxPool2D, Workload


def _act(name: str) -> Optional[str]:
    return None if name == "none" else name


def keras_layers(workload: Workload, L: Any, dropout: bool = True) -> list[Any]:
    """Keras layers for ``workload.model`` (no input layer); ``dropout=False`` leaves dropout out."""
    layers: list[Any] = []
    for layer in workload.model:
        if isinstance(layer, Conv2D):
            layers.append(L.Conv2D(layer.filters, layer.kernel_size, strides=layer.stride,
                                   padding=layer.padding, activation=_act(layer.activation)))
        elif isinstance(layer, MaxPool2D):
            layers.append(L.MaxPooling2D(layer.pool_size, strides=layer.stride or layer.pool_size))
        elif isinstance(layer, Dropout):
            if dropout:
                layers.append(L.Dropout(layer.rate, seed=workload.seed))
        elif isinstance(layer, Flatten):
            layers.append(L.Flatten())
        elif isinstance(layer, Dense):
            layers.append(L.Dense(layer.units, activation=_act(layer.activation)))
        elif isinstance(layer, ActivationLayer):
            layers.append(L.Activation(_act(layer.function) or "linear"))
    return layers

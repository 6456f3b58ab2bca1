"""``Backend.take``, the query gather of ``--scenario`` (``run/scenario.py``), checked on one backend
in its own process (its environment set as the worker's: Keras's backend, Chainer's isolated env):
``python tests/support/take_check.py NAME`` prints one JSON line.

The test split goes to the device as the worker places it; ``take`` gathers samples out of order
and repeated. It must gather on the device (not None, which would make the SUT copy each query
from the host), give exactly those samples, and ``scores`` of the gathered batch must be ``scores``
of the same samples sent from the host.
"""
from __future__ import annotations

import json
import sys

import numpy as np

INDICES = [7, 3, 3, 39, 0, 21]


def check(name: str) -> dict:
    from benchbackend.backends import registry as backends
    from benchbackend.spec import workload
    from benchbackend.spec.model import initial_weights

    w = workload.Workload.model_validate({
        "name": "take", "seed": 5,
        "data": {"dataset": "synthetic", "input_shape": [6, 6, 2], "num_classes": 4, "train": 64, "validation": 0,
                 "test": 40},
        "model": [{"type": "conv2d", "filters": 3, "kernel_size": 3, "padding": "same", "activation": "relu"},
                  {"type": "flatten"}, {"type": "dense", "units": 4, "activation": "softmax"}],
        "training": {"optimizer": "sgd", "lr": 0.01, "loss": "categorical_crossentropy", "batch_size": 32,
                     "epochs": 1},
        "inference": {"batch_size": 8, "repeats": 1}})
    spec = backends.get(name)
    b = spec.load_class()(w, "cpu", spec.modes[0].name)
    x = np.random.default_rng(5).standard_normal((40, 6, 6, 2)).astype(np.float32)
    idx = np.array(INDICES, np.int64)
    b.build(initial_weights(w, 1))
    on_device = bool(b.place_data(x.nbytes))
    got = b.take(b.to_device(x), idx)
    if got is None:
        return {"gathers": False, "on_device": on_device}
    again = np.asarray(b.to_host(got))  # in the layout to_device gives (Chainer: NCHW), as is `sent`
    sent = np.asarray(b.to_host(b.to_device(x[idx])))
    gathered = np.asarray(b.to_host(b.scores(got, len(idx))), np.float64)
    direct = np.asarray(b.to_host(b.scores(b.to_device(x[idx]), len(idx))), np.float64)
    b.sync()
    return {"gathers": True, "on_device": on_device, "type": f"{type(got).__module__}.{type(got).__name__}",
            "same_samples": bool(np.array_equal(again, sent)), "scores_diff": float(np.max(np.abs(gathered - direct))),
            "shape": list(gathered.shape)}


if __name__ == "__main__":
    print(json.dumps(check(sys.argv[1])))

"""PlaidML adapter: Keras 2.2.4 on PlaidML 0.7.0, run from its own env (``benchbackend setup plaidml``).

Devices: ``cpu`` is ``llvm_cpu.0``; ``gpu`` (alias ``opencl``) is the first OpenCL device PlaidML
lists (it lists GPU-type OpenCL devices only); anything else is an exact PlaidML device id.

PlaidML is configured through environment variables only, never through ``~/.plaidml``:
``PLAIDML_EXPERIMENTAL=1`` (enables ``llvm_cpu``), ``PLAIDML_DEVICE_IDS`` (set here from the
device asked for), and ``PLAIDML_SETTINGS`` pointing to an empty settings file in benchbackend's
cache folder (``plaidml-home``, shared by every worker, so no worker leaves a folder behind) so a
user's ``~/.plaidml`` is not read. ``PLAIDML_EXPERIMENTAL_CONFIG`` / ``PLAIDML_DEFAULT_CONFIG``
are honoured when set, which is how an OpenCL platform without a built-in hardware entry is made
usable. ``KERAS_HOME`` also points to that folder: Keras 2.2.4 writes ``keras.json`` there on import.

OpenCL on a CPU (tests only; ``tests/test_plaidml.py`` does all of it): PlaidML 0.7 skips CPU-type
OpenCL devices and dlopens the unversioned ``libOpenCL.so``. With PoCL installed, build
``../shared/tools/opencl-cpu-as-gpu/shim.c`` linked against the real loader
(``gcc -shared -fPIC -o DIR/libOpenCL.so shim.c -ldl -Wl,--no-as-needed -l:libOpenCL.so.1``), and
run the worker with ``LD_LIBRARY_PATH=DIR`` and ``PLAIDML_EXPERIMENTAL_CONFIG`` (and
``PLAIDML_DEFAULT_CONFIG``) pointing to a copy of the env's ``share/plaidml/experimental.json``
with one more ``platform.hardware_configs`` entry selecting
``{"platform_regex": ".*Portable Computing Language.*"}``. ``--device gpu`` then picks
``opencl_<vendor>_pthread-<cpu>.0``; ``POCL_CACHE_DIR`` keeps PoCL's kernel cache out of ``~/.cache``.
"""
from __future__ import annotations

import collections
import collections.abc
import json
import os
import tempfile
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ...paths import cache_dir

# A worker ends with os._exit (atexit never runs), so a per-process temporary folder here was left
# behind by every PlaidML worker: one shared folder instead, its settings file written once.
_HOME = str(cache_dir() / "plaidml-home")
os.makedirs(_HOME, exist_ok=True)
os.environ.setdefault("PLAIDML_EXPERIMENTAL", "1")
if not os.path.isfile(os.environ.get("PLAIDML_SETTINGS", "")):
    # PlaidML reads this file (falling back to ~/.plaidml) once, when plaidml.settings imports.
    os.environ["PLAIDML_SETTINGS"] = os.path.join(_HOME, "plaidml-settings.json")
    if not os.path.isfile(os.environ["PLAIDML_SETTINGS"]):
        _fd, _tmp = tempfile.mkstemp(dir=_HOME, suffix=".json")  # whole or absent, for a worker beside
        with os.fdopen(_fd, "w") as _f:
            json.dump({}, _f)
        os.replace(_tmp, os.environ["PLAIDML_SETTINGS"])
os.environ["KERAS_HOME"] = _HOME

import plaidml  # noqa: E402  (after the settings above)
import plaidml.exceptions  # noqa: E402

from ...errors import BackendUnavailable  # noqa: E402
from ...spec.workload import Workload  # noqa: E402
from ..base import Backend  # noqa: E402
from ..keras.layers import KerasNet, build  # noqa: E402

_keras: Any = None


def _import_keras() -> Any:
    """Keras 2.2.4 on the PlaidML backend, imported once (after the device is chosen)."""
    global _keras
    if _keras is not None:
        return _keras
    # Keras 2.2.4 does `from collections import Iterable`; Python 3.10 removed the ABC aliases
    # from `collections` (they live in `collections.abc`), so restore the one it needs.
    if not hasattr(collections, "Iterable"):
        collections.Iterable = collections.abc.Iterable  # type: ignore[attr-defined]
    import plaidml.keras

    # Must precede `import keras`: it hooks the import system so `keras.backend` is PlaidML's.
    plaidml.keras.install_backend()
    import keras
    import keras.backend as K
    from keras.backend import common

    # Pin what a keras.json could change: canonical layout (NHWC) and Keras' defaults.
    K.set_image_data_format("channels_last")
    K.set_floatx("float32")
    common.set_epsilon(1e-7)  # PlaidML's backend module does not re-export set_epsilon
    _keras = keras
    return keras


def list_devices() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(usable, unsupported) PlaidML devices as (id, description), ignoring PLAIDML_DEVICE_IDS.

    Unsupported: seen but without a matching hardware config entry (PlaidML will not run them).
    """
    saved = os.environ.pop("PLAIDML_DEVICE_IDS", None)  # it narrows the listing to the chosen one
    try:
        ctx = plaidml.Context()
        plaidml.quiet()
        valid, invalid = plaidml.devices(ctx, limit=100, return_all=True)
    except plaidml.exceptions.PlaidMLError as exc:
        raise BackendUnavailable(f"plaidml cannot list its devices: {str(exc).splitlines()[0]}") from None
    finally:
        if saved is not None:
            os.environ["PLAIDML_DEVICE_IDS"] = saved
    as_pairs = lambda devs: [(d.id.decode(), d.description.decode()) for d in devs]  # noqa: E731
    return as_pairs(valid), as_pairs(invalid)


def resolve_device(device: str, usable: list[tuple[str, str]], unsupported: list[tuple[str, str]]) -> str:
    """The PlaidML device id for ``--device``, or ``BackendUnavailable`` naming what exists."""
    ids = [i for i, _ in usable]
    listed = ", ".join(ids) or "none"
    if unsupported:
        listed += f" (also seen, without a PlaidML hardware config: {', '.join(i for i, _ in unsupported)})"
    if device == "cpu":
        if "llvm_cpu.0" in ids:
            return "llvm_cpu.0"
        raise BackendUnavailable(f"plaidml has no llvm_cpu.0 device (is PLAIDML_EXPERIMENTAL=1?); devices: {listed}")
    if device in ("gpu", "opencl"):
        gpus = [i for i in ids if i.startswith("opencl")]
        if gpus:
            return gpus[0]
        raise BackendUnavailable(f"plaidml sees no OpenCL GPU (PlaidML 0.7 skips CPU-type OpenCL devices); "
                                 f"devices: {listed}; use --device cpu or one of these ids")
    if device in ids:
        return device
    raise BackendUnavailable(f"plaidml has no device '{device}'; use cpu, gpu or one of: {listed}")


class PlaidMLBackend(Backend):
    name = "plaidml"
    #: --generate: Keras 2.2.4 on PlaidML builds none of the decoder's layers (see ``builds``' reasons).
    generation_note = "it builds no decoder (attention, embeddings, RMSNorm are not among Keras 2.2.4's layers here)"

    def __init__(self, workload: Workload, device: str, mode: str = "keras2", precision: str = "fp32",
                 options: Optional[Mapping[str, Any]] = None):
        super().__init__(workload, device, mode, precision, options)
        usable, unsupported = list_devices()
        self.device = resolve_device(device, usable, unsupported)
        self.description = dict(usable)[self.device]
        # Keras' PlaidML backend opens the one device PLAIDML_DEVICE_IDS selects, on first use.
        os.environ["PLAIDML_DEVICE_IDS"] = self.device
        self.keras = _import_keras()

    @classmethod
    def probe(cls) -> dict:
        usable, _ = list_devices()
        return {"version": plaidml.__version__, "devices": [i for i, _ in usable]}

    def version(self) -> str:
        return str(plaidml.__version__)

    def device_id(self) -> str:
        return self.device

    def gpu_name(self) -> str:
        return "" if self.device.startswith("llvm_cpu") else self.description

    # --- model ------------------------------------------------------------------------------
    def _net(self, dropout: bool = True) -> KerasNet:
        return build(self.workload, self.keras, dropout=dropout, batchnorm=_biased_batchnorm(self.keras),
                     regularizer=self.keras.regularizers.l2)

    def _optimizer(self) -> Any:
        t, opt = self.workload.training, self.keras.optimizers
        if t.weight_decay is not None and t.weight_decay.kind == "decoupled":
            raise BackendUnavailable("plaidml: Keras 2.2.4's optimizers have no decoupled weight decay "
                                     "(weight_decay kind decoupled); kind l2 works")
        if t.optimizer == "sgd":
            return opt.SGD(lr=t.lr, momentum=t.momentum, nesterov=t.nesterov)
        if t.optimizer == "adam":
            return opt.Adam(lr=t.lr)  # epsilon None -> K.epsilon() = 1e-7, as in Keras 3
        return opt.RMSprop(lr=t.lr)

    def _compiled(self, dropout: bool, weights: Sequence[np.ndarray]) -> KerasNet:
        net = self._net(dropout)
        # train_on_batch's loss includes the L2 kernel regularizers, as Keras 3's does.
        net.model.compile(optimizer=self._optimizer(), loss="categorical_crossentropy", metrics=["accuracy"])
        net.set(weights)  # Keras' own layouts are the canonical ones, set layer by layer
        return net

    def build(self, weights: Sequence[np.ndarray]) -> int:
        if getattr(self, "net", None) is None:
            self.net = self._compiled(True, weights)
            self.model = self.net.model
        else:  # a second build (after the trajectory check): the same model, as a new one would start
            self.net.set(weights)
            self._reset_optimizer(self.model)
        return int(self.model.count_params())  # Keras counts the moving statistics too

    def _reset_optimizer(self, model: Any) -> None:
        """Keras 2.2.4's optimizer state as a fresh model's: every slot (the step count, Adam's
        moments, momentum, RMSprop's accumulators) starts at zero. PlaidML compiles a model's train
        function on its first ``train_on_batch`` (a resnet8 about 10 s on ``llvm_cpu``): a model
        reused keeps it, where a new one would compile it again."""
        K = self.keras.backend
        slots = list(model.optimizer.weights)
        if slots:
            K.batch_set_value([(w, np.zeros(K.int_shape(w), dtype=K.dtype(w))) for w in slots])

    def _has_dropout(self) -> bool:
        return any(layer.type == "dropout" for layer in self.workload.model)

    def get_weights(self) -> list[np.ndarray]:
        return [np.asarray(w) for w in self.net.get()]

    # --- data -------------------------------------------------------------------------------
    def set_data(self, x_train: np.ndarray, y_train: np.ndarray) -> None:
        eye = np.eye(self.workload.num_classes, dtype=np.float32)
        self.x_train = np.ascontiguousarray(x_train, np.float32)
        self.y1_train = eye[np.asarray(y_train, np.int64)]

    def place_data(self, nbytes: int) -> bool:
        """Never on the device: Keras 2.2.4's ``train_on_batch`` and ``predict`` take host NumPy
        arrays only (``_standardize_input_data``), and PlaidML's Keras backend copies each fed batch
        into its own buffers when the function runs; a Keras 2 model has no input that reads a
        PlaidML tensor kept on the device. So every batch is copied inside the clock, on a GPU and
        on ``llvm_cpu`` alike. PlaidML has no memory counter either (``peak_device_mb`` is empty)."""
        self.data_on_device = False
        self.data_note = "Keras 2.2.4 on PlaidML feeds every batch from host NumPy arrays"
        return False

    def to_device(self, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x, np.float32)  # Keras 2 feeds batches from host memory

    # --- run --------------------------------------------------------------------------------
    def train_epoch(self, order: np.ndarray) -> tuple[float, float]:
        bs = self.workload.training.batch_size
        x, y = self.x_train, self.y1_train
        loss_sum = correct = 0.0
        self._losses: list[float] = []  # each step's, for the loss audit (``step_losses``)
        for start in range(0, len(order), bs):
            idx = order[start:start + bs]
            loss, acc = self.model.train_on_batch(x[idx], y[idx])  # host floats
            loss_sum += float(loss) * len(idx)
            self._losses.append(float(loss))
            correct += float(acc) * len(idx)
        n = len(order)
        return loss_sum / n, correct / n

    def step_losses(self) -> Optional[np.ndarray]:
        kept = getattr(self, "_losses", None)
        return None if kept is None else np.asarray(kept, np.float64)

    def scores(self, x: np.ndarray, batch_size: int) -> np.ndarray:
        if len(x) == 0:
            return np.zeros((0, self.workload.num_classes), np.float32)
        return np.asarray(self.model.predict(x, batch_size=batch_size))

    def train_steps(self, batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[float]:
        # Keras 2.2.4 has no per-call `training=False`: a twin without Dropout layers, sharing
        # nothing but the current weights, takes the steps (in training mode: batch statistics).
        # Without dropout the model itself is that twin: the worker's next ``build`` puts its
        # weights and optimizer back, and its train function stays compiled for the epochs.
        twin = self._compiled(False, self.net.get()) if self._has_dropout() else self.net
        eye = np.eye(self.workload.num_classes, dtype=np.float32)
        return [float(twin.model.train_on_batch(np.asarray(xb, np.float32), eye[np.asarray(yb)])[0])
                for xb, yb in batches]

    def train_scores(self, x: np.ndarray) -> np.ndarray:
        K = self.keras.backend
        twin = self._compiled(False, self.net.get())
        # A function of the learning phase runs the layers' training branch without their updates.
        fn = K.function([twin.model.input, K.learning_phase()], [twin.model.output])
        return np.asarray(fn([np.asarray(x, np.float32), 1])[0])


def _biased_batchnorm(keras: Any) -> Any:
    """Keras 2.2.4's ``BatchNormalization``, made to follow the reference in a training step.

    Two things differ in stock Keras 2.2.4 on PlaidML 0.7: it multiplies the batch variance by
    ``n / (n - 1 - epsilon)`` before the moving average (an unbiased estimate; Keras 3 and the
    reference use the variance as it is), and PlaidML's ``normalize_batch_in_training`` has a
    wrong gradient (a conv + batchnorm net at SGD lr 0.01: losses 3.0, 68, 304 where the reference
    gives 3.0, 2.5, 2.0). So the batch statistics are written out with ``K.mean``, and the moving
    variance takes the biased one (channels last, scale and center on).
    """
    K = keras.backend

    class KerasBatchNormalization(keras.layers.BatchNormalization):
        def call(self, inputs: Any, training: Any = None) -> Any:
            axes = list(range(len(K.int_shape(inputs)) - 1))

            def normalize_inference() -> Any:
                return K.batch_normalization(inputs, self.moving_mean, self.moving_variance, self.beta, self.gamma,
                                             axis=self.axis, epsilon=self.epsilon)

            if isinstance(training, (bool, int)) and not training:
                return normalize_inference()
            mean = K.mean(inputs, axis=axes)
            variance = K.mean(K.square(inputs - mean), axis=axes)
            normed = (inputs - mean) / K.sqrt(variance + self.epsilon) * self.gamma + self.beta
            self.add_update([K.moving_average_update(self.moving_mean, mean, self.momentum),
                             K.moving_average_update(self.moving_variance, variance, self.momentum)], inputs)
            return K.in_train_phase(normed, normalize_inference, training=training)

    return KerasBatchNormalization

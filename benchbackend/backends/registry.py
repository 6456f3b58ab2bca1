"""Backend registry: what exists, how to tell if it is installed, how to start it.

Nothing here imports an ML framework: availability comes from ``importlib.util.find_spec`` (or,
for backends in their own environment, from that environment), versions from package metadata.
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from ..errors import BackendUnavailable
from .spec import CNN_LAYERS, DECODER_LAYERS, TRANSFORMER_LAYERS, BackendSpec, Capabilities, Mode, gpu_index

__all__ = ["BACKENDS", "HEAP_KEPT", "BackendSpec", "Capabilities", "Mode", "get", "installed", "isolated_envs",
           "problem", "register", "require", "require_any", "version"]


def _tf_env(device: str) -> dict[str, str]:
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": "tensorflow"}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = "-1"  # hide GPUs so TensorFlow places nothing there
    else:  # the memory rule: grow as needed instead of taking the whole GPU; cuDNN autotuning on
        env.update(TF_FORCE_GPU_ALLOW_GROWTH="true", TF_CUDNN_USE_AUTOTUNE="1")
    return env


#: glibc's malloc thresholds (read as a process starts): nothing under 2 GB mmap'd, nothing trimmed.
#: NumPy engines (the reference, Chainer) allocate each step's activations afresh; glibc serves
#: arrays over 128 KiB with new mmaps and returns them after each use, so every step faults its
#: pages in again. Kept in the heap instead: the reference trains cifar10 57% faster, Chainer 7%
#: (docs/backends.md, "Knobs"), the arithmetic unchanged.
HEAP_KEPT = {"MALLOC_MMAP_THRESHOLD_": "2000000000", "MALLOC_TRIM_THRESHOLD_": "2000000000"}


def _numpy_env(device: str) -> dict[str, str]:
    return dict(HEAP_KEPT)


def _torch_env(device: str) -> dict[str, str]:
    return {}


def _jax_env(device: str) -> dict[str, str]:
    # A cpu cell never starts JAX's GPU backend; elsewhere the memory rule: allocate as needed
    # (XLA's client would otherwise take 75% of the GPU's memory at start).
    return {"JAX_PLATFORMS": "cpu"} if device == "cpu" else {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def _keras_jax_env(device: str) -> dict[str, str]:
    return {"KERAS_BACKEND": "jax", **_jax_env(device)}


def _keras_torch_env(device: str) -> dict[str, str]:
    index = gpu_index(device, "keras-torch")
    return {"KERAS_BACKEND": "torch", "KERAS_TORCH_DEVICE": "cpu" if index is None else f"cuda:{index}"}


def _plaidml_env(device: str) -> dict[str, str]:
    # Configure PlaidML without plaidml-setup and without touching ~/.plaidml: experimental
    # devices (llvm_cpu) are enabled; the adapter picks the device id itself.
    return {"PLAIDML_EXPERIMENTAL": "1", "KERAS_BACKEND": "plaidml.keras.backend"}


def _adapter(module: str, cls: str) -> str:
    return f"benchbackend.backends.{module}:{cls}"


#: The ``--device`` forms of a CUDA GPU, which every GPU-capable adapter resolves (``spec.gpu_index``).
_GPU = ("gpu", "gpu:N", "cuda", "cuda:N")


BACKENDS: dict[str, BackendSpec] = {
    spec.name: spec
    for spec in [
        BackendSpec("numpy", _adapter("numpy.reference", "NumpyBackend"), ("numpy",), "numpy", "pip install numpy",
                    "NumPy reference (ground truth; CuPy on --device gpu)",
                    modes=(Mode("reference", "the NumPy/CuPy reference implementation, batch by batch"),),
                    precisions=("fp32", "fp64"), optional=("cupy",), devices=("cpu", *_GPU), env=_numpy_env,
                    builds=CNN_LAYERS + TRANSFORMER_LAYERS + DECODER_LAYERS),
        BackendSpec("torch", _adapter("torch.adapter", "TorchBackend"), ("torch",), "torch",
                    "pip install 'benchbackend[torch]' torch==2.13.0", "PyTorch (CPU, CUDA)",
                    modes=(Mode("eager", "define-by-run nn.Module (NCHW), one optimizer step per batch"),
                           Mode("channels_last", "eager, model and inputs in torch.channels_last (oneDNN's CPU "
                                                 "layout)"),
                           Mode("compile", "torch.compile of the model (inductor, static shapes); compiling lands "
                                           "in the first epoch"),
                           Mode("sdpa", "eager, attention's core in F.scaled_dot_product_attention (fused kernel: "
                                        "flash/memory-efficient on CUDA) instead of the matmul-softmax chain",
                                needs=("attention",))),
                    precisions=("fp32", "tf32", "bf16", "fp16"), env=_torch_env, extra="torch",
                    devices=("cpu", *_GPU), builds=CNN_LAYERS + TRANSFORMER_LAYERS + DECODER_LAYERS,
                    capabilities=Capabilities(peak_probe=True, thread_control=True,
                                              replicas=_adapter("torch.replicas", "TorchDDPBackend"), ray_train=True)),
        BackendSpec("tensorflow", _adapter("tensorflow.adapter", "TensorFlowBackend"), ("tensorflow", "keras"),
                    "tensorflow-cpu", "pip install 'benchbackend[tensorflow]' (tensorflow on GPU machines)",
                    "TensorFlow 2 / Keras 3 (CPU, GPU)",
                    modes=(Mode("tf.function", "Keras 3 model, a traced tf.function train step per batch shape"),
                           Mode("xla", "the same train/predict steps compiled by XLA (jit_compile=True)")),
                    precisions=("fp32", "tf32", "bf16"), env=_tf_env, extra="tensorflow",
                    devices=("cpu", *_GPU, "/GPU:N"), builds=CNN_LAYERS + TRANSFORMER_LAYERS + DECODER_LAYERS,
                    capabilities=Capabilities(peak_probe=True, thread_control=True,
                                              replicas=_adapter("tensorflow.replicas", "TensorFlowMirroredBackend"))),
        BackendSpec("jax", _adapter("jax.adapter", "JaxBackend"), ("jax",), "jax", "pip install 'benchbackend[jax]'",
                    "JAX / XLA (CPU; GPU with jax[cuda12]; TPU with jax[tpu])",
                    modes=(Mode("jit", "lax/jnp layers, one jitted train step per batch"),
                           Mode("scan", "K train steps per dispatch in lax.scan (K = --steps-per-execution)")),
                    precisions=("fp32", "tf32", "bf16"), env=_jax_env, extra="jax",
                    devices=("cpu", *_GPU, "tpu", "tpu:N"),
                    capabilities=Capabilities(peak_probe=True, thread_control=True,
                                              replicas=_adapter("jax.replicas", "JaxShardedBackend")),
                    builds=CNN_LAYERS + TRANSFORMER_LAYERS + DECODER_LAYERS),
        BackendSpec("keras-jax", _adapter("keras.adapter", "KerasJaxBackend"), ("keras", "jax"), "keras",
                    "pip install 'benchbackend[keras3]'", "Keras 3 on JAX (CPU, GPU, TPU)",
                    modes=(Mode("fit", "Keras 3 model.fit on pre-permuted arrays, jit_compile per Keras default "
                                       "(XLA)"),),
                    precisions=("fp32", "tf32"), env=_keras_jax_env, extra="keras3",
                    devices=("cpu", *_GPU, "tpu", "tpu:N"), builds=CNN_LAYERS + TRANSFORMER_LAYERS + DECODER_LAYERS,
                    capabilities=Capabilities(replicas=_adapter("keras.replicas", "KerasJaxDataParallelBackend"))),
        BackendSpec("keras-torch", _adapter("keras.adapter", "KerasTorchBackend"), ("keras", "torch"), "keras",
                    "pip install 'benchbackend[keras3,torch]' torch==2.13.0", "Keras 3 on PyTorch (CPU, CUDA)",
                    modes=(Mode("fit", "Keras 3 model.fit on pre-permuted arrays, eager torch per Keras default"),),
                    precisions=("fp32", "tf32"), env=_keras_torch_env, extra="keras3", devices=("cpu", *_GPU),
                    builds=CNN_LAYERS + TRANSFORMER_LAYERS + DECODER_LAYERS),
        BackendSpec("onnxruntime", _adapter("onnxruntime.adapter", "OnnxRuntimeBackend"), ("onnxruntime", "onnx"),
                    "onnxruntime", "pip install 'benchbackend[onnxruntime]' (onnxruntime-gpu on CUDA machines)",
                    "ONNX Runtime on the spec's ONNX graph (CPU, CUDA)",
                    modes=(Mode("default", "InferenceSession, all graph optimizations, CPU or CUDA execution "
                                           "provider"),),
                    trains=False, extra="onnxruntime", devices=("cpu", *_GPU),
                    capabilities=Capabilities(thread_control=True),
                    builds=CNN_LAYERS + TRANSFORMER_LAYERS + DECODER_LAYERS),
        BackendSpec("openvino", _adapter("openvino.adapter", "OpenVinoBackend"), ("openvino", "onnx"), "openvino",
                    "pip install 'benchbackend[openvino]'",
                    "OpenVINO on the spec's ONNX graph (CPU, Intel GPU)",
                    modes=(Mode("latency", "PERFORMANCE_HINT=LATENCY: one stream, one batch at a time"),
                           Mode("throughput", "PERFORMANCE_HINT=THROUGHPUT: batches in flight on parallel streams")),
                    precisions=("fp32", "bf16"), trains=False, extra="openvino", devices=("cpu", "gpu", "gpu:N"),
                    capabilities=Capabilities(thread_control=True),
                    scenario_modes=(("single-stream", "latency"), ("multi-stream", "latency"),
                                    ("server", "throughput"), ("offline", "throughput")),
                    builds=CNN_LAYERS + TRANSFORMER_LAYERS + DECODER_LAYERS),
        BackendSpec("tvm", _adapter("tvm.adapter", "TVMBackend"), ("tvm",), "apache-tvm",
                    "pip install 'benchbackend[tvm]'",
                    "Apache TVM 0.27 Relax compiled for the host CPU (llvm -mcpu=<detected>)",
                    modes=(Mode("default", "Relax pipeline for llvm -mcpu=<host> with a fixed parallel, vectorized CPU "
                                           "schedule; no search"),
                           Mode("tuned", "MetaSchedule search (--tune-trials), database cached per model, batch "
                                         "and target, then recompiled")),
                    trains=False, extra="tvm", devices=("cpu",), capabilities=Capabilities(thread_control=True),
                    builds=CNN_LAYERS + TRANSFORMER_LAYERS + DECODER_LAYERS),
        BackendSpec("chainer", _adapter("chainer.adapter", "ChainerBackend"), ("chainer",), "chainer",
                    "benchbackend setup chainer", "Chainer 7.8.1 in its own env (NumPy on CPU; CuPy GPU if present)",
                    modes=(Mode("define-by-run", "a Chain whose forward pass builds the graph on every call"),
                           Mode("static-graph", "the Chain's forward method under chainer.static_graph: traced once "
                                                "per input shape, then replayed"),
                           Mode("ideep", "define-by-run on Intel iDeep (MKL-DNN) kernels; needs ideep4py "
                                         "(no wheels for Python >= 3.8)")),
                    optional=("cupy",), isolated_env="chainer", devices=("cpu", *_GPU), env=_numpy_env,
                    builds=CNN_LAYERS + TRANSFORMER_LAYERS + DECODER_LAYERS),
        BackendSpec("plaidml", _adapter("plaidml.adapter", "PlaidMLBackend"), ("plaidml",), "plaidml",
                    "benchbackend setup plaidml", "PlaidML 0.7 + Keras 2.2.4 (OpenCL, LLVM CPU)",
                    modes=(Mode("keras2", "Keras 2.2.4 train_on_batch/predict, batches fed from host memory"),),
                    env=_plaidml_env, isolated_env="plaidml", devices=("cpu", "gpu", "opencl", "<PlaidML device id>"),
                    builds_note="PlaidML 0.7's Tile language has no erf (a Tile `erf(I)` aborts the process), so "
                                "the exact GELU has no op to be built from; Keras 2.2.4 has no LayerNormalization "
                                "or MultiHeadAttention and no decoupled weight decay (vit-tiny's AdamW) either; a "
                                "decoder's words (embedding, RMSNorm, causal attention, RoPE, the tied dense) "
                                "would each be a custom Keras 2.2.4 layer in PlaidML's backend ops, not written "
                                "for a framework whose last release was in 2020"),
    ]
}


def register(spec: BackendSpec) -> None:
    """Add a backend (a plug-in, or a test's). Its ``target`` must be importable by the worker."""
    BACKENDS[spec.name] = spec


def isolated_envs() -> dict[str, str]:
    """Isolated environment name -> the backend whose probe verifies it."""
    return {s.isolated_env: s.name for s in BACKENDS.values() if s.isolated_env}


def _interpreters() -> dict[str, str]:
    """``configs/backends.yaml`` (or $BENCHBACKEND_BACKENDS_CONFIG): backend -> current | env | path."""
    import yaml

    from ..paths import configs_dirs

    env = os.environ.get("BENCHBACKEND_BACKENDS_CONFIG")
    files = [Path(env)] if env else [d / "backends.yaml" for d in configs_dirs()]
    for f in files:
        if f.is_file():
            try:
                raw = yaml.safe_load(f.read_text()) or {}
            except yaml.YAMLError as exc:
                raise BackendUnavailable(f"{f}: malformed YAML: {str(exc).splitlines()[0]}") from None
            if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
                raise BackendUnavailable(f"{f}: expected 'backend: current | env | /path/to/python' lines")
            unknown = sorted(set(raw) - set(BACKENDS))
            if unknown:
                raise BackendUnavailable(f"{f}: unknown backend '{unknown[0]}'; choose from {', '.join(BACKENDS)}")
            return raw
        if env:
            raise BackendUnavailable(f"{f}: BENCHBACKEND_BACKENDS_CONFIG names a file that does not exist")
    return {}


def get(name: str) -> BackendSpec:
    """The spec of backend ``name``, with the interpreter ``configs/backends.yaml`` gives it."""
    try:
        spec = BACKENDS[name]
    except KeyError:
        backend, colon, mode = name.partition(":")
        hint = f" (for a mode: -b {backend} --mode {name})" if colon and backend in BACKENDS else ""
        raise BackendUnavailable(f"unknown backend '{name}'{hint}; choose from {', '.join(BACKENDS)}") from None
    choice = _interpreters().get(name)
    if choice is None:
        return spec
    if choice == "current":
        return replace(spec, isolated_env=None, python=None)
    if choice == "env":
        return replace(spec, isolated_env=spec.isolated_env or name, python=None)
    return replace(spec, isolated_env=None, python=choice)


def installed(spec: BackendSpec) -> bool:
    """Whether the backend can run here, without importing it."""
    return not problem(spec)


def problem(spec: BackendSpec) -> str:
    """Why the backend cannot run here ("" when it can): an interpreter that does not exist, an
    isolated environment not built, or a required module missing (keras-jax without jax, say)."""
    if spec.python:
        # What that interpreter can import shows when its worker starts.
        return "" if Path(spec.python).is_file() else f"configured python {spec.python} does not exist"
    if spec.isolated_env:
        from . import envs

        return "" if envs.is_ready(spec.isolated_env) else "its environment is not built"
    missing = spec.missing()
    if not missing:
        return ""
    return f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed"


def version(spec: BackendSpec) -> str:
    if spec.python:
        return ""  # known once a worker (or `list`'s probe) has run in that interpreter
    if spec.isolated_env:
        from . import envs

        return envs.package_version(spec.isolated_env, spec.dist_name) or ""
    import importlib.metadata  # here, not at the top: 20-30 ms of every `--help` and `compare`

    for dist in (spec.dist_name, spec.import_name):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


def require(spec: BackendSpec) -> None:
    """Raise ``BackendUnavailable`` (one line: what is missing and the install command) unless it can run."""
    why = problem(spec)
    if why:
        raise BackendUnavailable(f"backend '{spec.name}' is not installed ({why}): {spec.install}")


def require_any(names: list[str]) -> None:
    """Raise ``BackendUnavailable`` naming every install command when none of ``names`` can run
    here (a matrix with some of them gives the others ``unavailable`` rows instead)."""
    problems = []
    for name in names:
        try:
            require(get(name))
        except BackendUnavailable as exc:
            problems.append(str(exc))
    if problems and len(problems) == len(names):
        raise BackendUnavailable("; ".join(problems))

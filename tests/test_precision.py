"""The precision rule (``backends/precision.py``, issue 23): ``fp32`` is strict IEEE float32 in every
framework whatever its default, ``tf32`` is its own precision and a clean ``unavailable`` where the
device has none, and the memory rule's variables are set before a framework is imported."""
from __future__ import annotations

import pytest

from benchbackend import results
from benchbackend.backends import registry as backends
from benchbackend.backends.precision import capability_of, check_tf32
from benchbackend.errors import BackendUnavailable
from benchbackend.spec import workload
from conftest import cli, requires


def _mnist():
    return workload.load("mnist").with_overrides(limit=64)


@requires("torch")
def test_torch_fp32_turns_tf32_off_whatever_was_on():
    import torch

    from benchbackend.backends.torch.adapter import TorchBackend

    # torch's own default runs cuDNN convolutions in TF32; someone may have turned matmuls on too.
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.cudnn.conv.fp32_precision = "tf32"
    backend = TorchBackend(_mnist(), "cpu", "eager", "fp32")
    assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision,
            torch.backends.cudnn.rnn.fp32_precision) == ("ieee", "ieee", "ieee")
    assert backend.math_mode() == "ieee"
    with pytest.raises(BackendUnavailable, match="tf32 is a math mode of NVIDIA GPUs"):
        TorchBackend(_mnist(), "cpu", "eager", "tf32")


@requires("tensorflow")
def test_tensorflow_fp32_turns_tf32_off():
    import tensorflow as tf

    from benchbackend.backends.tensorflow.adapter import TensorFlowBackend

    tf.config.experimental.enable_tensor_float_32_execution(True)  # TensorFlow's default
    backend = TensorFlowBackend(_mnist(), "cpu", "tf.function", "fp32")
    assert tf.config.experimental.tensor_float_32_execution_enabled() is False
    assert backend.math_mode() == "ieee"


@requires("jax")
def test_jax_fp32_asks_the_highest_matmul_precision():
    import jax

    from benchbackend.backends.jax.adapter import JaxBackend

    jax.config.update("jax_default_matmul_precision", None)  # XLA's default: TF32 on an Ampere GPU
    backend = JaxBackend(_mnist(), "cpu", "jit", "fp32")
    assert jax.config.jax_default_matmul_precision == "highest"
    assert backend.math_mode() == "ieee"


def test_tf32_needs_an_ampere_gpu():
    with pytest.raises(BackendUnavailable, match="runs on cpu"):
        check_tf32("torch", None, None)
    with pytest.raises(BackendUnavailable, match="Tesla T4 has 7.5"):
        check_tf32("torch", "Tesla T4", (7, 5))
    check_tf32("torch", "NVIDIA A100", (8, 0))  # no error
    assert capability_of("8.6") == (8, 6) and capability_of((9, 0)) == (9, 0) and capability_of("") is None


def test_tf32_on_this_cpu_is_a_clean_unavailable_row_for_every_backend_that_has_it(tmp_path):
    out = tmp_path / "tf32.csv"
    has = [name for name, spec in backends.BACKENDS.items() if "tf32" in spec.precisions]
    assert set(has) == {"torch", "tensorflow", "jax", "keras-jax", "keras-torch"}
    r = cli("run", "mnist", *[a for n in has for a in ("-b", n)], "--precision", "tf32", "--data", "synthetic",
            "--limit", "64", "--repeats", "1", "-o", str(out), "--no-plots")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    df = results.read(out)
    assert set(df["backend"]) == set(has) and set(df["status"]) == {"unavailable"}
    assert set(df["phase"]) == {"run"}  # decided before any worker started
    assert all("tf32 is a math mode of NVIDIA GPUs" in m and "--device cpu" in m for m in df["message"])


def test_a_gpu_that_is_not_there_is_a_clean_unavailable_row(tmp_path):
    out = tmp_path / "cuda1.csv"
    r = cli("run", "mnist", "-b", "torch", "-b", "numpy", "--device", "cuda:1", "--data", "synthetic",
            "--limit", "64", "--repeats", "1", "-o", str(out), "--no-plots", timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    df = results.read(out)
    assert set(df["status"]) == {"unavailable"} and set(df["backend"]) == {"torch", "numpy"}
    torch_says = df[(df.backend == "torch") & (df.phase == "run")]["message"].iloc[0]
    assert "torch sees no CUDA GPU" in torch_says


def test_the_memory_rule_is_in_the_environment_before_import():
    for name in ("jax", "keras-jax"):
        assert backends.get(name).env("gpu:1")["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    tf = backends.get("tensorflow").env("cuda:0")
    assert tf["TF_FORCE_GPU_ALLOW_GROWTH"] == "true" and tf["TF_CUDNN_USE_AUTOTUNE"] == "1"
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in backends.get("jax").env("cpu")  # JAX_PLATFORMS=cpu there

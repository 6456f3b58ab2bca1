"""Workload YAML: the two shipped workloads, validation errors, overrides, model counts."""
from __future__ import annotations

import textwrap

import pytest

from benchbackend.errors import WorkloadError
from benchbackend.spec import model, workload


def write(tmp_path, text: str):
    p = tmp_path / "w.yaml"
    p.write_text(textwrap.dedent(text))
    return str(p)


MINIMAL = """
name: tiny
data: {dataset: mnist, train: 100, validation: 20, test: 50}
model:
  - {type: flatten}
  - {type: dense, units: 10, activation: softmax}
training: {optimizer: sgd, lr: 0.1, batch_size: 16, epochs: 1}
"""


def test_cifar10_is_the_seed_network():
    w = workload.load("cifar10")
    assert model.param_count(w) == 2_168_362
    assert w.input_shape == (32, 32, 3) and w.num_classes == 10
    assert (w.data.train, w.data.validation, w.data.test) == (45_000, 5_000, 10_000)
    assert (w.training.optimizer, w.training.lr, w.training.batch_size, w.training.epochs) == ("adam", 1e-3, 32, 10)
    assert w.inference.repeats == 5


def test_mnist_workload():
    w = workload.load("mnist")
    kinds = [layer.type for layer in w.model]
    assert kinds == ["conv2d"] * 3 + ["activation", "maxpool2d", "flatten", "dense"]
    assert model.describe(w)[-2].out_shape == (14 * 14 * 8,)
    assert model.param_count(w) == 1 * 8 * 9 + 8 * 8 * 9 * 2 + 3 * 8 + 14 * 14 * 8 * 10 + 10
    assert w.data.train + w.data.validation == 60_000


def test_flops_count_conv_and_dense():
    w = workload.parse({**__import__("yaml").safe_load(MINIMAL)})
    assert model.flops_per_sample(w) == 2 * 784 * 10


@pytest.mark.parametrize("snippet, expected", [
    ("training: {optimizer: adamw, lr: 0.1, batch_size: 16, epochs: 1}",
     "`training.optimizer` must be one of 'sgd', 'adam', 'rmsprop'; got 'adamw'"),
    ("training: {optimizer: sgd, lr: 0.1, batch_size: 16, epochs: 1, colour: red}",
     "unknown key `colour` in `training`; allowed: optimizer, lr, momentum, loss, batch_size, epochs"),
    ("training: {optimizer: sgd, lr: -1, batch_size: 16, epochs: 1}", "`training.lr`"),
])
def test_training_errors_name_path_allowed_and_value(tmp_path, snippet, expected):
    text = MINIMAL.replace("training: {optimizer: sgd, lr: 0.1, batch_size: 16, epochs: 1}", snippet)
    with pytest.raises(WorkloadError) as err:
        workload.load(write(tmp_path, text))
    assert expected in str(err.value)
    assert "w.yaml" in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_layer_type_is_rejected(tmp_path):
    text = MINIMAL.replace("{type: flatten}", "{type: conv3d, filters: 2}")
    with pytest.raises(WorkloadError, match=r"`model\[0\].type` must be one of conv2d, .*; got 'conv3d'"):
        workload.load(write(tmp_path, text))


def test_unknown_key_in_layer_is_rejected(tmp_path):
    text = MINIMAL.replace("{type: flatten}", "{type: flatten, axis: 2}")
    with pytest.raises(WorkloadError, match=r"unknown key `axis` in `model\[0\]`"):
        workload.load(write(tmp_path, text))


def test_unknown_top_level_key(tmp_path):
    with pytest.raises(WorkloadError, match="unknown key `optimiser`; allowed: name, description"):
        workload.load(write(tmp_path, MINIMAL + "optimiser: sgd\n"))


def test_malformed_yaml_names_line(tmp_path):
    with pytest.raises(WorkloadError, match=r"w.yaml: line \d+, column \d+: malformed YAML"):
        workload.load(write(tmp_path, MINIMAL + "model: [unclosed\n"))


def test_yaml_is_loaded_safely(tmp_path):
    with pytest.raises(WorkloadError, match="malformed YAML"):
        workload.load(write(tmp_path, "!!python/object/apply:os.system ['echo pwned']\n"))


def test_missing_and_unknown_names():
    with pytest.raises(WorkloadError, match="unknown workload 'nope'; available: .*cifar10.*mnist"):
        workload.load("nope")
    with pytest.raises(WorkloadError, match="not found"):
        workload.load("no/such/file.yaml")


def test_must_end_in_softmax(tmp_path):
    with pytest.raises(WorkloadError, match="last layer must end in softmax"):
        workload.load(write(tmp_path, MINIMAL.replace("activation: softmax", "activation: relu")))


def test_limit_shrinks_validation_and_test_in_proportion():
    w = workload.load("mnist").with_overrides(limit=5400, epochs=2)
    assert (w.data.train, w.data.validation, w.data.test, w.training.epochs) == (5400, 600, 1000, 2)
    tiny = workload.load("mnist").with_overrides(limit=100)
    assert tiny.data.validation == 256 and tiny.data.test == 256
    assert tiny.hash() != workload.load("mnist").hash()


def test_initial_weights_are_glorot_and_deterministic():
    w = workload.load("mnist")
    a, b = model.initial_weights(w, 1), model.initial_weights(w, 1)
    assert all((x == y).all() for x, y in zip(a, b))
    assert not (model.initial_weights(w, 2)[0] == a[0]).all()
    k = a[0]  # HWIO 3x3x1x8: limit sqrt(6 / (9 + 72))
    assert k.shape == (3, 3, 1, 8) and abs(k).max() <= (6 / 81) ** 0.5
    assert not a[1].any()  # zero biases


def test_flatten_permutation_maps_nchw_rows_to_nhwc():
    import numpy as np

    h, w_, c = 2, 3, 4
    act = np.arange(h * w_ * c).reshape(h, w_, c)
    perm = model.nhwc_to_nchw_rows(h, w_, c)
    assert (act.reshape(-1)[perm] == act.transpose(2, 0, 1).reshape(-1)).all()


def test_a_misspelled_key_is_named_with_the_close_one(tmp_path):
    """``kernal_size`` gave "`model[0].kernel_size` is required", naming neither the typo nor the fix."""
    text = MINIMAL.replace("{type: flatten}", "{type: conv2d, filters: 2, kernal_size: 3}")
    with pytest.raises(WorkloadError) as err:
        workload.load(write(tmp_path, text))
    assert "unknown key `kernal_size` in `model[0]` (did you mean `kernel_size`?); allowed: " in str(err.value)
    with pytest.raises(WorkloadError, match=r"unknown key `colour` in `training`; allowed: "):  # nothing close
        workload.load(write(tmp_path, MINIMAL.replace("epochs: 1}", "epochs: 1, colour: red}")))


def test_a_network_that_does_not_fit_its_input_names_the_file_and_prints_shapes_as_tuples(tmp_path):
    from benchbackend.run import plan

    text = MINIMAL.replace("{type: flatten}", "{type: flatten}\n  - {type: conv2d, filters: 2, kernel_size: 3}")
    path = write(tmp_path, text.replace("name: tiny", "name: w"))
    with pytest.raises(WorkloadError) as err:
        plan.load_workloads((path,), ())
    assert str(err.value) == f"{path}: model[1] conv2d needs an image input (H, W, C), got shape (784,)"


def test_limit_caps_the_test_set_of_an_inference_only_run() -> None:
    """Issue 41 item 6: `run resnet50 --inference-only --limit 32` made 256 test images (5 minutes a
    torch cell); nothing judges accuracy there, so the 256 floor gives way."""
    from benchbackend.run import plan

    (w,) = plan.load_workloads(("resnet50",), (), limit=32, inference_only=True)
    assert (w.data.train, w.data.test) == (32, 32)
    (trains,) = plan.load_workloads(("resnet50",), (), limit=32)
    assert trains.data.test == min(workload.load("resnet50").data.test, 256)  # training keeps its floor
    (small,) = plan.load_workloads(("mnist",), (), limit=100000, inference_only=True)
    assert small.data.test == workload.load("mnist").data.test  # a limit above the sizes changes nothing

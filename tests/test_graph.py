"""The graph: names and inputs resolved once, one-line errors that name the layer, hashes of the
existing workloads unchanged, and the ResNets' parameters and FLOPs against independent counts."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from benchbackend import cli
from benchbackend.errors import WorkloadError
from benchbackend.run import checks
from benchbackend.spec import graph, model, workload
from conftest import requires

HEAD = {"name": "g", "data": {"dataset": "synthetic", "input_shape": [16, 16, 3], "num_classes": 4,
                              "train": 64, "validation": 32, "test": 32},
        "training": {"optimizer": "sgd", "lr": 0.1, "batch_size": 8, "epochs": 1}}


def spec(*layers: dict) -> workload.Workload:
    return workload.parse({**HEAD, "model": list(layers)})


def error(*layers: dict) -> str:
    with pytest.raises(ValueError) as err:
        graph.resolve(spec(*layers))
    assert "\n" not in str(err.value)
    return str(err.value)


TAIL = ({"type": "global_avgpool"}, {"type": "dense", "units": 4, "activation": "softmax"})


def test_the_existing_workloads_keep_their_hash_and_weights():
    # Their CSV rows and results stay comparable: new optional fields at their defaults are not hashed.
    assert workload.load("mnist").hash() == "a16752825596"
    assert workload.load("cifar10").hash() == "6e55b3951c8d"
    weights = model.initial_weights(workload.load("mnist"), 1)
    assert hashlib.sha256(b"".join(w.tobytes() for w in weights)).hexdigest()[:12] == "699d941cf7da"


def test_new_fields_enter_the_hash_only_when_set():
    base = workload.load("mnist")
    raw = base.to_dict()
    assert "use_bias" not in raw["model"][0] and "name" not in raw["model"][0] and "nesterov" not in raw["training"]
    raw["model"][0] = {**raw["model"][0], "use_bias": True, "name": "first"}
    assert workload.parse(raw).hash() != base.hash()  # a name is part of the definition
    raw["model"][0].pop("name")
    assert workload.parse(raw).hash() == base.hash()  # use_bias: true is the default
    raw["model"][0]["use_bias"] = False
    assert workload.parse(raw).hash() != base.hash()


def test_a_residual_block_resolves_with_named_inputs():
    g = graph.resolve(spec(
        {"type": "conv2d", "name": "stem", "filters": 8, "kernel_size": 3, "use_bias": False},
        {"type": "batchnorm", "activation": "relu"},
        {"type": "conv2d", "name": "main", "filters": 8, "kernel_size": 3, "stride": 2},
        {"type": "conv2d", "name": "proj", "inputs": ["stem"], "filters": 8, "kernel_size": 1, "stride": 2},
        {"type": "add", "inputs": ["proj", "main", "proj"]}, *TAIL))
    assert [n.inputs for n in g.nodes[:5]] == [(graph.INPUT,), (0,), (1,), (0,), (3, 2, 3)]
    assert g.nodes[2].pads == ((0, 1), (0, 1))  # TF 'same' at stride 2 on 16: the odd pixel after
    assert g.nodes[0].weights == ((3, 3, 3, 8),) and g.nodes[1].trainable == (True, True, False, False)


@pytest.mark.parametrize("layers, message", [
    (({"type": "conv2d", "filters": 8, "kernel_size": 3, "inputs": ["nope"]}, *TAIL),
     "model[0] conv2d: no layer is named 'nope'"),
    (({"type": "conv2d", "filters": 8, "kernel_size": 3, "inputs": ["later"]},
      {"type": "conv2d", "filters": 8, "kernel_size": 3, "name": "later"}, *TAIL),
     "model[0] conv2d: input 'later' is model[1], a later layer"),
    (({"type": "conv2d", "filters": 8, "kernel_size": 3, "name": "a"},
      {"type": "conv2d", "filters": 8, "kernel_size": 3, "name": "a"}, *TAIL),
     "model[1] conv2d 'a': duplicate name, already model[0]'s"),
    (({"type": "conv2d", "filters": 8, "kernel_size": 3, "name": "a", "inputs": ["a"]}, *TAIL),
     "model[0] conv2d 'a': reads its own output (a cycle)"),
    (({"type": "conv2d", "filters": 32, "kernel_size": 3, "name": "res2a"},
      {"type": "conv2d", "filters": 32, "kernel_size": 1, "stride": 2, "name": "proj"},
      {"type": "add", "inputs": ["res2a", "proj"]}, *TAIL),
     "model[2] add: inputs res2a (16, 16, 32) and proj (8, 8, 32) differ"),
    (({"type": "conv2d", "filters": 8, "kernel_size": 17, "padding": "valid"}, *TAIL),
     "model[0] conv2d kernel 17 does not fit input (16, 16, 3)"),
    (({"type": "conv2d", "filters": 8, "kernel_size": 3, "name": "dead"},
      {"type": "conv2d", "filters": 8, "kernel_size": 3, "inputs": ["input"]}, *TAIL),
     "model[0] conv2d 'dead': its output is never used"),
    (({"type": "add", "inputs": ["input"]}, *TAIL), "model[0] add: needs two or more inputs; got 1"),
    (({"type": "maxpool2d", "pool_size": 2, "padding": 2}, *TAIL), "must be smaller than the pool size 2"),
    (({"type": "global_avgpool"}, {"type": "global_avgpool"}, TAIL[1]),
     "model[1] global_avgpool needs an image input (H, W, C), got shape (3,)"),
])
def test_graph_errors_are_one_line_and_name_the_layer(layers, message):
    assert message in error(*layers)


def test_a_bad_graph_is_a_usage_error_exit_2(tmp_path):
    raw = {**HEAD, "name": "bad", "model": [{"type": "conv2d", "filters": 8, "kernel_size": 3, "inputs": ["x"]},
                                            *TAIL]}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(cli.main, ["run", str(path), "-b", "numpy"])
    assert result.exit_code == 2, result.output
    assert "model[0] conv2d: no layer is named 'x'" in result.output


def test_workload_validation_of_the_new_fields(tmp_path):
    with pytest.raises(WorkloadError, match="dataset synthetic needs `input_shape`"):
        workload.parse({**HEAD, "data": {**HEAD["data"], "input_shape": None}, "model": list(TAIL)})
    with pytest.raises(WorkloadError, match="mnist has its own shape and classes"):
        workload.parse({**HEAD, "data": {**HEAD["data"], "dataset": "mnist"}, "model": list(TAIL)})
    with pytest.raises(WorkloadError, match="unknown key `weight_decay` in `model"):
        workload.parse({**HEAD, "model": [{"type": "conv2d", "filters": 4, "kernel_size": 3, "weight_decay": 1},
                                          *TAIL]})
    with pytest.raises(WorkloadError, match=r"`training.weight_decay.kind` must be one of 'l2', 'decoupled'"):
        workload.parse({**HEAD, "model": list(TAIL),
                        "training": {**HEAD["training"], "weight_decay": {"kind": "l1", "rate": 1e-4}}})


# --- the shipped ResNets against independent counts ---------------------------------------------

#: trainable, moving statistics, forward multiply-adds of the convs and the dense layer per sample.
RESNETS = {"resnet8": (78_186, 480, 12_501_632), "resnet20": (272_474, 1_568, 40_813_184),
           "resnet50": (25_557_032, 53_120, 4_089_184_256)}


@pytest.mark.parametrize("name", list(RESNETS))
def test_resnet_counts(name):
    w = workload.load(name)
    trainable, moving, macs = RESNETS[name]
    assert model.trainable_count(w) == trainable
    assert model.param_count(w) == trainable + moving
    conv_dense = sum(n.flops for n in model.describe(w) if n.kind in ("conv2d", "dense"))
    assert conv_dense == 2 * macs
    if name == "resnet50":  # torchvision's resnet50: 25,557,032 parameters, 4.09 GFLOPs (multiply-adds)
        assert round(macs / 1e9, 2) == 4.09


@requires("tensorflow")
@pytest.mark.parametrize("name", list(RESNETS))
def test_keras_count_params_agrees(name):
    import keras

    from benchbackend.backends.keras.layers import keras3_build

    w = workload.load(name)
    net = keras3_build(w, keras)
    assert net.model.count_params() == model.param_count(w)
    trainable = sum(int(np.prod(v.shape)) for v in net.model.trainable_weights)
    assert trainable == model.trainable_count(w)


@requires("torch")
@pytest.mark.parametrize("name", list(RESNETS))
def test_torch_flop_counter_agrees(name):
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from benchbackend.backends.torch.graph import GraphNet

    w = workload.load(name)
    net = GraphNet(graph.resolve(w)).eval()
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        net(torch.zeros((1, w.input_shape[2], *w.input_shape[:2])))
    conv_dense = sum(n.flops for n in model.describe(w) if n.kind in ("conv2d", "dense"))
    assert counter.get_total_flops() == conv_dense  # conv and matmul FLOPs (2 per multiply-add)


# --- checks for chaotic and batchnorm networks ------------------------------------------------------
def test_trajectory_tolerance_grows_per_step_when_asked():
    w = workload.load("resnet20")
    row = {"phase": "parity", "losses": [2.0, 2.01, 2.2], "reference_losses": [2.0, 2.0, 2.0]}
    flat = w.model_copy(update={"checks": w.checks.model_copy(update={"trajectory_rtol": 1e-2,
                                                                      "trajectory_growth": 1.0})})
    assert checks.trajectory(row, flat)["parity_step"] == 3  # 10% at step 3 > 1e-2
    grown = flat.model_copy(update={"checks": flat.checks.model_copy(update={"trajectory_growth": 4.0})})
    assert checks.trajectory(row, grown)["parity_step"] is None  # step 3 allows 1e-2 * 16
    row["losses"][1] = 2.1  # 5% at step 2 > 4e-2
    assert checks.trajectory(row, grown)["parity_step"] == 2


def test_a_reduced_precision_trajectory_is_judged_at_its_own_bound_never_tighter_than_fp32():
    """bf16's correct trajectories part from the float64 reference by 1e-3..3e-2 over 10 steps
    (benchmarks/trajectory_spread.py): judged at fp32's 1e-3 they would fail, and a bound looser
    than fp32's at some step would let an fp32-sized error pass at bf16 there unnoticed."""
    w = workload.load("mnist")
    tight = w.model_copy(update={"checks": w.checks.model_copy(update={"trajectory_rtol": 1e-3})})
    ref = [2.3, 2.2, 2.1, 2.0, 1.9]
    row = {"phase": "parity", "losses": [r * (1 + 5e-3) for r in ref], "reference_losses": ref}
    assert checks.trajectory(row, tight)["parity_step"] == 1  # fp32: 5e-3 > 1e-3
    assert checks.trajectory(row, tight, "bf16")["parity_step"] is None  # bf16 allows 1e-2 at step 1
    assert "(bf16)" in checks.trajectory(row, tight, "bf16")["notes"]
    assert checks.trajectory({**row, "losses": [r * 1.5 for r in ref]}, tight, "bf16")["parity_step"] == 1
    own = tight.checks.model_copy(update={"trajectory_tolerance": {"bf16": workload.TrajectoryTolerance(rtol=1e-3)}})
    assert checks.trajectory(row, tight.model_copy(update={"checks": own}), "bf16")["parity_step"] == 1
    loose = w.model_copy(update={"checks": w.checks.model_copy(update={"trajectory_rtol": 0.2})})
    assert loose.checks.trajectory("bf16", 3) == [0.2, 0.2, 0.2]  # fp32's, where it is the larger
    assert tight.checks.trajectory("tf32", 2) == pytest.approx([1e-2, 1.25e-2])


def epoch_rows(n_epochs: int, steps: int, acc: float, val_acc: float) -> list[dict]:
    return [{"phase": "train_epoch", "epoch": e, "loss": 1.0, "accuracy": acc, "samples": 256, "steps": steps,
             "val_accuracy": val_acc, "val_samples": 256} for e in range(1, n_epochs + 1)]


def test_chance_check_reads_training_accuracy_while_moving_statistics_are_their_initial_values():
    """Issue 43 item 4: a validation accuracy at chance is never ``ok``; while the moving statistics
    are mostly their initial values, a cell that learned (training accuracy above chance) is
    ``not_judged``, one that did not is ``chance_accuracy``."""
    w = workload.load("resnet8")  # batchnorm momentum 0.99: after 8 steps 92% of the initial values remain
    status, msg = checks.cell_status(epoch_rows(1, 8, 0.32, 0.10), w)
    assert status == "not_judged" and "8 steps: 92% of their initial values remain; 230 steps" in msg, msg
    status, msg = checks.cell_status(epoch_rows(1, 8, 0.10, 0.10), w)
    assert status == "chance_accuracy" and "training accuracy" in msg
    assert checks.cell_status(epoch_rows(1, 8, 0.32, 0.32), w) == ("ok", "")  # validation above chance
    # after 400 steps (2% left) the validation accuracy, which reads the moving statistics, is judged
    assert checks.cell_status(epoch_rows(2, 200, 0.32, 0.10), w)[0] == "chance_accuracy"
    assert checks.cell_status(epoch_rows(1, 8, 0.32, 0.10), workload.load("cifar10"))[0] == "chance_accuracy"

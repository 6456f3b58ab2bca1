"""The user's own data (``dataset: npz``) and synthetic data of any shape."""
from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from benchbackend import cli
from benchbackend.data import datasets as data
from benchbackend.errors import DataError
from benchbackend.spec import workload

MODEL = [{"type": "flatten"}, {"type": "dense", "units": 3, "activation": "softmax"}]


def arrays(n_train: int = 40, n_test: int = 10, shape=(4, 5, 2), dtype=np.uint8, classes: int = 3) -> dict:
    rng = np.random.default_rng(0)
    make = (lambda n: rng.integers(0, 256, (n, *shape)).astype(dtype)) if dtype == np.uint8 else \
        (lambda n: rng.standard_normal((n, *shape)).astype(dtype))
    return {"x_train": make(n_train), "y_train": rng.integers(0, classes, n_train),
            "x_test": make(n_test), "y_test": rng.integers(0, classes, n_test)}


def npz_workload(tmp_path: Path, arrs: dict, train: int = 30, validation: int = 10, test: int = 10,
                 shape=(4, 5, 2)) -> workload.Workload:
    np.savez(tmp_path / "mine.npz", **arrs)
    raw = {"name": "mine", "model": MODEL, "training": {"optimizer": "sgd", "lr": 0.1, "batch_size": 8, "epochs": 1},
           "data": {"dataset": "npz", "path": "mine.npz", "input_shape": list(shape), "num_classes": 3,
                    "train": train, "validation": validation, "test": test}}
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(raw))
    return workload.load(str(tmp_path / "mine.yaml"))


def test_npz_arrays_are_split_like_the_canonical_datasets(tmp_path):
    arrs = arrays()
    w = npz_workload(tmp_path, arrs)
    assert Path(w.data.path).is_absolute()  # relative to the YAML, wherever the command runs
    ds = data.load(w)
    assert ds.source == "npz"
    np.testing.assert_array_equal(ds.x_train, arrs["x_train"][:30])
    np.testing.assert_array_equal(ds.x_val, arrs["x_train"][30:])  # the last part of the pool
    np.testing.assert_array_equal(ds.y_test, arrs["y_test"])
    assert ds.y_train.dtype == np.int64 and ds.x_train.dtype == np.uint8


def test_npz_float_features_and_an_explicit_validation_split(tmp_path):
    arrs = arrays(shape=(6,), dtype=np.float64)
    arrs["x_val"], arrs["y_val"] = arrs["x_test"][:5] + 1, arrs["y_test"][:5]
    w = npz_workload(tmp_path, arrs, train=40, validation=5, shape=(6,))
    ds = data.load(w)
    assert ds.x_train.dtype == np.float32 and len(ds.x_train) == 40
    np.testing.assert_allclose(ds.x_val, arrs["x_val"].astype(np.float32))
    assert data.normalize(ds.x_train) is ds.x_train  # floats go in as they are


@pytest.mark.parametrize("change, message", [
    (lambda a: a.pop("y_test"), "no array 'y_test'; the file must hold x_train, y_train, x_test, y_test"),
    (lambda a: a.update(extra=np.zeros(3)), "unexpected array 'extra'"),
    (lambda a: a.update(x_val=a["x_test"]), "holds x_val without its pair"),
    (lambda a: a.update(x_train=a["x_train"].astype(np.int32)), "x_train is int32; images must be uint8"),
    (lambda a: a.update(x_test=a["x_test"][:, :3]), "x_test samples are (3, 5, 2); the workload's input_shape is"),
    (lambda a: a.update(y_train=np.full(40, 3)), "y_train holds label 3, out of range for 3 classes"),
    (lambda a: a.update(y_train=a["y_train"].astype(np.float32)), "y_train is float32"),
    (lambda a: a.update(y_test=a["y_test"][:5]), "x_test holds 10 samples but y_test 5 labels"),
    (lambda a: a.update(x_train=a["x_train"][:35], y_train=a["y_train"][:35]),
     "x_train holds 35 samples; the workload needs train 30 + validation 10"),
])
def test_npz_problems_are_one_line(tmp_path, change, message):
    arrs = arrays()
    change(arrs)
    w = npz_workload(tmp_path, arrs)
    with pytest.raises(DataError) as err:
        data.load(w)
    assert message in str(err.value) and "mine.npz" in str(err.value) and "\n" not in str(err.value)


def test_npz_with_python_objects_is_refused_not_run(tmp_path):
    arrs = arrays()
    arrs["y_train"] = np.array([object()] * 40, dtype=object)  # np.savez pickles an object array
    w = npz_workload(tmp_path, arrs)
    with pytest.raises(DataError, match="'y_train' holds Python objects, which are not loaded"):
        data.load(w)


def test_a_missing_npz_exits_2_with_one_line(tmp_path):
    npz_workload(tmp_path, arrays())
    (tmp_path / "mine.npz").unlink()
    result = CliRunner().invoke(cli.main, ["run", str(tmp_path / "mine.yaml"), "-b", "numpy", "-o",
                                           str(tmp_path / "out.csv"), "--no-plots"])
    assert result.exit_code == 2, result.output
    assert "mine.npz: no such file" in result.output


# --- synthetic data at any shape ------------------------------------------------------------------

def synthetic_workload(shape, classes: int, n: int = 600) -> workload.Workload:
    return workload.parse({"name": "s", "model": [{"type": "flatten"},
                                                   {"type": "dense", "units": classes, "activation": "softmax"}],
                           "training": {"optimizer": "sgd", "lr": 0.1, "batch_size": 8, "epochs": 1},
                           "data": {"dataset": "synthetic", "input_shape": list(shape), "num_classes": classes,
                                    "train": n, "validation": 400, "test": 8}})


@pytest.mark.parametrize("shape, classes", [((9, 7, 2), 3), ((12,), 5), ((6, 6), 20)])
def test_synthetic_data_of_any_shape_is_learnable(shape, classes):
    w = synthetic_workload(shape, classes)
    ds = data.load(w, "real")  # dataset synthetic is generated whatever the source
    assert ds.source == "synthetic" and ds.x_train.shape == (600, *shape) and ds.x_train.dtype == np.uint8
    assert set(np.unique(ds.y_train)) == set(range(classes))
    x = data.normalize(ds.x_train).reshape(600, -1)
    xv = data.normalize(ds.x_val).reshape(400, -1)
    mean = x.mean(axis=0)
    # least squares on one-hot targets: a linear read-out clearly above chance
    coef, *_ = np.linalg.lstsq(np.c_[x - mean, np.ones(600)], np.eye(classes)[ds.y_train], rcond=None)
    acc = np.mean(np.argmax(np.c_[xv - mean, np.ones(400)] @ coef, axis=1) == ds.y_val)
    assert acc > 2.0 / classes, acc


def test_synthetic_images_are_not_clipped_into_ties():
    ds = data.synthetic(workload.load("cifar10").with_overrides(limit=2000))
    x = ds.x_train
    # The generator before clipped 57% of the pixels to 0 and 12% to 255.
    assert (x == 0).mean() < 0.005 and (x == 255).mean() < 0.005
    assert 90 < x.mean() < 140


def test_large_synthetic_images_do_not_need_a_table_of_every_class():
    w = synthetic_workload((224, 224, 3), 1000, n=4)
    ds = data.synthetic(w)  # 1,000 classes at 224x224x3: no (classes x shifts x H x W x C) table
    assert ds.x_train.shape == (4, 224, 224, 3)


def test_the_readme_npz_example_is_valid(tmp_path):
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = text.split("<!-- npz-example -->")[1].split("```yaml")[1].split("```")[0]
    raw = yaml.safe_load(textwrap.dedent(block))
    w = workload.parse({"name": "mine", "model": MODEL[:1] + [{"type": "dense", "units": 10, "activation": "softmax"}],
                        "training": {"optimizer": "sgd", "lr": 0.1, "batch_size": 8, "epochs": 1}, **raw})
    assert w.data.dataset == "npz" and w.data.path == "mine.npz" and w.input_shape == (32, 32, 3)


def _npy() -> bytes:
    import io

    out = io.BytesIO()
    np.save(out, np.zeros(3))
    return out.getvalue()


@pytest.mark.parametrize("content, what", [(b"x_train,y_train\n1,2\n", "it is text"),
                                           (_npy(), "it is a single .npy array")])
def test_a_file_that_is_not_an_npz_says_so(tmp_path, content, what):
    npz_workload(tmp_path, arrays())
    (tmp_path / "mine.npz").write_bytes(content)
    with pytest.raises(DataError) as err:
        data.load(workload.load(str(tmp_path / "mine.yaml")))
    assert f"mine.npz: not an .npz file ({what}); " in str(err.value) and "pickle" not in str(err.value)


def _only_path(tmp_path: Path, arrs: dict, **data: object) -> Path:
    np.savez(tmp_path / "mine.npz", **arrs)
    raw = {"name": "mine", "model": MODEL, "training": {"optimizer": "sgd", "lr": 0.1, "batch_size": 8, "epochs": 1},
           "data": {"dataset": "npz", "path": "mine.npz", **data}}
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(raw))
    return tmp_path / "mine.yaml"


def test_an_npz_needs_only_its_path(tmp_path):
    """Issue 41 item 11: `data: {dataset: npz, path: mine.npz}` was refused ("`data.train` is
    required"); the file knows its sample shape, sizes and classes."""
    w = workload.load(str(_only_path(tmp_path, arrays(n_train=40, n_test=10))))
    d = w.data
    assert (d.input_shape, d.num_classes, d.train, d.validation, d.test) == ((4, 5, 2), 3, 36, 4, 10)
    ds = data.load(w)
    assert (len(ds.y_train), len(ds.y_val), len(ds.y_test)) == (36, 4, 10)
    with_val = dict(arrays(n_train=40, n_test=10), x_val=arrays(n_train=6)["x_train"], y_val=np.arange(6) % 3)
    d = workload.load(str(_only_path(tmp_path, with_val))).data
    assert (d.train, d.validation, d.test) == (40, 6, 10)
    d = workload.load(str(_only_path(tmp_path, arrays(), train=20, num_classes=5))).data  # the YAML overrides
    assert (d.train, d.num_classes, d.validation) == (20, 5, 4)
    skipping = dict(arrays(), y_train=np.full(40, 2), y_test=np.zeros(10, int))  # label 1 never occurs
    with pytest.raises(workload.WorkloadError, match=r"labels 0\.\.2 but 1 never occur: say `num_classes`"):
        workload.load(str(_only_path(tmp_path, skipping)))
    (tmp_path / "mine.npz").unlink()
    with pytest.raises(workload.WorkloadError, match=r"mine\.npz: cannot read the \.npz for `input_shape`"):
        workload.load(str(tmp_path / "mine.yaml"))

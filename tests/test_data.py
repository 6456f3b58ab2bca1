"""benchbackend.data.datasets: real-format readers, downloads against a local server, synthetic data.

Over 400 lines: one test per real-format reader and per way its input can be wrong (missing,
corrupt, wrong checksum, legacy format), sharing the fake archives at the top.
"""
from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import io
import pickle
import socket
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest

from benchbackend.data import datasets as data
from benchbackend.errors import DataError
from benchbackend.spec.workload import DataSpec, Workload
from benchbackend.spec.workload import load as load_workload

MNIST_FILES = data.FILES["mnist"]
CIFAR_FILE = data.FILES["cifar10"][0]


def make_workload(dataset: str, train: int, validation: int, test: int, seed: int = 0) -> Workload:
    spec = DataSpec(dataset=dataset, train=train, validation=validation, test=test)
    return load_workload(dataset).model_copy(update={"data": spec, "seed": seed})


# --- writing tiny files in the real formats ------------------------------------------------------

def write_idx(path: Path, arr: np.ndarray) -> None:
    magic = 0x0800 | arr.ndim  # 0x08: unsigned bytes
    header = magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + arr.astype(np.uint8).tobytes())


def make_mnist(root: Path, n_train: int = 30, n_test: int = 12) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(123)
    arrays = {
        "x_train": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "y_train": rng.integers(0, 10, n_train).astype(np.uint8),
        "x_test": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "y_test": rng.integers(0, 10, n_test).astype(np.uint8),
    }
    root.mkdir(parents=True, exist_ok=True)
    for name, key in zip(MNIST_FILES, ("x_train", "y_train", "x_test", "y_test")):
        write_idx(root / name, arrays[key])
    return arrays


def _add(tar: tarfile.TarFile, name: str, payload: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(payload)
    tar.addfile(info, io.BytesIO(payload))


def make_cifar(root: Path, per_batch: int = 6, n_test: int = 8, drop: str = "",
               replace: dict[str, bytes] | None = None, legacy: bool = False) -> dict[str, np.ndarray]:
    """A cifar-10-python.tar.gz like the real one: pickled (N, 3072) CHW rows, protocol 2."""
    rng = np.random.default_rng(7)
    rows = rng.integers(0, 256, (5 * per_batch + n_test, 3072), dtype=np.uint8)
    labels = rng.integers(0, 10, len(rows))
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(root / CIFAR_FILE, "w:gz") as tar:
        d = tarfile.TarInfo("cifar-10-batches-py")
        d.type = tarfile.DIRTYPE
        tar.addfile(d)
        meta = {b"label_names": [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog",
                                 b"frog", b"horse", b"ship", b"truck"], b"num_cases_per_batch": per_batch}
        _add(tar, "cifar-10-batches-py/batches.meta", pickle.dumps(meta, protocol=2))
        names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
        for i, name in enumerate(names):
            sl = slice(i * per_batch, (i + 1) * per_batch) if i < 5 else slice(5 * per_batch, None)
            batch = {b"batch_label": name.encode(), b"labels": [int(v) for v in labels[sl]],
                     b"data": rows[sl], b"filenames": [b"x.png"] * len(rows[sl])}
            if name == drop:
                continue
            payload = (replace or {}).get(name, pickle.dumps(batch, protocol=2))
            if legacy:  # the real archive was pickled by NumPy 1 under Python 2
                payload = payload.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
            _add(tar, f"cifar-10-batches-py/{name}", payload)
    return {"rows": rows[:5 * per_batch], "labels": labels[:5 * per_batch],
            "test_rows": rows[5 * per_batch:], "test_labels": labels[5 * per_batch:]}


# --- a local HTTP server ---------------------------------------------------------------------------

class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server(tmp_path: Path):
    """Serves tmp_path/served over HTTP on 127.0.0.1; yields (base URL, directory)."""
    served = tmp_path / "served"
    served.mkdir()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                            functools.partial(_QuietHandler, directory=str(served)))
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/", served
    httpd.shutdown()
    httpd.server_close()


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch):
    """Point the expected sha256 of each file at the tiny test files in a directory."""
    def use(directory: Path) -> None:
        for f in directory.iterdir():
            monkeypatch.setitem(data.SHA256, f.name, sha256(f))
    return use


# --- real formats ----------------------------------------------------------------------------------

def test_mnist_idx_values_and_split(tmp_path: Path) -> None:
    arrays = make_mnist(tmp_path, n_train=30, n_test=12)
    ds = data.load(make_workload("mnist", train=20, validation=6, test=10), "real", tmp_path)
    assert ds.source == "real"
    assert ds.x_train.shape == (20, 28, 28, 1) and ds.x_train.dtype == np.uint8
    assert ds.y_train.dtype == np.int64 and ds.x_train.flags.c_contiguous and ds.x_train.flags.writeable
    np.testing.assert_array_equal(ds.x_train[..., 0], arrays["x_train"][:20])
    np.testing.assert_array_equal(ds.y_train, arrays["y_train"][:20])
    np.testing.assert_array_equal(ds.x_val[..., 0], arrays["x_train"][24:])  # the LAST 6
    np.testing.assert_array_equal(ds.y_val, arrays["y_train"][24:])
    np.testing.assert_array_equal(ds.x_test[..., 0], arrays["x_test"][:10])
    np.testing.assert_array_equal(ds.y_test, arrays["y_test"][:10])


def test_auto_reads_when_all_files_present(tmp_path: Path) -> None:
    make_mnist(tmp_path)
    ds = data.load(make_workload("mnist", 10, 5, 5), "auto", tmp_path)
    assert ds.source == "real" and len(ds.x_train) == 10


def test_cifar_chw_to_nhwc(tmp_path: Path) -> None:
    ref = make_cifar(tmp_path, per_batch=6, n_test=8)
    ds = data.load(make_workload("cifar10", train=20, validation=5, test=8), "real", tmp_path)
    assert ds.x_train.shape == (20, 32, 32, 3) and ds.x_test.shape == (8, 32, 32, 3)
    # A known pixel: image 13 (batch 3), channel 2 (blue), row 5, column 7.
    assert ds.x_train[13, 5, 7, 2] == ref["rows"][13, 2 * 1024 + 5 * 32 + 7]
    nhwc = ref["rows"].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    np.testing.assert_array_equal(ds.x_train, nhwc[:20])
    np.testing.assert_array_equal(ds.x_val, nhwc[25:])
    np.testing.assert_array_equal(ds.y_val, ref["labels"][25:])
    np.testing.assert_array_equal(ds.x_test, ref["test_rows"].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
    np.testing.assert_array_equal(ds.y_test, ref["test_labels"])
    assert ds.y_train.dtype == np.int64 and ds.x_train.flags.c_contiguous


def test_cifar_pickles_naming_numpy_core_load(tmp_path: Path) -> None:
    ref = make_cifar(tmp_path, legacy=True)
    assert b"numpy._core" not in gzip.decompress((tmp_path / CIFAR_FILE).read_bytes())
    ds = data.load(make_workload("cifar10", train=20, validation=5, test=8), "real", tmp_path)
    np.testing.assert_array_equal(ds.x_train, ref["rows"][:20].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))


def test_pool_too_small_names_file_and_counts(tmp_path: Path) -> None:
    make_mnist(tmp_path, n_train=30)
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte\.gz: holds 30 .*25 \+ validation 10 = 35"):
        data.load(make_workload("mnist", train=25, validation=10, test=5), "real", tmp_path)
    make_cifar(tmp_path, per_batch=2, n_test=3)
    with pytest.raises(DataError, match=r"cifar-10-python\.tar\.gz: holds 3 test images"):
        data.load(make_workload("cifar10", train=5, validation=2, test=4), "real", tmp_path)


def _corrupt_gzip(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-40])


def _wrong_magic(path: Path) -> None:
    raw = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(b"\x00\x00\x08\x01" + raw[4:]))


def _short_data(path: Path) -> None:
    raw = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(raw[:-100]))


def _not_gzip(path: Path) -> None:
    path.write_bytes(b"<html>404 not found</html>")


@pytest.mark.parametrize("damage, problem", [
    (_corrupt_gzip, "corrupt or truncated gzip"), (_wrong_magic, "magic number 0x00000801"),
    (_short_data, "truncated: header says 30 images"), (_not_gzip, "corrupt or truncated gzip"),
])
def test_corrupt_idx_gives_data_error(tmp_path: Path, damage, problem: str) -> None:
    make_mnist(tmp_path, n_train=30)
    damage(tmp_path / "train-images-idx3-ubyte.gz")
    with pytest.raises(DataError) as err:
        data.load(make_workload("mnist", 10, 5, 5), "real", tmp_path)
    assert str(tmp_path / "train-images-idx3-ubyte.gz") in str(err.value)
    assert problem in str(err.value)


def test_labels_count_mismatch(tmp_path: Path) -> None:
    make_mnist(tmp_path, n_train=30)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(29, np.uint8))
    with pytest.raises(DataError, match="30 images but .*train-labels-idx1-ubyte.gz holds 29 labels"):
        data.load(make_workload("mnist", 10, 5, 5), "real", tmp_path)


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


@pytest.mark.parametrize("kind, problem", [
    ("garbage", "corrupt or truncated archive"), ("truncated", "corrupt or truncated archive"),
    ("missing", "lacks cifar-10-batches-py/data_batch_4"),
    ("evil", "data_batch_2: not a readable CIFAR batch (UnpicklingError: refusing to load __builtin__.print)"),
    ("shape", "data_batch_1: data is uint8 (6, 100), expected uint8 (N, 3072)"),
])
def test_corrupt_cifar_gives_data_error(tmp_path: Path, kind: str, problem: str, capsys) -> None:
    path = tmp_path / CIFAR_FILE
    if kind == "missing":
        make_cifar(tmp_path, drop="data_batch_4")
    elif kind == "evil":
        make_cifar(tmp_path, replace={"data_batch_2": pickle.dumps({b"data": _Evil()}, protocol=2)})
    elif kind == "shape":
        bad = {b"data": np.zeros((6, 100), np.uint8), b"labels": [0] * 6}
        make_cifar(tmp_path, replace={"data_batch_1": pickle.dumps(bad, protocol=2)})
    else:
        make_cifar(tmp_path)
        raw = path.read_bytes()
        path.write_bytes(b"\x1f\x8b" + bytes(range(256)) * 4 if kind == "garbage" else raw[:len(raw) // 2])
    with pytest.raises(DataError) as err:
        data.load(make_workload("cifar10", 10, 5, 5), "real", tmp_path)
    assert str(path) in str(err.value) and problem in str(err.value)
    assert "pwned" not in capsys.readouterr().out  # the pickle's code never ran


def test_auto_with_missing_files_names_them_and_downloads_nothing(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(data.MIRRORS, "mnist", ("http://must-not-be-used.invalid/",))
    make_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    (tmp_path / "train-images-idx3-ubyte.gz").unlink()
    with pytest.raises(DataError) as err:
        data.load(make_workload("mnist", 10, 5, 5), "auto", tmp_path)
    msg = str(err.value)
    assert "train-images-idx3-ubyte.gz" in msg and "t10k-labels-idx1-ubyte.gz" in msg
    assert "train-labels-idx1-ubyte.gz" not in msg
    assert str(tmp_path) in msg and "--data real" in msg and "--data synthetic" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t10k-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"]


def test_unknown_source(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="unknown data source 'fake'"):
        data.load(make_workload("mnist", 10, 5, 5), "fake", tmp_path)


# --- downloads -------------------------------------------------------------------------------------

def test_download_with_progress_and_sha256(tmp_path: Path, server, hashes, monkeypatch) -> None:
    url, served = server
    arrays = make_mnist(served)
    hashes(served)
    monkeypatch.setitem(data.MIRRORS, "mnist", (url,))
    calls: list[tuple[str, int, int]] = []
    target = tmp_path / "new" / "dir"  # created on demand
    ds = data.load(make_workload("mnist", 20, 6, 10), "real", target, progress=lambda *a: calls.append(a))
    np.testing.assert_array_equal(ds.x_train[..., 0], arrays["x_train"][:20])
    assert sorted(p.name for p in target.iterdir()) == sorted(MNIST_FILES)  # no .part left
    for name in MNIST_FILES:
        size = (served / name).stat().st_size
        mine = [c for c in calls if c[0] == name]
        assert mine[0] == (name, 0, size) and mine[-1] == (name, size, size)
        assert (target / name).read_bytes() == (served / name).read_bytes()


def test_download_cifar_then_cached(tmp_path: Path, server, hashes, monkeypatch) -> None:
    url, served = server
    make_cifar(served)
    hashes(served)
    monkeypatch.setitem(data.MIRRORS, "cifar10", (url,))
    ds = data.load(make_workload("cifar10", 20, 5, 8), "real", tmp_path)
    assert ds.x_train.shape == (20, 32, 32, 3)
    (served / CIFAR_FILE).unlink()  # a second load reads the cached file, no network
    assert data.load(make_workload("cifar10", 20, 5, 8), "auto", tmp_path).x_val.shape == (5, 32, 32, 3)


def test_download_bad_hash_leaves_nothing(tmp_path: Path, server, hashes, monkeypatch) -> None:
    url, served = server
    make_mnist(served)
    hashes(served)
    monkeypatch.setitem(data.SHA256, "train-labels-idx1-ubyte.gz", "0" * 64)
    monkeypatch.setitem(data.MIRRORS, "mnist", (url,))
    with pytest.raises(DataError) as err:
        data.load(make_workload("mnist", 10, 5, 5), "real", tmp_path)
    msg = str(err.value)
    assert "train-labels-idx1-ubyte.gz" in msg and "sha256" in msg and "0" * 64 in msg
    assert "\n" not in msg and "--data synthetic" in msg
    assert "train-labels-idx1-ubyte.gz" not in [p.name for p in tmp_path.iterdir()]
    assert not list(tmp_path.glob("*.part")) and not list(tmp_path.glob(".*"))


def test_download_http_error_and_mirror_fallback(tmp_path: Path, server, hashes, monkeypatch) -> None:
    url, served = server
    make_mnist(served)
    hashes(served)
    (served / "t10k-images-idx3-ubyte.gz").rename(served / "elsewhere.gz")
    monkeypatch.setitem(data.MIRRORS, "mnist", (closed_port_url(), url))
    with pytest.raises(DataError, match=r"t10k-images-idx3-ubyte\.gz.*HTTP 404"):
        data.load(make_workload("mnist", 10, 5, 5), "real", tmp_path)
    (served / "elsewhere.gz").rename(served / "t10k-images-idx3-ubyte.gz")
    ds = data.load(make_workload("mnist", 10, 5, 5), "real", tmp_path)  # first mirror down, second ok
    assert ds.source == "real"


def test_unreachable_url_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dead = closed_port_url()
    monkeypatch.setitem(data.MIRRORS, "cifar10", (dead,))
    with pytest.raises(DataError) as err:
        data.load(make_workload("cifar10", 10, 5, 5), "real", tmp_path)
    msg = str(err.value)
    assert "\n" not in msg
    assert CIFAR_FILE in msg and dead + CIFAR_FILE in msg and str(tmp_path) in msg
    assert "--data synthetic" in msg
    assert list(tmp_path.iterdir()) == []


def test_default_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BENCHBACKEND_DATA", str(tmp_path / "d"))
    assert data.default_data_dir() == tmp_path / "d"
    monkeypatch.delenv("BENCHBACKEND_DATA")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data.default_data_dir() == tmp_path / "xdg" / "benchbackend" / "data"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert data.default_data_dir() == tmp_path / "home" / ".cache" / "benchbackend" / "data"


# --- synthetic -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dataset, shape", [("mnist", (28, 28, 1)), ("cifar10", (32, 32, 3))])
def test_synthetic_shapes_and_determinism(dataset: str, shape: tuple[int, int, int]) -> None:
    w = make_workload(dataset, train=1500, validation=300, test=200, seed=3)
    ds = data.load(w, "synthetic")
    assert ds.source == "synthetic"
    for x, y, n in ((ds.x_train, ds.y_train, 1500), (ds.x_val, ds.y_val, 300), (ds.x_test, ds.y_test, 200)):
        assert x.shape == (n, *shape) and x.dtype == np.uint8 and y.shape == (n,) and y.dtype == np.int64
        assert y.min() >= 0 and y.max() < 10
    assert np.bincount(ds.y_train, minlength=10).min() > 100  # every class, roughly balanced
    assert len(np.unique(ds.x_train)) > 200  # images, not a constant
    again = data.synthetic(w)
    for field in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(ds, field), getattr(again, field))
    other = data.synthetic(make_workload(dataset, train=1500, validation=300, test=200, seed=4))
    assert not np.array_equal(ds.x_train, other.x_train)
    assert not np.array_equal(ds.x_train[:300], ds.x_val)
    small = data.synthetic(make_workload(dataset, train=700, validation=0, test=5, seed=3))
    np.testing.assert_array_equal(small.x_train, ds.x_train[:700])  # a smaller run gets a prefix
    np.testing.assert_array_equal(small.y_train, ds.y_train[:700])
    assert small.x_val.shape == (0, *shape) and small.y_val.shape == (0,)


def softmax_regression_accuracy(ds: data.Dataset, y_train: np.ndarray, epochs: int = 5) -> float:
    """Mini-batch SGD on a linear softmax classifier; validation accuracy."""
    x = data.normalize(ds.x_train).reshape(len(ds.x_train), -1)
    xv = data.normalize(ds.x_val).reshape(len(ds.x_val), -1)
    mean = x.mean(axis=0)
    x, xv = x - mean, xv - mean
    weights = np.zeros((x.shape[1], 10), np.float32)
    bias = np.zeros(10, np.float32)
    for order in data.epoch_orders(len(x), epochs, seed=0):
        for i in range(0, len(x), 32):
            idx = order[i:i + 32]
            z = x[idx] @ weights + bias
            p = np.exp(z - z.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            p[np.arange(len(idx)), y_train[idx]] -= 1.0
            weights -= 0.1 * x[idx].T @ p / len(idx)
            bias -= 0.1 * p.mean(axis=0)
    return float(np.mean(np.argmax(xv @ weights + bias, axis=1) == ds.y_val))


@pytest.mark.parametrize("dataset", ["mnist", "cifar10"])
def test_synthetic_is_learnable_but_not_trivial(dataset: str) -> None:
    ds = data.synthetic(make_workload(dataset, train=512, validation=1000, test=10))
    acc = softmax_regression_accuracy(ds, ds.y_train)
    assert 0.5 < acc < 0.97, acc
    shuffled = np.random.default_rng(1).permutation(ds.y_train)
    assert softmax_regression_accuracy(ds, shuffled) < 0.3


# --- epoch orders, normalize -----------------------------------------------------------------------

def test_epoch_orders() -> None:
    orders = data.epoch_orders(1000, 4, seed=5)
    assert orders.shape == (4, 1000) and orders.dtype == np.int64
    for row in orders:
        np.testing.assert_array_equal(np.sort(row), np.arange(1000))
    assert not np.array_equal(orders[0], orders[1])
    np.testing.assert_array_equal(orders, data.epoch_orders(1000, 4, seed=5))
    np.testing.assert_array_equal(orders[:2], data.epoch_orders(1000, 2, seed=5))  # prefix by epoch
    assert not np.array_equal(orders, data.epoch_orders(1000, 4, seed=6))
    rng = np.random.default_rng([5, 1])
    np.testing.assert_array_equal(orders[0], rng.permutation(1000))  # the documented generator
    neg = data.epoch_orders(10, 2, seed=-1)
    assert neg.shape == (2, 10) and not np.array_equal(neg, data.epoch_orders(10, 2, seed=1))
    assert data.epoch_orders(0, 3, seed=0).shape == (3, 0)


def test_normalize() -> None:
    x = np.array([[0, 1, 128, 255]], np.uint8)
    out = data.normalize(x)
    assert out.dtype == np.float32 and out.shape == x.shape
    assert out[0, 0] == 0.0 and out[0, 3] == 1.0 and abs(out[0, 2] - 128 / 255) < 1e-7
    floats = np.array([[0.5, -2.0]], np.float32)  # a user's .npz of float features: as they are
    assert data.normalize(floats) is floats
    with pytest.raises(TypeError):
        data.normalize(x.astype(np.int64))


def test_the_arrays_checksum_names_content_shape_and_dtype_and_takes_an_empty_split(tmp_path: Path) -> None:
    from benchbackend.data import arrays

    w = load_workload("mnist").with_overrides(limit=64)
    w = w.model_copy(update={"data": w.data.model_copy(update={"validation": 0})})
    made = arrays.prepare(w, "synthetic", None, tmp_path / "a.npz")  # x_val is (0, 28, 28, 1)
    assert made.sizes[1] == 0 and arrays.checksum(tmp_path / "a.npz") == made.sha256
    empty = {"x": np.zeros((0, 4), np.uint8)}
    assert arrays.checksum(empty) != arrays.checksum({"x": np.zeros((0, 3), np.uint8)})
    assert arrays.checksum(empty) != arrays.checksum({"x": np.zeros((0, 4), np.float32)})
    one = {"x": np.arange(4, dtype=np.uint8)}
    assert arrays.checksum(one) != arrays.checksum({"x": np.arange(1, 5, dtype=np.uint8)})

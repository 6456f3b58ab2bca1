"""Datasets: MNIST IDX files and the CIFAR-10 python archive (download, sha256, cache), generated
(synthetic) data of any shape, or the user's .npz.

Every source gives the same :class:`Dataset`: uint8 NHWC images and int64 labels. The workload
says how many samples: the training part is the *first* ``train`` images of the training pool,
the validation part the *last* ``validation`` images (so a ``--limit`` shrinks the training part
to a prefix and validation stays disjoint), the test part the first ``test`` test images.

The library never prints: downloads report through the ``progress`` callback, failures raise
:class:`~benchbackend.errors.DataError` with one line that says what to do.
"""
from __future__ import annotations

import gzip
import hashlib
import http.client
import os
import pickle
import posixpath
import tarfile
import tempfile
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from ..errors import DataError
from . import npz
from .synthetic import generate, seed_key

if TYPE_CHECKING:
    from ..spec.workload import Workload

#: progress(filename, bytes_done, bytes_total); bytes_total is 0 when the server does not say.
Progress = Callable[[str, int, int], None]

FILES: dict[str, tuple[str, ...]] = {
    "mnist": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
              "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
    "cifar10": ("cifar-10-python.tar.gz",),
}
#: Base URLs tried in order; the file name is appended. Tests point these at a local server.
MIRRORS: dict[str, tuple[str, ...]] = {
    "mnist": ("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/"),
    "cifar10": ("https://www.cs.toronto.edu/~kriz/",),
}
SHA256: dict[str, str] = {
    "train-images-idx3-ubyte.gz": "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
    "train-labels-idx1-ubyte.gz": "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
    "t10k-images-idx3-ubyte.gz": "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
    "t10k-labels-idx1-ubyte.gz": "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
    "cifar-10-python.tar.gz": "6d958be074577803d12ecdefd02955f39262c83c16fe9348329d7fe0b5c001ce",
}
TIMEOUT_S = 30.0
_CHUNK = 1 << 20
_CIFAR_DIR = "cifar-10-batches-py"
_CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
_IDX_IMAGES, _IDX_LABELS = 0x00000803, 0x00000801  # ubyte data, 3 and 1 dimensions


@dataclass
class Dataset:
    """The arrays of one run: uint8 NHWC images (or float32 arrays from a user's .npz), int64 labels."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    source: str  # "real", "synthetic" or "npz"

    def arrays(self, orders: np.ndarray) -> dict[str, np.ndarray]:
        """What a worker reads (``worker._load_arrays``): every split, uint8 images and labels as
        they are, and ``orders``, the sample order of each epoch (:func:`epoch_orders`)."""
        return {"x_train": self.x_train, "y_train": self.y_train, "x_val": self.x_val, "y_val": self.y_val,
                "x_test": self.x_test, "y_test": self.y_test, "orders": orders}


def default_data_dir() -> Path:
    """``$BENCHBACKEND_DATA``, else ``$XDG_CACHE_HOME/benchbackend/data`` (default ``~/.cache``)."""
    env = os.environ.get("BENCHBACKEND_DATA")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    # The XDG spec says to ignore a relative XDG_CACHE_HOME.
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "benchbackend" / "data"


def load(workload: Workload, source: str = "auto", data_dir: Optional[Path] = None,
         progress: Optional[Progress] = None) -> Dataset:
    """The workload's dataset.

    ``source``: ``"real"`` reads the distribution files from ``data_dir`` and downloads missing
    ones (sha256-checked); ``"auto"`` reads them only if all are present and otherwise raises
    (no download, no silent switch to synthetic); ``"synthetic"`` generates data (no files).
    A workload of ``dataset: synthetic`` is always generated; one of ``dataset: npz`` reads its
    ``path`` (``auto`` and ``real`` alike). A language model's (``tokens``, ``text``) is
    ``language.load``'s.
    """
    name = workload.data.dataset
    if source == "synthetic" or name == "synthetic":
        return synthetic(workload)
    if source not in ("auto", "real"):
        raise DataError(f"unknown data source {source!r}; use auto, real or synthetic")
    if name == "npz":
        return Dataset(**npz.read(workload), source="npz")
    root = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    missing = [f for f in FILES[name] if not (root / f).is_file()]
    if missing and source == "auto":
        raise DataError(
            f"{name} data not found: missing {', '.join(missing)} in {root}; put the files there, "
            f"or use `--data real` to download them, or `--data synthetic` (needs no files)")
    if missing:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DataError(f"cannot create the data directory {root}: {exc.strerror or exc}") from None
        for filename in missing:
            _download(name, filename, root, progress)
    files = [root / f for f in FILES[name]]
    if name == "mnist":
        x_pool, y_pool = _read_mnist(files[0], files[1], workload)
        x_test, y_test = _read_mnist(files[2], files[3], workload)
        pool_file, test_file = files[0], files[2]
    else:
        pool_file = test_file = files[0]
        x_pool, y_pool, x_test, y_test = _read_cifar(files[0], workload.input_shape, workload.num_classes)
    return _split(workload, x_pool, y_pool, x_test, y_test, pool_file, test_file)


def _split(workload: Workload, x_pool: np.ndarray, y_pool: np.ndarray, x_test: np.ndarray,
           y_test: np.ndarray, pool_file: Path, test_file: Path) -> Dataset:
    spec = workload.data
    n_pool, n_test = len(x_pool), len(x_test)
    if spec.train + spec.validation > n_pool:
        raise DataError(f"{pool_file}: holds {n_pool} training images; the workload needs train "
                        f"{spec.train} + validation {spec.validation} = {spec.train + spec.validation}")
    if spec.test > n_test:
        raise DataError(f"{test_file}: holds {n_test} test images; the workload needs test {spec.test}")
    val = slice(n_pool - spec.validation, n_pool)
    # Copies: contiguous NHWC, writable, and the full pool can be freed.
    return Dataset(
        x_train=x_pool[:spec.train].copy(), y_train=y_pool[:spec.train].astype(np.int64),
        x_val=x_pool[val].copy(), y_val=y_pool[val].astype(np.int64),
        x_test=x_test[:spec.test].copy(), y_test=y_test[:spec.test].astype(np.int64),
        source="real")


# --- reading -----------------------------------------------------------------------------------

def _read_idx(path: Path, magic: int, item_shape: tuple[int, ...]) -> np.ndarray:
    """A gzipped IDX file of unsigned bytes, checked against the expected magic and item shape."""
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path}: corrupt or truncated gzip file ({exc})") from None
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    kind = "image" if ndim == 3 else "label"
    if len(raw) < header:
        raise DataError(f"{path}: truncated IDX file ({len(raw)} bytes, shorter than its header)")
    got = int.from_bytes(raw[:4], "big")
    if got != magic:
        raise DataError(f"{path}: not an IDX {kind} file (magic number 0x{got:08x}, expected 0x{magic:08x})")
    dims = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    if dims[1:] != item_shape:
        raise DataError(f"{path}: {kind}s are {'x'.join(map(str, dims[1:]))}, expected "
                        f"{'x'.join(map(str, item_shape))}")
    size = int(np.prod(dims))
    if len(raw) - header != size:
        what = "truncated" if len(raw) - header < size else "trailing bytes"
        raise DataError(f"{path}: {what}: header says {dims[0]} {kind}s ({size} bytes of data), "
                        f"file holds {len(raw) - header}")
    return np.frombuffer(raw, np.uint8, count=size, offset=header).reshape(dims)


def _read_mnist(images: Path, labels: Path, workload: Workload) -> tuple[np.ndarray, np.ndarray]:
    """One IDX image file and its label file, as (N, H, W, 1) uint8 and labels."""
    x = _read_idx(images, _IDX_IMAGES, workload.input_shape[:2])[..., None]
    y = _read_idx(labels, _IDX_LABELS, ())
    if len(x) != len(y):
        raise DataError(f"{images} holds {len(x)} images but {labels} holds {len(y)} labels")
    if len(y) and int(y.max()) >= workload.num_classes:
        raise DataError(f"{labels}: label {int(y.max())} out of range for {workload.num_classes} classes")
    return x, y


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles dicts of NumPy arrays and nothing else: a pickle can otherwise run any code."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def _read_cifar(path: Path, shape: tuple[int, int, int], num_classes: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Training pool and test set of the CIFAR-10 python archive, as NHWC uint8 and labels."""
    wanted = {f"{_CIFAR_DIR}/{b}" for b in (*_CIFAR_TRAIN, "test_batch")}
    batches: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    try:
        # Stream mode: one pass over the gzip data (random access would decompress it again per member).
        with tarfile.open(path, "r|gz") as tar:
            for member in tar:
                name = posixpath.normpath(member.name)
                if name in wanted and member.isfile():
                    f = tar.extractfile(member)
                    assert f is not None
                    batches[name] = _cifar_batch(path, name, f, shape, num_classes)
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path}: corrupt or truncated archive ({exc})") from None
    missing = sorted(wanted - set(batches))
    if missing:
        raise DataError(f"{path}: archive lacks {', '.join(missing)}")
    train = [batches[f"{_CIFAR_DIR}/{b}"] for b in _CIFAR_TRAIN]
    h, w, c = shape
    x_pool = np.concatenate([x for x, _ in train]).reshape(-1, c, h, w).transpose(0, 2, 3, 1)
    y_pool = np.concatenate([y for _, y in train])
    x_test, y_test = batches[f"{_CIFAR_DIR}/test_batch"]
    return x_pool, y_pool, x_test.reshape(-1, c, h, w).transpose(0, 2, 3, 1), y_test


def _cifar_batch(path: Path, member: str, f: Any, shape: tuple[int, int, int], num_classes: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """One pickled batch: ``{b"data": (N, 3072) uint8 in CHW order, b"labels": [N ints]}``."""
    where = f"{path}: {member}"
    try:
        d = _ArrayUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError,
            IndexError, KeyError) as exc:
        raise DataError(f"{where}: not a readable CIFAR batch ({type(exc).__name__}: {exc})") from None
    if not isinstance(d, dict):
        raise DataError(f"{where}: expected a dict, got {type(d).__name__}")
    data = d.get(b"data", d.get("data"))
    labels = d.get(b"labels", d.get("labels"))
    if not isinstance(data, np.ndarray) or labels is None:
        raise DataError(f"{where}: missing the data array or the labels")
    row = int(np.prod(shape))
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != row:
        raise DataError(f"{where}: data is {data.dtype} {data.shape}, expected uint8 (N, {row})")
    try:
        y = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError):
        raise DataError(f"{where}: labels are not integers") from None
    if y.shape != (len(data),):
        raise DataError(f"{where}: {len(data)} images but labels of shape {y.shape}")
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise DataError(f"{where}: labels out of range for {num_classes} classes")
    return data, y


# --- downloading -------------------------------------------------------------------------------

class _FetchFailed(Exception):
    pass


def _download(name: str, filename: str, root: Path, progress: Optional[Progress]) -> None:
    """Fetch ``filename`` into ``root`` from the first mirror that serves it with the right sha256."""
    failures = []
    for base in MIRRORS[name]:
        url = base + filename
        try:
            _fetch(url, root, filename, progress)
            return
        except _FetchFailed as exc:
            failures.append(f"{url}: {' '.join(str(exc).split())}")
    raise DataError(f"cannot download {filename} ({'; '.join(failures)}); put the file in {root} "
                    f"by hand, or use `--data synthetic` (needs no files)")


def _fetch(url: str, root: Path, filename: str, progress: Optional[Progress]) -> None:
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{filename}.", suffix=".part", dir=root)
    except OSError as exc:
        raise DataError(f"cannot write to the data directory {root}: {exc.strerror or exc}") from None
    tmp = Path(tmp_name)
    done = False
    try:
        digest = hashlib.sha256()
        request = urllib.request.Request(url, headers={"User-Agent": "benchbackend (python urllib)"})
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(request, timeout=TIMEOUT_S) as resp:
            total = int(resp.headers.get("Content-Length") or 0)
            got = 0
            if progress:
                progress(filename, 0, total)
            while chunk := resp.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                got += len(chunk)
                if progress:
                    progress(filename, got, total)
        if total and got != total:
            raise _FetchFailed(f"connection closed after {got} of {total} bytes")
        expected = SHA256[filename]
        if digest.hexdigest() != expected:
            raise _FetchFailed(f"sha256 {digest.hexdigest()} does not match the expected {expected}")
        os.replace(tmp, root / filename)
        done = True
    except urllib.error.HTTPError as exc:
        raise _FetchFailed(f"HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise _FetchFailed(str(exc.reason)) from None
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise _FetchFailed(f"{type(exc).__name__}: {exc}") from None
    finally:
        if not done:
            tmp.unlink(missing_ok=True)


# --- synthetic data ----------------------------------------------------------------------------

def synthetic(workload: Workload) -> Dataset:
    """Learnable generated data with the workload's shapes, counts and classes; deterministic by
    seed (:mod:`benchbackend.data.synthetic`). A smaller workload gets a prefix of a larger one's arrays."""
    spec = workload.data
    parts = generate(workload.seed, workload.input_shape, workload.num_classes,
                     {"train": spec.train, "val": spec.validation, "test": spec.test})
    return Dataset(*parts["train"], *parts["val"], *parts["test"], source="synthetic")


# --- helpers for training ----------------------------------------------------------------------

_TAG_ORDERS = 1


def epoch_orders(n_train: int, epochs: int, seed: int) -> np.ndarray:
    """(epochs, n_train) int64: row e is the sample order of epoch e.

    Drawn from ``np.random.default_rng([seed, 1])`` (negative seeds: ``[2**64 - seed, 1]``), one
    ``permutation(n_train)`` per epoch in turn, so the first rows do not depend on ``epochs``.
    """
    if n_train < 0 or epochs < 0:
        raise ValueError(f"n_train and epochs must be >= 0, got {n_train} and {epochs}")
    rng = np.random.default_rng([seed_key(seed), _TAG_ORDERS])
    orders = np.empty((epochs, n_train), dtype=np.int64)
    for e in range(epochs):
        orders[e] = rng.permutation(n_train)
    return orders


def normalize(x: np.ndarray) -> np.ndarray:
    """The network's input: uint8 images -> float32 in [0, 1] (x / 255); float32 arrays (a user's
    .npz of features) as they are; int32 token ids -> float32 ids (exact below 2**24: the
    vocabulary's bound), which an ``embedding`` layer reads as whole numbers."""
    if x.dtype == np.float32:
        return x
    if x.dtype == np.int32:
        return x.astype(np.float32)
    if x.dtype != np.uint8:
        raise TypeError(f"normalize expects uint8 images, float32 arrays or int32 token ids, got {x.dtype}")
    out = x.astype(np.float32)
    out /= np.float32(255.0)
    return out

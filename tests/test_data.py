"""Tests for horovod_torch/common/data.py (sklearn digits written as MNIST files)."""

import hashlib
import importlib.util
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

torchvision = pytest.importorskip("torchvision")
pytest.importorskip("sklearn")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_PY = os.path.join(REPO, "horovod_torch", "common", "data.py")
# Load by path: the package __init__ needs the compiled extension.
_spec = importlib.util.spec_from_file_location("_horovod_torch_data", DATA_PY)
data = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(data)

TRAIN, TEST = 3000, 600
FILES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte",
         "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]


def _digests(root):
    raw = os.path.join(root, "MNIST", "raw")
    digests = {}
    for f in FILES + ["SOURCE.txt"]:
        with open(os.path.join(raw, f), "rb") as fh:
            digests[f] = hashlib.sha256(fh.read()).hexdigest()
    return digests


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mnist"))
    assert data.ensure_mnist(path, train_size=TRAIN, test_size=TEST, seed=0) \
        == "sklearn-digits"
    return path


def _load(root, train):
    ds = torchvision.datasets.MNIST(root, train=train, download=False)
    return ds.data.numpy(), ds.targets.numpy(), ds


def test_torchvision_loads_splits(root):
    for train, n in ((True, TRAIN), (False, TEST)):
        x, y, ds = _load(root, train)
        assert len(ds) == n
        assert x.shape == (n, 28, 28) and x.dtype == np.uint8
        assert y.min() == 0 and y.max() == 9
        assert set(np.unique(y)) == set(range(10))
        img, label = ds[0]
        assert img.size == (28, 28) and 0 <= label <= 9
        ring = np.concatenate([x[:, 0], x[:, -1], x[:, :, 0], x[:, :, -1]], 1)
        assert x.max() == 255 and ring.max() < 128  # digit fits in the frame


def test_deterministic_and_idempotent(root, tmp_path):
    again = str(tmp_path / "again")
    data.ensure_mnist(again, train_size=TRAIN, test_size=TEST, seed=0)
    assert _digests(again) == _digests(root)
    raw = os.path.join(again, "MNIST", "raw", FILES[0])
    ino = os.stat(raw).st_ino
    assert data.ensure_mnist(again, train_size=TRAIN, test_size=TEST, seed=0) \
        == "sklearn-digits"
    assert os.stat(raw).st_ino == ino  # not rewritten
    data.ensure_mnist(again, train_size=TRAIN, test_size=TEST, seed=0,
                      force=True)
    assert os.stat(raw).st_ino != ino  # replaced
    assert _digests(again) == _digests(root)
    data.ensure_mnist(again, train_size=TRAIN, test_size=TEST, seed=1)
    assert _digests(again)[FILES[0]] != _digests(root)[FILES[0]]
    assert "seed 1" in data.describe_mnist(again)


def test_real_mnist_left_alone(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    fake = b"\x00\x00\x08\x03" + b"\x00\x00\xea\x60" + b"real mnist bytes"
    (raw / FILES[0]).write_bytes(fake)
    assert data.ensure_mnist(str(tmp_path)) == "mnist"
    assert data.ensure_mnist(str(tmp_path), force=True) == "mnist"
    assert (raw / FILES[0]).read_bytes() == fake
    assert sorted(os.listdir(raw)) == [FILES[0]]
    assert "real MNIST" in data.describe_mnist(str(tmp_path))
    out = subprocess.run([sys.executable, DATA_PY, "mnist", str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    assert "left it alone" in out
    assert (raw / FILES[0]).read_bytes() == fake


def test_describe_empty(tmp_path):
    assert "no MNIST" in data.describe_mnist(str(tmp_path))


def test_held_out_split_is_disjoint():
    from sklearn.datasets import load_digits
    y = load_digits().target
    tr, te = data._split(y, 0)
    assert not set(tr) & set(te) and len(tr) + len(te) == len(y)
    assert set(y[te]) == set(range(10)) and 0.18 < len(te) / len(y) < 0.22


def test_classifier_generalises_to_held_out_digits(root):
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression
    from threadpoolctl import threadpool_limits
    xtr, ytr, _ = _load(root, True)
    xte, yte, _ = _load(root, False)
    clf = LogisticRegression(max_iter=100)  # ~0.90 here; not fully converged
    # One BLAS thread: multi-threaded BLAS is ~10x slower on a busy 2-core box.
    with warnings.catch_warnings(), threadpool_limits(1):
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf.fit(xtr.reshape(len(xtr), -1) / 255.0, ytr)
    acc = clf.score(xte.reshape(len(xte), -1) / 255.0, yte)
    assert acc > 0.8, acc


def test_cli_concurrent_writers(tmp_path, root):
    cmd = [sys.executable, DATA_PY, "mnist", str(tmp_path),
           "--train-size", str(TRAIN), "--test-size", str(TEST)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate()[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert all("not the real MNIST" in o for o in outs)
    # One process wrote; the other waited on the lock and found the files.
    assert sum(o.startswith("Wrote") for o in outs) == 1
    assert _digests(str(tmp_path)) == _digests(root)
    leftovers = [f for f in os.listdir(tmp_path / "MNIST" / "raw")
                 if f.endswith(".tmp")]
    assert leftovers == []

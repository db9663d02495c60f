"""MNIST-format stand-in data built from scikit-learn's bundled digits.

Writes the four uncompressed IDX files that
``torchvision.datasets.MNIST(root, download=False)`` reads, under
``ROOT/MNIST/raw/``.  The images are scikit-learn's 1797 8x8 handwritten
digits (shipped inside the package, so no download), upsampled bilinearly to
20x20, centred in a 28x28 frame and scaled to 0..255, then augmented with
seeded random shifts (+-2 px) and rotations (+-10 degrees).  The test set is
built only from a held-out, per-class 20% split of the original digits.

This module imports nothing from ``horovod_torch``, so it also runs as
``python horovod_torch/common/data.py mnist DIR`` before the extension is built.
"""

import argparse
import contextlib
import os
import struct
import sys
import tempfile
from typing import Dict, Iterator, List, Optional, Tuple

__all__ = ["ensure_mnist", "describe_mnist", "main"]

MARKER = "SOURCE.txt"
TAG = "sklearn-digits"
FORMAT_VERSION = 1
NOTE = "sklearn digits scaled to 28x28, not the real MNIST"
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_HOLDOUT = 0.2
_MAX_SHIFT = 2.0
_MAX_DEGREES = 10.0


def _raw_dir(root: str) -> str:
    root = os.path.abspath(os.path.expanduser(root))
    return os.path.join(root, "MNIST", "raw")


def _marker_text(train_size: int, test_size: int, seed: int) -> str:
    return (f"{TAG}\n{NOTE}\nversion={FORMAT_VERSION}\n"
            f"train_size={train_size}\ntest_size={test_size}\nseed={seed}\n"
            f"holdout={_HOLDOUT}\nstatus=complete\n")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except (OSError, ValueError):  # missing, or not text
        return ""


def _is_ours(raw: str) -> bool:
    return _read(os.path.join(raw, MARKER)).startswith(TAG)


def _has_real_mnist(raw: str) -> bool:
    train_images = os.path.join(raw, FILES["train"][0])
    return os.path.exists(train_images) and not _is_ours(raw)


def _base_images(images):
    """8x8 grey 0..16 -> float 28x28 grey 0..255 (20x20 digit, 4 px margin).

    Bilinear upsampling with the same weights as torch's
    ``interpolate(mode="bilinear", align_corners=False)``.
    """
    import numpy as np
    pos = np.clip((np.arange(20) + 0.5) * 8 / 20 - 0.5, 0, 7)
    w = np.maximum(0.0, 1.0 - np.abs(pos[:, None] - np.arange(8)[None]))
    up = np.einsum("ij,njk,lk->nil", w, np.asarray(images, np.float64), w)
    return np.pad(up * (255.0 / 16.0), ((0, 0), (4, 4), (4, 4)))


def _warp(imgs, angles, shifts):
    """Rotate by ``angles`` (rad) about the centre, then shift (dy, dx) px."""
    import numpy as np
    n = len(imgs)
    pad = np.pad(imgs, ((0, 0), (1, 1), (1, 1)))
    yy, xx = np.mgrid[0:28, 0:28].astype(np.float64) - 13.5
    cos = np.cos(angles)[:, None, None]
    sin = np.sin(angles)[:, None, None]
    y = yy[None] - shifts[:, 0, None, None]
    x = xx[None] - shifts[:, 1, None, None]
    sy = np.clip(cos * y + sin * x + 13.5, -1.0, 28.0) + 1.0
    sx = np.clip(-sin * y + cos * x + 13.5, -1.0, 28.0) + 1.0
    y0 = np.clip(np.floor(sy).astype(np.int64), 0, 28)
    x0 = np.clip(np.floor(sx).astype(np.int64), 0, 28)
    wy, wx = sy - y0, sx - x0
    k = np.arange(n)[:, None, None]
    top = pad[k, y0, x0] * (1 - wx) + pad[k, y0, x0 + 1] * wx
    bottom = pad[k, y0 + 1, x0] * (1 - wx) + pad[k, y0 + 1, x0 + 1] * wx
    return top * (1 - wy) + bottom * wy


def _split(targets, seed: int):
    """Per-class split of the original digits: (train_idx, test_idx)."""
    import numpy as np
    rng = np.random.default_rng([seed, 0])
    train, test = [], []
    for c in range(10):
        idx = rng.permutation(np.flatnonzero(targets == c))
        n_test = int(round(_HOLDOUT * len(idx)))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def _make_split(base, labels, size: int, rng):
    """``size`` images: each source once unaugmented, then augmented copies."""
    import numpy as np
    m = len(base)
    passes = -(-size // m)
    src = np.concatenate([rng.permutation(m) for _ in range(passes)])[:size]
    angles = np.deg2rad(rng.uniform(-_MAX_DEGREES, _MAX_DEGREES, size))
    shifts = rng.uniform(-_MAX_SHIFT, _MAX_SHIFT, (size, 2))
    angles[:m] = 0.0
    shifts[:m] = 0.0
    out = np.empty((size, 28, 28), dtype=np.uint8)
    for s in range(0, size, 2048):
        sl = slice(s, s + 2048)
        img = _warp(base[src[sl]], angles[sl], shifts[sl])
        out[sl] = np.clip(np.rint(img), 0, 255).astype(np.uint8)
    order = rng.permutation(size)
    return out[order], labels[src][order].astype(np.uint8)


def _generate(train_size: int, test_size: int, seed: int) -> Dict[str, tuple]:
    import numpy as np
    from horovod_torch.common import extras  # pylint: disable=import-outside-toplevel
    digits = extras.require("sklearn.datasets", "the stand-in MNIST").load_digits()
    base = _base_images(digits.images)
    labels = np.asarray(digits.target)
    train_idx, test_idx = _split(labels, seed)
    return {
        "train": _make_split(base[train_idx], labels[train_idx], train_size,
                             np.random.default_rng([seed, 1])),
        "test": _make_split(base[test_idx], labels[test_idx], test_size,
                            np.random.default_rng([seed, 2])),
    }


def _atomic_write(raw: str, name: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=raw, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, os.path.join(raw, name))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _idx_bytes(arr) -> bytes:
    magic = 0x0800 | arr.ndim  # 0x08: unsigned byte
    return struct.pack(f">{1 + arr.ndim}I", magic, *arr.shape) + arr.tobytes()


def _idx_count(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return str(struct.unpack(">II", f.read(8))[1])
    except (OSError, struct.error):
        return "?"


def _complete(raw: str, train_size: int, test_size: int, seed: int) -> bool:
    """Our marker with these parameters and all four files, right sizes."""
    sizes = {}
    for split, n in (("train", train_size), ("test", test_size)):
        sizes[FILES[split][0]], sizes[FILES[split][1]] = 16 + 784 * n, 8 + n
    paths = {os.path.join(raw, f): n for f, n in sizes.items()}
    marker = _marker_text(train_size, test_size, seed)
    return (_read(os.path.join(raw, MARKER)) == marker
            and all(os.path.isfile(p) and os.path.getsize(p) == n
                    for p, n in paths.items()))


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """Hold an exclusive ``fcntl.flock`` on ``path`` (no-op without fcntl)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _ensure(root: str, train_size: int, test_size: int, seed: int,
            force: bool) -> Tuple[str, str]:
    """Return (kind, action) with action one of 'kept', 'found', 'wrote'."""
    if train_size < 1 or test_size < 1:
        raise ValueError("train_size and test_size must be positive")
    raw = _raw_dir(root)
    if _has_real_mnist(raw):
        return "mnist", "kept"
    if not force and _complete(raw, train_size, test_size, seed):
        return TAG, "found"  # fast path; works in a read-only directory
    os.makedirs(raw, exist_ok=True)
    with _locked(os.path.join(raw, ".sklearn-digits.lock")):
        if _has_real_mnist(raw):
            return "mnist", "kept"
        if not force and _complete(raw, train_size, test_size, seed):
            return TAG, "found"  # another process wrote them meanwhile
        data = _generate(train_size, test_size, seed)
        # Mark the directory as ours (but incomplete) before touching data.
        _atomic_write(raw, MARKER, f"{TAG}\nstatus=incomplete\n".encode())
        for split, (img_name, lab_name) in FILES.items():
            images, labels = data[split]
            _atomic_write(raw, img_name, _idx_bytes(images))
            _atomic_write(raw, lab_name, _idx_bytes(labels))
        marker = _marker_text(train_size, test_size, seed)
        _atomic_write(raw, MARKER, marker.encode())
    return TAG, "wrote"


def ensure_mnist(root: str, train_size: int = 12000, test_size: int = 2000,
                 seed: int = 0, force: bool = False) -> str:
    """Make sure ``root`` holds MNIST-format data for torchvision.

    Returns ``"mnist"`` if real MNIST files (not written by this module) are
    already in ``ROOT/MNIST/raw``; they are never touched.  Otherwise writes
    (or reuses, when the same parameters were used before; ``force``
    rewrites anyway) sklearn-digit files and returns ``"sklearn-digits"``.
    Real MNIST is recognised as a ``train-images-idx3-ubyte`` file with no
    ``SOURCE.txt`` marker beside it.  Safe to call from
    several processes at once: writers serialise on a file lock and every
    file is replaced atomically.
    """
    return _ensure(root, train_size, test_size, seed, force)[0]


def describe_mnist(root: str) -> str:
    """Return a human sentence saying which MNIST data ``root`` holds."""
    raw = _raw_dir(root)
    sizes = "/".join(_idx_count(os.path.join(raw, FILES[s][0])) for s in FILES)
    if _has_real_mnist(raw):
        return f"{raw} holds real MNIST ({sizes} train/test images)."
    if _is_ours(raw):
        text = _read(os.path.join(raw, MARKER))
        params = dict(ln.split("=", 1)
                      for ln in text.splitlines() if "=" in ln)
        if params.get("status") != "complete":
            return f"{raw} holds an incomplete write of {NOTE}."
        return (f"{raw} holds {NOTE} ({sizes} train/test images, "
                f"seed {params.get('seed', '?')}).")
    return f"{raw} holds no MNIST data."


def main(argv: Optional[List[str]] = None) -> int:
    """Command-line entry point: ``python -m horovod_torch.data mnist DIR``."""
    parser = argparse.ArgumentParser(prog="python -m horovod_torch.data",
                                     description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("mnist",
                       help="write MNIST-format files from sklearn digits")
    p.add_argument("dir", help="root directory (files go to DIR/MNIST/raw/)")
    p.add_argument("--train-size", type=int, default=12000)
    p.add_argument("--test-size", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true",
                   help="rewrite our files even if they are up to date "
                        "(real MNIST is never replaced)")
    args = parser.parse_args(argv)
    kind, action = _ensure(args.dir, args.train_size, args.test_size,
                           args.seed, args.force)
    raw = _raw_dir(args.dir)
    if kind == "mnist":
        print(f"Real MNIST already present in {raw}; left it alone "
              "(not writing sklearn digits).")
    else:
        verb = "Wrote" if action == "wrote" else "Found existing"
        where = "to" if action == "wrote" else "in"
        print(f"{verb} {args.train_size} train / {args.test_size} test images "
              f"{where} {raw} ({NOTE}; seed {args.seed}).")
    return 0


if __name__ == "__main__":
    sys.exit(main())

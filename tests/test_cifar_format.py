"""Corrupt (not malicious) CIFAR-10 folders are refused before training, in one line: each
batch is checked against the official format (a uint8 array of N x 3072, N <= 10000 labels in
0..9, one per image) and its size, and a folder with fewer images than asked for is said so."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
from conftest import compose_config
from numpy._core.multiarray import _reconstruct

from gradrepro.data.cifar10 import (
    IMAGES_PER_BATCH,
    MAX_BATCH_BYTES,
    PIXELS,
    Cifar10,
    check_cifar10_root,
    load_batch,
)
from gradrepro.errors import UserError
from gradrepro.train import pipeline as runner

FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def batch(n: int = 20, seed: int = 0, **changes) -> dict:
    rng = np.random.default_rng(seed)
    entry = {"batch_label": "fake", "labels": rng.integers(0, 10, n).tolist(),
             "data": rng.integers(0, 256, (n, PIXELS), dtype=np.uint8),
             "filenames": [f"img{i}.png" for i in range(n)]}
    entry.update(changes)
    return entry


def make_folder(root: Path, **per_file) -> Path:
    """A CIFAR-10 folder in the official layout; ``per_file`` replaces a batch's bytes."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for i, name in enumerate(FILES):
        (folder / name).write_bytes(per_file.get(name) or pickle.dumps(batch(seed=i), protocol=2))
    return root


class _Expands:
    """A pickle of a few bytes that asks numpy for an array of 3e8 values."""

    def __reduce__(self):
        return (_reconstruct, (np.ndarray, (300_000_000,), b"b"))


CORRUPT = {
    "negative label": pickle.dumps(batch(labels=[-1] + [0] * 19)),
    "label out of range": pickle.dumps(batch(labels=[10] * 20)),
    "fewer labels than images": pickle.dumps(batch(labels=[1] * 19)),
    "more labels than images": pickle.dumps(batch(labels=[1] * 21)),
    "labels as floats": pickle.dumps(batch(labels=[1.5] * 20)),
    "images not uint8": pickle.dumps(batch(data=np.zeros((20, PIXELS), dtype=np.float32))),
    "images of the wrong size": pickle.dumps(batch(data=np.zeros((20, 100), dtype=np.uint8))),
    "more than a batch": pickle.dumps(batch(n=IMAGES_PER_BATCH + 1)),
    "no data": pickle.dumps({"labels": [1]}),
    "not a mapping": pickle.dumps([1, 2, 3]),
    "expands to 3e8 values": pickle.dumps({"data": _Expands(), "labels": []}, protocol=2),
}


@pytest.mark.parametrize("content", CORRUPT.values(), ids=CORRUPT.keys())
def test_a_corrupt_batch_is_one_line(content, tmp_path):
    root = make_folder(tmp_path, data_batch_3=content)
    with pytest.raises(UserError, match="could not read the CIFAR-10 batch .*data_batch_3") as refused:
        load_batch(str(root / "cifar-10-batches-py" / "data_batch_3"))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "larger than a batch"])
def test_batch_files_that_are_no_batch_are_refused_before_they_are_opened(kind, tmp_path):
    root = make_folder(tmp_path)
    path = root / "cifar-10-batches-py" / "test_batch"
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    else:
        with open(path, "wb") as f:  # sparse: no disk space used
            f.truncate(MAX_BATCH_BYTES + 1)
    with pytest.raises(UserError, match="not a regular file|more than a batch"):
        check_cifar10_root(str(root))


def test_fewer_images_than_asked_for_is_said(tmp_path):
    root = make_folder(tmp_path)
    cfg = compose_config(["data=cifar10", f"data.root={root}", "data.n_train=64", "data.n_test=32"]).data
    with pytest.raises(UserError, match="data.n_test=32 but .* holds 20"):
        Cifar10(cfg, seed=0)


def test_a_corrupt_folder_stops_the_run_before_training(tmp_path):
    root = make_folder(tmp_path, data_batch_2=CORRUPT["negative label"])
    cfg = compose_config(["scale=tiny", "data=cifar10", f"data.root={root}", "data.n_train=64", "data.n_test=16"])
    with pytest.raises(UserError, match="labels must be 0 to 9; found -1"):
        runner.run(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "scalars.parquet").exists()


def test_official_format_batches_still_load(tmp_path):
    root = make_folder(tmp_path)
    images, labels = load_batch(str(root / "cifar-10-batches-py" / "data_batch_1"))
    assert images.shape == (20, 32, 32, 3) and images.dtype == np.uint8
    assert labels.dtype == np.int64 and len(labels) == 20 and labels.min() >= 0 and labels.max() <= 9

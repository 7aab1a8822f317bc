"""Nothing gradrepro reads is unpickled with full trust.

The package's source is inspected (AST, so comments and strings do not count) for every
call that can run code from a file; the one pickle reader, for CIFAR-10's python batches,
is a restricted unpickler that is shown to load real-format batches and refuse the rest.
"""

from __future__ import annotations

import ast
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, compose_config

import gradrepro
from gradrepro.data.cifar10 import load_batch
from gradrepro.errors import UserError

PACKAGE = Path(gradrepro.__file__).parent

# name of the called function (last attribute) -> why it is unsafe on a file a user got
UNSAFE_CALLS = {
    "load": "pickle.load / torch.load / np.load / joblib.load / yaml.load / marshal.load",
    "loads": "pickle.loads / marshal.loads / dill.loads",
    "Unpickler": "a pickle reader (allowed only as a subclass that restricts find_class)",
    "read_pickle": "pandas.read_pickle",
    "unsafe_load": "yaml.unsafe_load",
    "full_load": "yaml.full_load",
    "eval": "eval", "exec": "exec",
}
# Reading helpers of other libraries that unpickle behind the scenes.
UNSAFE_NAMES = {"CIFAR10", "CIFAR100", "shelve", "dill", "cloudpickle", "joblib"}


def _kw(call: ast.Call, name: str):
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def unsafe_uses(source: str, filename: str) -> list:
    """(file:line, what) for every call in ``source`` that could unpickle or run file content."""
    tree = ast.parse(source, filename)
    found = []
    restricted = {  # classes that subclass a pickle Unpickler and define find_class
        n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
        and any("Unpickler" in ast.unparse(b) for b in n.bases)
        and any(isinstance(f, ast.FunctionDef) and f.name == "find_class" for f in n.body)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in UNSAFE_NAMES:
            found.append((f"{filename}:{node.lineno}", node.id))
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", "") or ""]
            bad = [n for n in names if n.split(".")[0] in UNSAFE_NAMES or n in UNSAFE_NAMES]
            found += [(f"{filename}:{node.lineno}", f"import {n}") for n in bad]
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func)
        last = func.rsplit(".", 1)[-1]
        if func in restricted or last not in UNSAFE_CALLS:
            continue
        if func == "torch.load" and _is_true(_kw(node, "weights_only")):
            continue
        if func in ("np.load", "numpy.load") and not _is_true(_kw(node, "allow_pickle")):
            continue
        if func == "yaml.load" and "Safe" in ast.unparse(_kw(node, "Loader") or ast.Constant("")):
            continue
        if func.split(".")[0] in ("json", "OmegaConf"):
            continue  # JSON is data only; OmegaConf.load is YAML through a safe loader
        if last in ("eval", "exec") and func != last:
            continue  # net.eval(): a module's method, not the builtin
        if last in ("load", "loads") and "." not in func:
            continue  # a local helper called load (checked where it is defined)
        if last == "load" and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Call) and ast.unparse(node.func.value.func) in restricted:
            continue  # RestrictedUnpickler(f).load()
        found.append((f"{filename}:{node.lineno}", f"{func}(...): {UNSAFE_CALLS[last]}"))
    return found


def package_sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, path.read_text()


def test_the_package_never_unpickles_with_full_trust():
    found = []
    for path, source in package_sources():
        found += unsafe_uses(source, str(path.relative_to(ROOT)))
    assert not found, "unsafe reads:\n" + "\n".join(f"{w}: {what}" for w, what in found)


@pytest.mark.parametrize("snippet", [
    "import pickle\npickle.load(open('x', 'rb'))",
    "import torch\ntorch.load('ckpt.pt')",
    "import torch\ntorch.load('ckpt.pt', weights_only=False)",
    "import numpy as np\nnp.load('x.npy', allow_pickle=True)",
    "import pandas as pd\npd.read_pickle('x.pkl')",
    "import yaml\nyaml.load(open('c.yaml'), Loader=yaml.Loader)",
    "from torchvision.datasets import CIFAR10\nCIFAR10('root')",
    "import pickle\npickle.Unpickler(open('x', 'rb')).load()",
])
def test_the_inspection_catches_each_unsafe_read(snippet):
    assert unsafe_uses(snippet, "snippet.py")


@pytest.mark.parametrize("snippet", [
    "import torch\ntorch.load('ckpt.pt', weights_only=True)",
    "import numpy as np\nnp.load('x.npy')",
    "import json\njson.load(open('s.json'))",
    "import yaml\nyaml.load(open('c.yaml'), Loader=yaml.SafeLoader)",
    ("import pickle\nclass R(pickle.Unpickler):\n    def find_class(self, m, n):\n        raise"
     " pickle.UnpicklingError(n)\nR(open('x', 'rb')).load()"),
])
def test_the_inspection_allows_safe_reads(snippet):
    assert not unsafe_uses(snippet, "snippet.py")


# --- CIFAR-10's python batches through the restricted unpickler -----------------------------


def write_batch(path: Path, n: int, seed: int, protocol: int = 2) -> None:
    rng = np.random.default_rng(seed)
    entry = {"batch_label": "fake", "labels": rng.integers(0, 10, n).tolist(),
             "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
             "filenames": [f"img{i}.png" for i in range(n)]}
    path.write_bytes(pickle.dumps(entry, protocol=protocol))


@pytest.fixture
def fake_cifar(tmp_path) -> Path:
    folder = tmp_path / "cifar" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for i in range(1, 6):
        write_batch(folder / f"data_batch_{i}", 40, i)
    write_batch(folder / "test_batch", 40, 0, protocol=4)
    return tmp_path / "cifar"


class _RunsCode:
    def __reduce__(self):
        return (os.getpid, ())  # harmless, but a call: the kind of thing a hostile pickle does


def test_a_cifar_batch_that_names_code_is_refused(tmp_path):
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({"data": _RunsCode(), "labels": []}, protocol=2))
    with pytest.raises(UserError, match="refusing to load the global .*getpid"):
        load_batch(str(path))


def test_a_truncated_cifar_batch_is_one_clear_error(fake_cifar):
    path = fake_cifar / "cifar-10-batches-py" / "data_batch_3"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(UserError, match="could not read the CIFAR-10 batch"):
        load_batch(str(path))


def test_real_format_cifar_batches_load_and_train(fake_cifar, tmp_path):
    images, labels = load_batch(str(fake_cifar / "cifar-10-batches-py" / "data_batch_1"))
    assert images.shape == (40, 32, 32, 3) and images.dtype == np.uint8 and len(labels) == 40
    from gradrepro.train import pipeline as runner

    cfg = compose_config(["scale=tiny", "data=cifar10", f"data.root={fake_cifar}",
                          "data.n_train=64", "data.n_test=32"])
    summary = runner.run(cfg, tmp_path / "run")
    assert summary["status"] == "completed"

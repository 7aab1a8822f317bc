"""The package's layers point one way, as the README's list says, and the recorder users import
stands on the bottom layers: no Hydra, omegaconf, scikit-learn or torchvision is loaded."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest
from conftest import ROOT
from test_layout import PACKAGE, _imports

BEGIN, END = "<!-- layers -->", "<!-- end of layers -->"


def readme_layers() -> dict:
    """Unit (a subpackage or top-level module of gradrepro) -> its layer, from the README."""
    text = (ROOT / "README.md").read_text().split(BEGIN, 1)[1].split(END, 1)[0]
    layers = {}
    for line in text.strip().splitlines():
        number, _, rest = line.partition(". ")
        for unit in re.findall(r"`([A-Za-z_]+)`", rest.split("(")[0]):
            layers[unit] = int(number)
    return layers


def units() -> set:
    return {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
            if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}


def test_every_unit_of_the_package_has_a_layer_in_the_readme():
    layers = readme_layers()
    assert units() == set(layers), f"without a layer: {units() - set(layers)}; gone: {set(layers) - units()}"


def upward(source: str, targets, layers: dict) -> list:
    """The imports of ``targets`` (module names) from unit ``source`` that point up a layer."""
    out = []
    for target in targets:
        unit = target.split(".")[1] if "." in target else None
        if unit and unit != source and unit in layers and layers[unit] > layers[source]:
            out.append(f"{source} (layer {layers[source]}) imports {target} (layer {layers[unit]})")
    return out


def test_no_import_points_up_a_layer():
    layers = readme_layers()
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts == ("__init__.py",):
            continue  # the package's lazy attributes (gradrepro.record etc.), no import at load
        found += [f"{rel}: {u}" for u in upward(rel.parts[0].removesuffix(".py"), _imports(path, "gradrepro"), layers)]
    assert not found, "\n".join(found)


def test_the_layer_check_sees_an_upward_import():
    layers = readme_layers()
    assert upward("records", ["gradrepro.train.pipeline", "gradrepro.errors"], layers) == [
        "records (layer 2) imports gradrepro.train.pipeline (layer 12)"]
    assert upward("record", ["gradrepro.config.schema"], layers)
    assert not upward("train", ["gradrepro.records.files", "gradrepro.train.loop"], layers)


HEAVY = ("hydra", "omegaconf", "sklearn", "torchvision", "transformers", "accelerate", "lightning")


def heavy_loaded(module: str) -> str:
    """The heavy packages a fresh interpreter has loaded after ``import module``."""
    code = (f"import sys, {module}; heavy = {HEAVY!r}; "
            "print(sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] in heavy}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("module", ["gradrepro", "gradrepro.record", "gradrepro.diagnose", "gradrepro.watch"])
def test_the_user_facing_modules_load_no_experiment_stack(module):
    assert heavy_loaded(module) == "[]"


def test_the_lightning_callback_loads_nothing_lightning_itself_does_not():
    """Lightning imports torchvision itself where it is installed; the callback adds nothing."""
    pytest.importorskip("lightning")
    assert heavy_loaded("gradrepro.lightning") == heavy_loaded("lightning.pytorch.callbacks")


def test_the_trainer_callback_loads_nothing_transformers_itself_does_not():
    """The Hugging Face Trainer callback adds nothing heavy beyond what transformers' own
    callback module loads (accelerate, where the Trainer's module imports it)."""
    pytest.importorskip("transformers")
    theirs = set(ast.literal_eval(heavy_loaded("transformers.trainer_callback")))
    assert set(ast.literal_eval(heavy_loaded("gradrepro.transformers"))) <= theirs


def test_the_experiment_stack_would_be_seen():
    """The check can fail: the CLI, which needs Hydra, is reported as loading it."""
    assert "hydra" in heavy_loaded("gradrepro.cli")

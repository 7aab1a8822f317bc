"""The package's shape: the README's experiment table is the configs', a wheel built from the
checkout runs outside it, no module imports another in a cycle, and nothing refers to files
outside the repository."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, assert_clean_error, run_module

from gradrepro.analysis import catalog

PACKAGE = ROOT / "gradrepro"


def test_readme_experiment_table_is_the_one_the_configs_give():
    readme = (ROOT / "README.md").read_text()
    assert catalog.BEGIN in readme and catalog.END in readme
    shown = readme.split(catalog.BEGIN, 1)[1].split(catalog.END, 1)[0]
    expected = catalog.block().split(catalog.BEGIN, 1)[1].split(catalog.END, 1)[0]
    assert shown.strip() == expected.strip(), "run: python -m gradrepro.analysis.catalog --write README.md"


def test_catalog_names_the_group_choice_as_the_knob():
    rows = catalog.catalog().set_index("experiment")
    assert rows.loc["`precision_fp16_noscale`", "the one knob"] == "`precision=fp16_noscale`"
    assert rows.loc["`simsiam_nostopgrad`", "the one knob"] == "`objective.stop_gradient=False`"


def _imports(path: Path, package: str) -> set:
    """Modules of ``package`` that ``path`` imports, at any depth (functions too)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if path.name == "__init__.py":
        module = module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                parts = parts if path.name == "__init__.py" else parts[:-1]
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m == package or m.startswith(package + ".")}


def test_no_import_cycles_between_modules():
    files = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in PACKAGE.rglob("*.py")}
    edges = {}
    for name, path in files.items():
        targets = set()
        for target in _imports(path, "gradrepro"):
            while target not in files and "." in target:
                target = target.rsplit(".", 1)[0]
            # a package's own submodules may import their package's __init__
            if target in files and target != name and not name.startswith(target + "."):
                targets.add(target)
        edges[name] = targets
    state, cycle = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in edges[node]:
            if state.get(nxt) == "open":
                cycle.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in edges:
        if node not in state:
            visit(node, [node])
    assert not cycle, f"import cycle: {' -> '.join(cycle[0])}"


def test_function_level_imports_are_only_for_optional_packages():
    allowed = {"tensorboard", "torch.utils.tensorboard", "lightning", "pytorch_lightning"}
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)):
                        names = [a.name for a in inner.names] if isinstance(inner, ast.Import) else [inner.module]
                        if not any(n and n.split(".")[0] in {a.split(".")[0] for a in allowed} for n in names):
                            offenders.append(f"{path.relative_to(ROOT)}:{inner.lineno} {names}")
    assert not offenders, offenders


_OUTSIDE = re.compile(r"shared/|PAPERS\.md|DESIGN\.md|STYLE\.md|\b[Ii]ssue #?\d+")


def test_nothing_refers_to_files_outside_the_repository_or_to_issue_numbers():
    places = [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.yaml"), *(ROOT / "experiments").glob("*.md"),
              *(ROOT / "docs").glob("*.md"), ROOT / "README.md"]
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:80]}" for p in places
            for i, line in enumerate(p.read_text().splitlines(), 1) if _OUTSIDE.search(line)]
    assert not hits, "\n".join(hits)


def test_a_signature_metric_nothing_records_fails_before_training(tmp_path):
    proc = run_module("gradrepro", "experiment=simsiam_nostopgrad", "scale=tiny",
                      "signature.checks.0.metric=knn_ac", f"hydra.run.dir={tmp_path / 'run'}", timeout=300)
    assert_clean_error(proc.returncode, proc.stderr, "knn_ac", "recorded by nothing", "knn_acc")
    assert not (tmp_path / "run").exists()


def test_wheel_runs_an_experiment_outside_the_checkout(tmp_path):
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "-w", str(wheels), str(ROOT)], capture_output=True, text=True, timeout=600)
    if build.returncode != 0 and "No module named" in build.stderr and "setuptools" in build.stderr:
        pytest.skip("setuptools is not installed in this environment: cannot build a wheel offline")
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = wheels.glob("gradrepro-*.whl")
    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site),
                              str(wheel)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-2000:]
    assert list(site.glob("gradrepro/configs/experiment/*.yaml")), "the wheel carries no configs"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("HYDRA_FULL_ERROR", None)
    which = subprocess.run([sys.executable, "-c", "import gradrepro; print(gradrepro.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True)
    assert which.stdout.strip().startswith(str(site)), which.stdout + which.stderr
    run = subprocess.run([sys.executable, "-m", "gradrepro", "experiment=simsiam_nostopgrad", "scale=tiny",
                          "hydra.run.dir=run"], cwd=elsewhere, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (elsewhere / "run" / "summary.json").exists()

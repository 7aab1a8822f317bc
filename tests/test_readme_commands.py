"""Every fenced command of the README that runs on a CPU works after the README's own install
(``pip install -e .``, no extras) in a fresh virtual environment: no missing package, no
traceback. Slow (it installs torch into a new venv): ``pytest -m slow tests/test_readme_commands.py``.

Offline: pip installs with ``--no-index`` from what its configuration already finds
(``PIP_FIND_LINKS``, a local wheel folder); where that cannot install the pins, the test is
skipped and says why (``GRADREPRO_README_ONLINE=1`` lets pip use its index instead). Each
command is the README's own, made fast the way the README says (``scale=tiny``, ``report
--quick``), with its folders inside a temporary one: a new command in the README that this
file does not know how to run fails the test, so the list stays whole."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow

TINY = "scale=tiny"
_RUNS = itertools.count()  # each run of the README into its own folder
# Commands the README shows that this test does not run, and why.
NOT_RUN = {
    "pip install": "the install itself: done once, offline, by the fixture",
    "pytest": "the test suite (needs the test extra; it is what runs this file)",
}


def readme_commands() -> List[str]:
    """The commands of the README's ```bash blocks, continuation lines joined, comments cut."""
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for command in block.replace("\\\n", " ").splitlines():
            command = re.sub(r"\s+#.*$", "", command).strip()
            if command:
                commands.extend(part.strip() for part in command.split("&&"))
    return commands


def readme_python_blocks() -> List[str]:
    """The README's runnable ```python blocks: not Lightning's (it needs ``[lightning]``), not an
    abridged excerpt of the package's own code."""
    text = (ROOT / "README.md").read_text()
    return [b for b in re.findall(r"```python\n(.*?)```", text, re.S)
            if "lightning" not in b and "(abridged)" not in b]


def made_fast(command: str, work: Path) -> List[str]:
    """The README's command as this test runs it (argv), or [] where it is not run here."""
    if any(command.startswith(prefix) for prefix in NOT_RUN):
        return []
    argv = command.split()
    if argv[:3] == ["python", "-m", "gradrepro"]:
        if "-m" in argv[3:]:
            return [*argv, TINY, f"hydra.sweep.dir={work / 'sweep'}"]
        return [*argv, TINY, f"hydra.run.dir={work / f'run_{next(_RUNS)}'}"]
    if argv[:3] == ["python", "-m", "gradrepro.compare"]:
        return [a.replace("results/sweeps/DATE/TIME", str(work / "sweep")) for a in argv]
    if argv[:3] == ["python", "-m", "gradrepro.report"]:
        return [*argv, "--quick", "--experiments", "simsiam_nostopgrad", "--seeds", "100", "--jobs", "2",
                "--out", str(work / "results"), "--sweep-dir", str(work / "report_sweep")]
    if argv[:3] == ["python", "-m", "gradrepro.analysis.catalog"]:
        shutil.copy(ROOT / "README.md", work / "README.md")  # writes the copy, never the checkout's
        return argv
    raise AssertionError(f"the README shows a command this test does not know how to run: {command!r}")


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    """A new venv with the pinned CPU torch and ``pip install -e .``, offline; skip if it cannot."""
    venv = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=600)
    # Offline unless GRADREPRO_README_ONLINE=1 lets pip use its index (the pins' wheels are large).
    online = os.environ.get("GRADREPRO_README_ONLINE") == "1"
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *([] if online else ["--no-index"])]
    pins = re.findall(r'"(torch==[^"]+|torchvision==[^"]+)"', (ROOT / "pyproject.toml").read_text())
    for args in (pins, ["-e", str(ROOT)]):
        proc = subprocess.run([*pip, *args], capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            pytest.skip(f"cannot install {' '.join(args)} {'' if online else 'offline '}here "
                        f"(GRADREPRO_README_ONLINE=1 to use pip's index): {proc.stderr.strip().splitlines()[-1:]}")
    return venv


def run_in(venv: Path, argv: List[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "HYDRA_FULL_ERROR")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=3600)


def test_the_readme_lists_commands_this_test_runs():
    commands = readme_commands()
    assert any(c.startswith("python -m gradrepro -m") for c in commands)
    assert any(c.startswith("python -m gradrepro.report") for c in commands)


def test_every_readme_command_runs_after_the_readmes_install(fresh_venv, tmp_path):
    python = str(fresh_venv / "bin" / "python")
    extras = subprocess.run([python, "-c", "import lightning"], capture_output=True)
    assert extras.returncode != 0, "the fresh venv holds an extra (lightning): not the README's install"
    for command in readme_commands():
        argv = made_fast(command, tmp_path)
        if not argv:
            continue
        proc = run_in(fresh_venv, argv, tmp_path)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (
            f"{command!r} as {' '.join(argv)!r} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    script = tmp_path / "readme_blocks.py"
    script.write_text("\n".join(readme_python_blocks()).replace('"runs/mine"', repr(str(tmp_path / "mine"))))
    proc = run_in(fresh_venv, [python, str(script)], tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]

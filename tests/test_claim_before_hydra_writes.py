"""Every path into a run folder claims it before Hydra writes ``.hydra/`` there: the preflight,
``HYDRA_FULL_ERROR=1`` (which skips the preflight), a quoted ``~`` (which Hydra would not
expand), a sweep folder. A folder holding a run is refused in one line with every byte of the
earlier run kept; a path the file system cannot name is one line too."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
from conftest import assert_clean_error, run_module
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf, open_dict, read_write

from gradrepro.cli.folder_claim import ClaimFolder, release_claimed
from gradrepro.errors import UserError
from gradrepro.records import claim as claims
from gradrepro.records.files import check_path_length

QUICK = ["scale=tiny", "train.steps=1", "eval.every=0", "probe.every=1"]


def earlier_run(folder: Path) -> dict:
    """A folder holding an earlier run's records; returns its bytes."""
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text("seed: 123\n")
    (folder / ".hydra" / "overrides.yaml").write_text("- seed=123\n")
    (folder / "summary.json").write_text('{"seed": 123}')
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def kept(folder: Path, before: dict) -> bool:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("full_error", ["", "1"])
def test_a_folder_holding_a_run_is_refused_before_hydra_rewrites_its_record(tmp_path, full_error):
    run = tmp_path / "run"
    before = earlier_run(run)
    proc = run_module("gradrepro", *QUICK, "seed=5", f"hydra.run.dir={run}", env={"HYDRA_FULL_ERROR": full_error}
                      if full_error else None)
    assert_clean_error(proc.returncode, proc.stderr, "already holds a run", str(run))
    assert kept(run, before)


def test_a_quoted_home_folder_is_claimed_and_written_where_the_claim_was(tmp_path):
    home = tmp_path / "home"
    before = earlier_run(home / "runs" / "old")
    env = {"HOME": str(home), "HYDRA_FULL_ERROR": "1"}
    refused = run_module("gradrepro", *QUICK, "hydra.run.dir='~/runs/old'", env=env, cwd=tmp_path)
    assert_clean_error(refused.returncode, refused.stderr, "already holds a run")
    assert kept(home / "runs" / "old", before)
    ran = run_module("gradrepro", *QUICK, "hydra.run.dir='~/runs/new'", env={"HOME": str(home)}, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    new = home / "runs" / "new"
    assert (new / "summary.json").exists() and (new / ".hydra" / "config.yaml").exists()
    assert not (tmp_path / "~").exists()  # nothing written under a folder literally named '~'
    assert not (new / "gradrepro.log").exists()  # nothing was logged: no empty log file
    assert not (new / claims.LOCK).exists()


_composed = {}


def hydra_config(key: str, value: str):
    """The composed config with Hydra's own node (as the callback gets it), ``key`` set to ``value``."""
    if not _composed:
        from gradrepro.config.compose import composer

        with composer() as compose:
            _composed["cfg"] = compose(QUICK, return_hydra_config=True)
    cfg = copy.deepcopy(_composed["cfg"])
    node = OmegaConf.select(cfg, key.rpartition(".")[0])
    with read_write(node), open_dict(node):
        node.dir = value
    return cfg


# Spellings of a folder: relative, './'-prefixed, with '..', home-relative, absolute.
spellings = st.sampled_from(["{rel}", "./{rel}", "sub/../{rel}", "~/{rel}", "{abs}"])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spelling=spellings, name=st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True), holds_run=st.booleans(),
       sweep=st.booleans())
def test_the_callback_claims_the_folder_hydra_will_write(tmp_path_factory, monkeypatch, spelling, name,
                                                         holds_run, sweep):
    root = tmp_path_factory.mktemp("cb")
    monkeypatch.setenv("HOME", str(root))
    monkeypatch.chdir(root)
    target = root / name
    if holds_run:
        (target / ("x/summary.json" if sweep else "summary.json")).parent.mkdir(parents=True, exist_ok=True)
        (target / ("x/summary.json" if sweep else "summary.json")).write_text("{}")
    key = "hydra.sweep.dir" if sweep else "hydra.run.dir"
    cfg = hydra_config(key, spelling.format(rel=name, abs=target))
    callback = ClaimFolder()
    start = callback.on_multirun_start if sweep else callback.on_run_start
    try:
        if holds_run:
            with pytest.raises(SystemExit) as stopped:
                start(config=cfg)
            assert stopped.value.code == 2
            assert not (target / claims.LOCK).exists()
            return
        start(config=cfg)
        written = Path(os.path.abspath(OmegaConf.select(cfg, key)))  # where Hydra's run_job writes
        assert written == target and claims.claimed_here(written) and (written / claims.LOCK).exists()
    finally:
        release_claimed()
    assert not (target / claims.LOCK).exists()


@settings(max_examples=20, deadline=None)
@given(length=st.integers(1, 600))
def test_a_path_component_the_file_system_cannot_name_is_one_line(length):
    path = Path("/tmp") / ("x" * length) / "run"
    if length <= 255:
        check_path_length(path, "hydra.run.dir")
        return
    with pytest.raises(UserError) as refused:
        check_path_length(path, "hydra.run.dir")
    assert "\n" not in str(refused.value) and "hydra.run.dir" in str(refused.value)


def test_a_too_long_run_folder_name_is_one_line_on_the_command_line(tmp_path):
    proc = run_module("gradrepro", *QUICK, f"hydra.run.dir={tmp_path / ('y' * 300) / 'run'}",
                      env={"HYDRA_FULL_ERROR": "1"})
    assert_clean_error(proc.returncode, proc.stderr, "hydra.run.dir", "300 bytes")

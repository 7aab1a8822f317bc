"""``gradrepro.report``: the experiment list comes from the configs, controls are added, and
the README has one row per published claim (check) with paper, measured, verdict, command."""

from __future__ import annotations

import io

import pandas as pd
import pytest
from conftest import compose_config, experiment_names, run_module

from gradrepro.analysis.evidence_report import MARKER, recorded_hash, stale_hash
from gradrepro.analysis.report import main
from gradrepro.analysis.report_header import held_words
from gradrepro.records.provenance import source_hash


def test_report_selects_experiments_from_configs_and_adds_controls():
    from gradrepro.analysis.report import select_experiments

    assert select_experiments(None) == experiment_names()
    assert select_experiments(["simsiam_nostop*"]) == ["simsiam_baseline", "simsiam_nostopgrad"]
    with pytest.raises(SystemExit, match="no experiment matches"):
        select_experiments(["zzz"])


def test_report_seeds_by_claim_kind_and_a_control_runs_on_its_failures_seeds():
    from gradrepro.analysis.report import DEFAULT_SEEDS, SEEDS_BY_KIND, seed_groups, seeds_of

    kinds = {"fail": "empirical", "base": "empirical", "mech": "mechanism", "mech_base": "mechanism",
             "mixed_base": "mechanism", "new_kind": "ours"}
    controls = {"fail": "base", "mech": "mech_base", "new_kind": "mixed_base"}
    by_kind = {"empirical": (100, 101, 102, 103, 104), "mechanism": (100, 101)}
    seeds = seeds_of(list(kinds), by_kind, kinds.get, controls.get)
    assert seeds["fail"] == seeds["base"] == (100, 101, 102, 103, 104)
    assert seeds["mech"] == seeds["mech_base"] == (100, 101)
    assert seeds["new_kind"] == seeds["mixed_base"] == DEFAULT_SEEDS  # a kind not listed: the strictest
    assert seed_groups(seeds) == [((100, 101), ["mech", "mech_base"]),
                                  ((100, 101, 102, 103, 104), ["base", "fail", "mixed_base", "new_kind"])]
    # every empirical claim on at least 5 report seeds, none a development seed (0-9 on the pages)
    assert len(SEEDS_BY_KIND["empirical"]) >= 5 and min(s for v in SEEDS_BY_KIND.values() for s in v) >= 10


def test_report_seed_flags_refuse_repeats_and_negatives(capsys):
    from gradrepro.analysis.report import main

    for flags in (["--seeds-empirical", "3", "3"], ["--seeds-mechanism", "-1"], ["--seeds", "1", "1"]):
        with pytest.raises(SystemExit) as exit_info:
            main([*flags, "--from-sweep", "nowhere"])
        assert exit_info.value.code == 2
        assert "--seeds distinct numbers >= 0" in capsys.readouterr().err


def test_sweep_command_is_one_joblib_multirun(tmp_path):
    from gradrepro.analysis.report import sweep_command

    cmd = sweep_command(["a", "b"], [100, 101, 102], 2, tmp_path, ["scale=tiny"])
    assert cmd[1:] == [
        "-m",
        "gradrepro",
        "-m",
        "experiment=a,b",
        "seed=100,101,102",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        f"hydra.sweep.dir={tmp_path}",
        "scale=tiny",
    ]


def test_report_from_a_sweep_has_one_row_per_claim_and_a_figure_per_experiment(
    joblib_sweep, tmp_path
):
    proc = run_module(
        "gradrepro.report", "--from-sweep", joblib_sweep, "--out", tmp_path, "--seeds", "2"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = (tmp_path / "README.md").read_text()
    claims = text.split("## Every check, over the seeds")[1].split("## Experiments")[0]
    rows = [line for line in claims.splitlines() if line.startswith("| simsiam_")]
    expected = {
        name: compose_config([f"experiment={name}"]).signature.checks
        for name in ("simsiam_baseline", "simsiam_nostopgrad")
    }
    assert len(rows) == sum(len(checks) for checks in expected.values())
    for name, checks in expected.items():
        mine = [r for r in rows if r.startswith(f"| {name} ")]
        assert len(mine) == len(checks)
        for row, check in zip(mine, checks):
            assert check.paper in row
            assert f"`python -m gradrepro experiment={name}`" in row
            assert " ± " in row and "/2 seeds" in row
    for name in expected:
        assert (tmp_path / "figures" / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
        assert f"](figures/{name}.png)" in text
        # Beside the claim, what its signature did here, as the table of every check counts it.
        held, n = next(r for r in rows if r.startswith(f"| {name} ")).split("/2 seeds")[0].rsplit("|", 1)[1].strip(), 2
        section = text.split(f"### {name}\n", 1)[1].split("\n### ", 1)[0]
        assert held_words("empirical", int(held), n, ["0", "1"]) in section
    # What the verdicts prove: the claim kinds, the margins of the pair, the judging code's hash.
    assert recorded_hash(text) == source_hash()
    proof = text.split("## What the verdicts prove")[1].split("## Every check, over the seeds")[0]
    assert "- Experiments: 2; 2 empirical." in proof
    margins = [line for line in proof.splitlines() if line.startswith("| simsiam_nostopgrad ")]
    assert len(margins) == len(expected["simsiam_nostopgrad"]) and all("| 0 1 " in line for line in margins)


@pytest.mark.slow
def test_quick_report_runs_the_sweep_and_writes_the_readme(tmp_path):
    proc = run_module(
        "gradrepro.report",
        "--quick",
        "--experiments",
        "simsiam_nostopgrad",
        "--seeds",
        "0",
        "1",
        "--jobs",
        "2",
        "--out",
        tmp_path / "results",
        "--sweep-dir",
        tmp_path / "sweep",
        "threads=1",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (tmp_path / "results" / "README.md").read_text()
    assert text.startswith("# Reference results (QUICK")
    claims = text.split("## Every check, over the seeds")[1].split("## Experiments")[0]
    assert claims.count("| simsiam_nostopgrad ") == len(
        compose_config(["experiment=simsiam_nostopgrad"]).signature.checks
    )
    runs = pd.read_csv(
        io.StringIO(
            run_module(
                "gradrepro.compare", tmp_path / "sweep", "--format", "csv", "--table", "runs"
            ).stdout
        )
    )
    assert len(runs) == 4  # the experiment and its control, 2 seeds each
    assert {p.name for p in (tmp_path / "results" / "figures").glob("*.png")} == {
        "simsiam_baseline.png",
        "simsiam_nostopgrad.png",
    }


def test_the_words_beside_a_claim_say_what_held_on_how_many_seeds():
    assert held_words("empirical", 1, 2, ["100", "101"]) == (
        "Here: REPRODUCED on 1 of 2 seeds (100, 101); not reproduced on the other 1.")
    assert held_words("mechanism", 2, 2, ["100", "101"]) == "Here: DEMONSTRATED on all 2 seeds (100, 101)."
    assert held_words("observation", 0, 2, ["100", "101"]) == "Here: not observed on any of the 2 seeds (100, 101)."


def test_mark_stale_puts_one_notice_stamped_with_the_current_code_and_refuses_a_current_report(tmp_path, capsys):
    old = "# Reference results\n\nGenerated once.\n\n## What the verdicts prove\n\n" + \
        MARKER.format(hash="0123456789abcdef") + "\n\n| a |\n"
    (tmp_path / "README.md").write_text(old)
    assert main(["--out", str(tmp_path), "--mark-stale", "the SimSiam batch changed."]) == 0
    assert main(["--out", str(tmp_path), "--mark-stale", "the batch and a threshold changed."]) == 0
    text = (tmp_path / "README.md").read_text()
    assert stale_hash(text) == source_hash() and recorded_hash(text) == "0123456789abcdef"
    assert text.count("These tables are out of date") == 1 and "a threshold changed." in text
    assert "the SimSiam batch changed." not in text
    assert text.index("out of date") < text.index("## What the verdicts prove")
    # a report made by the current code is not stale, and an empty reason is refused: one line each
    (tmp_path / "README.md").write_text(old.replace("0123456789abcdef", source_hash()))
    assert main(["--out", str(tmp_path), "--mark-stale", "anything."]) == 2
    assert main(["--out", str(tmp_path / "none"), "--mark-stale", "x."]) == 2
    assert main(["--out", str(tmp_path), "--mark-stale", " "]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 3 and all(line.startswith("gradrepro.report: error:") for line in lines)

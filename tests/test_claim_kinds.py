"""What a verdict proves: every experiment declares its claim kind, the verdict says REPRODUCED
(an empirical claim), DEMONSTRATED (a mechanism) or OBSERVED (an observation of ours, with no
published measurement behind it), the kind printed agrees with what the config cites,
summary.json records the kind, and a control's reference to its own experiment is an
independent replicate, never a copy of itself."""

from __future__ import annotations

import pytest
import yaml
from conftest import CONFIGS, compose_config, composed, experiment_names

from gradrepro.config.validate import validate
from gradrepro.errors import UserError
from gradrepro.measure.reference_runs import REPLICATE_SEED_OFFSET, made_references, reference_overrides
from gradrepro.records.summary_schema import CLAIM_KINDS, SummaryError, check_summary
from gradrepro.signature.evaluate import KIND_NOTES, CheckResult, Verdict, format_verdict


@pytest.mark.parametrize("experiment", experiment_names())
def test_every_experiment_declares_what_its_verdict_proves(experiment):
    assert composed(experiment).claim_kind in CLAIM_KINDS
    # Each file says it itself: a failure's kind is never left to its control's by accident.
    own = yaml.safe_load((CONFIGS / "experiment" / f"{experiment}.yaml").read_text())
    assert own.get("claim_kind") in CLAIM_KINDS, f"{experiment}.yaml does not declare claim_kind"


def _no_published_measurement(experiment: str) -> bool:
    """The config's references say that no published measurement exists."""
    paper = composed(experiment).get("paper") or {}
    return str(paper.get("published_measurement") or "").lower().startswith("none")


@pytest.mark.parametrize("experiment", experiment_names())
def test_the_printed_kind_matches_what_the_config_cites(experiment):
    """An experiment whose config says no published measurement exists is never printed as "a
    published measurement, measured again"; an observation of ours says so in its config."""
    cfg = composed(experiment)
    head = format_verdict(Verdict(True, [CheckResult("loss", 0.1, "<=", 1.0, True)]), experiment,
                          cfg.claim_kind).splitlines()[0]
    assert head.endswith(f"({KIND_NOTES[cfg.claim_kind]})")
    if _no_published_measurement(experiment):
        assert cfg.claim_kind != "empirical", f"{experiment}: no published measurement, yet printed as one"
        assert "a published measurement, measured again" not in head
    if cfg.claim_kind == "observation":
        assert _no_published_measurement(experiment), (
            f"{experiment} is an observation of ours: its paper.published_measurement must say none exists")
        assert "no published measurement" in head


@pytest.mark.parametrize("kind, held, not_held", [("empirical", "REPRODUCED", "not reproduced"),
                                                  ("mechanism", "DEMONSTRATED", "not demonstrated"),
                                                  ("observation", "OBSERVED", "not observed")])
def test_the_verdict_word_follows_the_claim_kind(kind, held, not_held):
    ok = CheckResult("loss", 0.1, "<=", 1.0, True)
    bad = CheckResult("loss", 2.0, "<=", 1.0, False)
    assert format_verdict(Verdict(True, [ok]), "x", kind).splitlines()[0].startswith(f"x: signature {held} (")
    assert format_verdict(Verdict(False, [bad]), "x", kind).splitlines()[0].startswith(f"x: signature {not_held} (")
    for other in {"REPRODUCED", "DEMONSTRATED", "OBSERVED"} - {held}:
        assert other not in format_verdict(Verdict(True, [ok]), "x", kind)


def test_an_experiment_without_a_claim_kind_is_refused_in_one_line():
    cfg = compose_config(["experiment=bn_none", "claim_kind=null"])
    refused = "claim_kind=None is not valid; choose one of: empirical, mechanism, observation"
    with pytest.raises(UserError, match=refused):
        validate(cfg)
    with pytest.raises(UserError, match="claim_kind='measured' is not valid"):
        validate(compose_config(["experiment=bn_none", "claim_kind=measured"]))


def test_summary_json_records_the_kind_and_a_reader_refuses_an_unknown_one(run_in_process):
    result = run_in_process("experiment=missing_grad/detached", "scale=tiny")
    assert result.summary["claim_kind"] == "mechanism"
    assert "signature DEMONSTRATED" in result.stdout
    with pytest.raises(SummaryError, match="claim_kind"):
        check_summary({**result.summary, "claim_kind": "anecdotal"})


def test_a_reference_to_the_runs_own_experiment_is_a_replicate_with_another_seed():
    control = compose_config(["experiment=bn_none", "seed=7"])
    assert made_references(control) == {"no_bn": "bn_none"}
    own = reference_overrides(control, [], "bn_none")
    assert f"seed={7 + REPLICATE_SEED_OFFSET}" in own and "seed=7" not in own
    failure = compose_config(["experiment=bn_speedup", "seed=7"])  # another experiment: paired, same seed
    assert "seed=7" in reference_overrides(failure, [], "bn_none")


def test_a_null_reference_drops_one_inherited_from_the_control():
    forgotten = compose_config(["experiment=zero_grad_forgotten"])
    assert forgotten.references["forgotten"] is None
    assert set(made_references(forgotten)) == {"control", "lookalike"}
    validate(forgotten)

"""The findings over logged steps, kept as the steps arrive (``watch.over_steps.StepStates``),
say what a direct reading of every row says, whatever order and shape the rows come in."""

import numpy as np
import pandas as pd
import pytest
import torch

from gradrepro.diagnose.severity import PERSIST_STEPS
from gradrepro.watch.over_steps import _STATES, StepStates, findings_over_steps, longest_run

STATES = np.array(["finite", "tiny", "zero", "none", "nonfinite", None], dtype=object)
MIX = [.4, .15, .15, .1, .1, .1]


def direct_reading(df: pd.DataFrame) -> dict:
    """Per (name, kind): rows, hits, first and last step hit, the longest run in a row; read
    from all the rows at once (the name's rows in step order)."""
    df = df.assign(name=np.where(df["module"] == "<root>", df["param"], df["module"] + "." + df["param"]))
    df = df.sort_values("step", kind="stable")
    out = {}
    for name, rows in df.groupby("name", sort=False):
        stepped = rows["grad_state"].isin(["finite", "tiny"]) & (rows["update_to_param"] == 0)
        for kind, state, _ in _STATES:
            hits = (stepped if state == "not_updated" else rows["grad_state"] == state).to_numpy()
            if hits.any():
                at = rows["step"].to_numpy()[hits]
                out[(name, kind)] = (len(rows), int(hits.sum()), int(at[0]), int(at[-1]), longest_run(hits))
    return out


def read(findings) -> dict:
    """The same facts from the findings' words."""
    out = {}
    for f in findings:
        if f.kind in {k for k, _, _ in _STATES}:
            out[(f.name, f.kind)] = f.detail
    return out


def random_rows(rng: np.random.Generator) -> pd.DataFrame:
    rows, stuck = [], rng.random() < 0.5  # then p1 is zero at every step it has: a run past PERSIST_STEPS
    for step in range(int(rng.integers(1, 14))):
        for i in range(int(rng.integers(1, 7))):
            if rng.random() < 0.15:  # a tensor absent at a logged step
                continue
            for _ in range(2 if rng.random() < 0.05 else 1):  # now and then a name twice in a step
                rows.append({"step": 4 * step, "module": "<root>" if i == 0 else f"block{i % 3}", "param": f"p{i}",
                             "grad_state": "zero" if stuck and i == 1 else rng.choice(STATES, p=MIX),
                             "update_to_param": rng.choice([0.0, 1e-3, np.nan]), "grad_norm": rng.random(),
                             "param_norm": rng.choice([1e-3, 1e9])})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("seed", range(40))
def test_kept_as_the_steps_arrive_it_says_what_every_row_says(seed):
    rng = np.random.default_rng(seed)
    df = random_rows(rng)
    if df.empty:
        return
    truth = direct_reading(df)
    whole = findings_over_steps(df.sample(frac=1.0, random_state=seed).sort_values("step", kind="stable"))
    states = StepStates()
    for step in sorted(df["step"].unique()):  # as a recorder gets them: one logged step's columns at a time
        part = df[df["step"] == step]
        states.add({key: part[key].to_numpy() for key in part.columns})
    for findings in (whole, states.findings()):
        said = read(findings)
        assert set(said) == set(truth)
        for key, (rows, hits, first, last, run) in truth.items():
            detail = said[key]
            assert f"of the {rows} logged steps" in detail
            assert (f"(steps {first}..{last})" in detail) if hits == rows else (
                f"at {hits} of" in detail and f"(first at step {first}, last at {last})" in detail)
            if key[1] in ("zero_gradient", "tiny_gradient", "no_gradient"):
                assert ("logged steps in a row" in detail and f"; {run} logged" in detail) == (run >= PERSIST_STEPS)


def test_the_optimizer_facts_are_read_when_asked():
    """Frozen and outside-the-optimizer names and the learning rate come with the question,
    not with the rows: the same rows give an error, then information once the lr is known to be 0."""
    block = {"step": np.array([0, 0]), "module": np.array(["a", "b"], dtype=object),
             "param": np.array(["weight", "weight"], dtype=object),
             "grad_state": np.array(["finite", "finite"], dtype=object), "update_to_param": np.array([0.0, 1e-3]),
             "grad_norm": np.array([1.0, 1.0]), "param_norm": np.array([1.0, 1.0])}
    states = StepStates().add(block)
    (found,) = states.findings()
    assert (found.kind, found.name, found.severity) == ("not_updated", "a.weight", "error")
    (found,) = states.findings(updates={"a.weight": (0.0, torch.float32)})
    assert found.severity == "info" and "learning rate is 0" in found.detail
    kinds = {(f.kind, f.name) for f in states.findings(frozen=["b.weight"], outside_optimizer=["a.weight"])}
    assert kinds == {("frozen", "b.weight"), ("not_in_optimizer", "a.weight"), ("not_updated", "a.weight")}


def test_rows_without_states_give_no_findings():
    assert StepStates().add({"step": np.array([0]), "module": np.array(["a"], dtype=object),
                             "param": np.array(["w"], dtype=object)}).findings() == []
    assert findings_over_steps(pd.DataFrame({"step": [0], "module": ["a"], "param": ["w"]})) == []

"""The README's sample verdict is the code's own output: the block is printed again by
``format_verdict`` from the experiment's current checks (thresholds, order, roles, paper
references) with the observed values the README shows, and must match it line for line."""

from __future__ import annotations

import re

from conftest import ROOT, compose_config
from omegaconf import OmegaConf

from gradrepro.signature.evaluate import CheckResult, Verdict, decide, format_verdict, holds
from gradrepro.signature.quantity import quantity


def readme_sample() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"It ends by printing the verdict:\n\n```\n(.*?)\n```", text, re.S)
    assert block, "the README's sample verdict block is missing"
    return block.group(1).splitlines()


def test_the_readme_sample_verdict_is_what_the_code_prints():
    lines = readme_sample()
    name = lines[0].split(":")[0]
    cfg = compose_config([f"experiment={name}"])
    checks = OmegaConf.to_container(cfg.signature.checks, resolve=True)
    names = [quantity(c["metric"], c.get("params")) for c in checks]
    observed = {}
    for line in lines[2:]:  # a row starts with the quantity's name (a gain's has two words)
        label = next((n for n in names if line.strip().startswith(n + " ")), None)
        assert label, f"the sample's row {line!r} names no check"
        observed[label] = float(line.strip()[len(label):].split()[0])
    assert sorted(observed) == sorted(names), "the sample's quantities are not the checks"
    results = []
    for c, label in zip(checks, names):
        value, threshold = observed[label], float(c["threshold"])
        results.append(CheckResult(c["metric"], value, c["op"], threshold, holds(value, c["op"], threshold),
                                   c.get("paper"), "", dict(c.get("params") or {}), c.get("role") or "evidence"))
    assert format_verdict(Verdict(decide(results), results), cfg.name, cfg.claim_kind).splitlines() == lines


def test_the_readme_says_what_no_and_NO_mean():
    text = (ROOT / "README.md").read_text()
    assert "`NO` (an **evidence** check failed" in text and "`no` (a **context** check failed" in text
    assert "--cfg job --resolve" in text
    assert "download.pytorch.org/whl/cpu" in text

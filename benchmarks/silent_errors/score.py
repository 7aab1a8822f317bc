"""The silent-error benchmark's score, by one command:

    python benchmarks/silent_errors/score.py [--set benchmark|heldout|heldout2|...|heldout8]
                                             [--half design|scored|all]
                                             [--cases NAME ...] [--healthy NAME ...] [--no-overhead]
                                             [--json out.json]

For each case (cases.py), buggy and fixed: detected or not, at which step, whether at the first
logged step after the bug acts, whether the finding names the cause the report established,
and any finding on the fixed form. Over the healthy models (healthy.py): the findings (each a
false positive). ``--set heldout`` scores the held-out set instead (cases_heldout.py,
healthy_heldout.py: written blind, not split in halves) with the same columns; ``--set heldout2``
the second held-out set (cases_heldout2.py, healthy_heldout2.py, written blind the same way);
``--set heldout3`` the third (cases_heldout3.py, healthy_heldout3.py, written blind the same way);
``--set heldout4`` to ``--set heldout8`` the fourth to the eighth (cases_heldoutN.py, healthy_heldoutN.py,
written blind the same way). Then the cost
of live checking against the bare loop and against recording without live checks (CPU time of
the training thread, interleaved rounds, medians).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # live_overhead: the timed loop

from cases import CASES, CAUSES  # noqa: E402
from harness import EVERY, run_case  # noqa: E402
from healthy import HEALTHY  # noqa: E402
from live_overhead import block  # noqa: E402
from split import HALVES, half, of_half  # noqa: E402


def first_logged_at_or_after(step: int, every: int = EVERY) -> int:
    return -(-step // every) * every


SETS = ("benchmark", "heldout", "heldout2", "heldout3", "heldout4", "heldout5", "heldout6", "heldout7", "heldout8")


def registries(which: str) -> tuple[dict, dict, dict]:
    """The cases, their causes' kinds and the healthy loops of the set ``which``: the benchmark's
    (cases.py, healthy.py), or a held-out set's (cases_WHICH.py, healthy_WHICH.py)."""
    if which == "benchmark":
        return CASES, CAUSES, HEALTHY
    cases, healthy = importlib.import_module(f"cases_{which}"), importlib.import_module(f"healthy_{which}")
    return cases.CASES, cases.CAUSES, healthy.HEALTHY


def score_case(name: str, cases: dict | None = None, causes: dict | None = None, group: str | None = None) -> dict:
    cases, causes = cases or CASES, causes or CAUSES
    case = cases[name]
    buggy, fixed = run_case(case.run, True), run_case(case.run, False)
    first = min((f.step for f in buggy.findings), default=None)
    named = sorted({f.kind for f in buggy.findings if f.step == first})
    due = first_logged_at_or_after(buggy.bug_step) if buggy.bug_step >= 0 else None
    return {"case": name, "half": group or half(name), "cause": case.cause, "url": case.url, "bug_step": buggy.bug_step,
            "detected_at": first, "in_time": first is not None and due is not None and first <= due,
            "kinds": named, "cause_named": causes[case.cause] in named,
            "fixed_findings": sorted({f"{f.kind}@{f.step}" for f in fixed.findings}),
            "error": buggy.error or fixed.error}


def score_healthy(name: str, healthy: dict | None = None, group: str | None = None) -> dict:
    out = run_case((healthy or HEALTHY)[name], True)
    return {"model": name, "half": group or half(name), "findings": [str(f) for f in out.findings],
            "kinds": sorted({f.kind for f in out.findings}), "error": out.error}


def overhead(steps: int = 48, rounds: int = 3) -> dict:
    """ResNet-18 (torchvision, weights=None) on 32x32 inputs, batch 16, SGD: CPU seconds per
    step of the bare loop, of recording without live checks, and of recording with them, at
    every=16 and every=1."""
    torch.manual_seed(0)
    data = [(torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))) for _ in range(4)]
    configs = {"bare": ("bare", 1), "record_16": ("record", 16), "live_16": ("live", 16),
               "record_1": ("record", 1), "live_1": ("live", 1)}
    times: dict[str, list[float]] = {k: [] for k in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for name, (kind, every) in configs.items():
                times[name].append(block(kind, every, steps, data, f"{tmp}/{name}{r}"))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"seconds_per_step": med,
            "live_16_vs_bare": med["live_16"] / med["bare"], "live_16_vs_record_16": med["live_16"] / med["record_16"],
            "live_1_vs_bare": med["live_1"] / med["bare"], "live_1_vs_record_1": med["live_1"] / med["record_1"]}


class _Parser(argparse.ArgumentParser):
    """Bad input gets one line naming the problem and the valid choices (no usage block), exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}\n")


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", choices=SETS, default="benchmark",
                    help="the benchmark (cases.py, healthy.py; default), the held-out set (cases_heldout.py, "
                         "healthy_heldout.py), the second held-out set (cases_heldout2.py, healthy_heldout2.py), "
                         "the third to the eighth (cases_heldoutN.py, healthy_heldoutN.py)")
    ap.add_argument("--half", choices=HALVES + ("all",), default="all",
                    help="the design half, the scored half (split.py), or all (default)")
    ap.add_argument("--cases", nargs="*", default=None, help="case names of the chosen set (default: all)")
    ap.add_argument("--healthy", nargs="*", default=None, help="healthy loops of the chosen set (default: all)")
    ap.add_argument("--no-overhead", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.set != "benchmark" and args.half != "all":
        print(f"--half {args.half} applies to the benchmark set only; the held-out set {args.set} is scored whole "
              "(leave --half out, or --half all)", file=sys.stderr)
        return 2
    all_cases, all_causes, all_healthy = registries(args.set)
    group = args.set if args.set != "benchmark" else None
    for chosen, known, what in ((args.cases, all_cases, "case"), (args.healthy, all_healthy, "healthy model")):
        bad = [n for n in chosen or [] if n not in known]
        if bad:
            print(f"unknown {what} {bad[0]!r}; choose from: {', '.join(known)}", file=sys.stderr)
            return 2
    torch.set_num_threads(1)
    cases = [score_case(n, all_cases, all_causes, group)
             for n in of_half(all_cases if args.cases is None else args.cases, None if group else args.half)]
    models = [score_healthy(n, all_healthy, group)
              for n in of_half(all_healthy if args.healthy is None else args.healthy, None if group else args.half)]
    result = {"every": EVERY, "half": args.half, "cases": cases, "healthy": models}
    if group:
        result["set"] = args.set
    for c in cases:
        print(f"{c['case']:42s} {c['cause']:20s} bug@{c['bug_step']:<3} found@{c['detected_at']!s:5s} "
              f"in_time={c['in_time']!s:5s} cause_named={c['cause_named']!s:5s} {','.join(c['kinds'])}"
              + (f"  FIXED: {c['fixed_findings']}" if c["fixed_findings"] else "")
              + (f"  ERROR {c['error']}" if c["error"] else ""))
    for m in models:
        print(f"healthy {m['model']:30s} findings={len(m['findings'])}"
              + (f"  ERROR {m['error']}" if m["error"] else ""))
        for f in m["findings"]:
            print("   ", f.splitlines()[0][:220])
    n = len(cases)
    if n:
        summary = {"cases": n, "causes": len({c["cause"] for c in cases}),
                   "detected_in_time": sum(c["in_time"] for c in cases),
                   "cause_named": sum(c["cause_named"] for c in cases),
                   "fixed_with_findings": sum(bool(c["fixed_findings"]) for c in cases),
                   "healthy": len(models),
                   "healthy_with_findings": sum(bool(m["findings"] or m["error"]) for m in models)}
        result["summary"] = summary
        print("summary:", summary)
    if not args.no_overhead:
        result["overhead"] = overhead()
        print("overhead:", json.dumps(result["overhead"], indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

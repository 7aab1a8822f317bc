"""Are two sweeps' records the same? For a refactor that must not change what any experiment
records: run every experiment (and its reference runs) at one seed before and after, e.g.

    python -m gradrepro -m 'experiment=glob(*)' seed=0 hydra/launcher=joblib \\
        hydra.launcher.n_jobs=2 hydra.sweep.dir=BEFORE        # at the old commit, then AFTER
    python benchmarks/same_records.py BEFORE AFTER [--ignore-constants PATTERN ...]

scalars.parquet and modules.parquet must be byte-identical; summary.json equal but for its
times and versions (and constants matching ``--ignore-constants`` fnmatch patterns, which a
change may add on purpose: they are listed). Prints one line per run folder; exit 1 on any
difference."""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from pathlib import Path

VOLATILE = ("wall_s", "versions")


def run_folders(root: Path) -> dict:
    return {p.parent.relative_to(root).as_posix(): p.parent for p in sorted(root.rglob("summary.json"))}


def _summary(path: Path, ignore: list) -> tuple[dict, list]:
    summary = json.loads(path.read_text())
    for key in VOLATILE:
        summary.pop(key, None)
    for ref in (summary.get("references") or {}).values():
        ref.pop("wall_s", None)
    constants = summary.get("constants") or {}
    dropped = sorted(k for k in constants if any(fnmatch.fnmatchcase(k, p) for p in ignore))
    for k in dropped:
        constants.pop(k)
    return summary, dropped


def compare(before: Path, after: Path, ignore: list, ignore_params: list) -> list:
    """One (folder, verdict) row per run folder found in either sweep."""
    a, b = run_folders(before), run_folders(after)
    rows = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            rows.append((name, f"only in {'after' if name in b else 'before'}"))
            continue
        problems = [f for f in ("scalars.parquet", "modules.parquet")
                    if (a[name] / f).exists() != (b[name] / f).exists()
                    or ((a[name] / f).exists() and (a[name] / f).read_bytes() != (b[name] / f).read_bytes())]
        (sa, _), (sb, added) = _summary(a[name] / "summary.json", ignore), _summary(b[name] / "summary.json", ignore)
        for key in ignore_params:  # a check's params changed on purpose: compare the rest of the check
            for s in (sa, sb):
                for c in s.get("checks") or []:
                    if c.get("metric") == key:
                        c.pop("params", None)
                if s.get("signature"):
                    for c in s["signature"].get("checks") or []:
                        if c.get("metric") == key:
                            c.pop("params", None)
        if sa != sb:
            keys = sorted(k for k in set(sa) | set(sb) if sa.get(k) != sb.get(k))
            problems.append(f"summary.json differs in {', '.join(keys)}")
        note = f" (added constants ignored: {len(added)})" if added else ""
        rows.append((name, ("DIFFERENT: " + "; ".join(problems)) if problems else "same" + note))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--ignore-constants", nargs="*", default=[], help="fnmatch patterns of added constants")
    parser.add_argument("--ignore-params-of", nargs="*", default=[], help="metrics whose check params changed")
    args = parser.parse_args(argv)
    rows = compare(args.before, args.after, args.ignore_constants, args.ignore_params_of)
    for name, verdict in rows:
        print(f"{verdict:<60} {name}")
    same = sum(v.startswith("same") for _, v in rows)
    print(f"{same} of {len(rows)} run folders the same")
    return 0 if same == len(rows) and rows else 1


if __name__ == "__main__":
    sys.exit(main())

"""Healthy real architectures (``tests/zoo.py``), each trained a few correct steps under
``gradrepro.record(every=1)`` and then given to ``gradrepro.diagnose``: how many get any
warning or error, and how many crash.

    python benchmarks/zoo_score.py --half design            # the half the rules were designed on
    python benchmarks/zoo_score.py --half scored            # the half kept for scoring
    python benchmarks/zoo_score.py --half all --heldout     # other batch, input size, optimizer and seed
    python benchmarks/zoo_score.py --half all --heldout2    # a second such variation, run once
    python benchmarks/zoo_score.py --half all --heldout3    # a third, run once
    python benchmarks/zoo_score.py --half all --heldout4    # a fourth, run once
    python benchmarks/zoo_score.py --half all --heldout5    # a fifth, run once
    python benchmarks/zoo_score.py --models tv/resnet18 hf/gpt2 --json out.json

Default run: plain SGD (lr 0.01), batch 2, each model's small input, 3 steps, seed 0.
``--heldout``: batch 3, inputs half as large again, Adam, AdamW or SGD with momentum (fixed
per model by the hash of its name), seed 1. ``--heldout2``, fixed before it was first run and
run once, after the last change to the checks it measures: batch 4, inputs a quarter as large
again (``size + size // 4``), seed 2, and plain SGD, SGD with momentum, Adam or AdamW, fixed per
model by the hash of ``"heldout2:" + name`` (another assignment than ``--heldout``'s, and plain
SGD among them). ``--heldout3``, fixed the same way before its one run, after the rule for zero
gradients behind closed ReLU gates: batch 5, inputs three eighths as large again
(``size + 3 * size // 8``), seed 3, optimizers by the hash of ``"heldout3:" + name`` over the same
four. ``--heldout4``, fixed the same way before its one run, after the zoo's CLIP config was
given an end-of-text token inside its vocabulary (the checks unchanged since ``--heldout3``):
batch 6, inputs an eighth as large again (``size + size // 8``), seed 4, optimizers by the hash
of ``"heldout4:" + name`` over the same four. ``--heldout5``, fixed the same way before its one
run, after the live checks for unregistered tensors, projections between steps, an optimizer that
never steps, a step before its backward and eval mode in a frozen part: batch 7, inputs a
sixteenth as large again (``size + size // 16``), seed 5, optimizers by the hash of
``"heldout5:" + name`` over the same four. One thread; run it with ``nice``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import zoo  # noqa: E402

HELDOUT_OPTIMIZERS = ("adam", "adamw", "sgd_momentum")


def heldout_optimizer(name: str) -> str:
    return HELDOUT_OPTIMIZERS[int(hashlib.sha256(name.encode()).hexdigest(), 16) // 2 % len(HELDOUT_OPTIMIZERS)]


HELDOUT2_OPTIMIZERS = ("sgd", "sgd_momentum", "adam", "adamw")


def hashed_optimizer(salt: str, name: str) -> str:
    digest = int(hashlib.sha256(f"{salt}:{name}".encode()).hexdigest(), 16)
    return HELDOUT2_OPTIMIZERS[digest % len(HELDOUT2_OPTIMIZERS)]


def heldout2_optimizer(name: str) -> str:
    return hashed_optimizer("heldout2", name)


# The held-out variations: (optimizer of a model's name, batch, input size of the model's own, seed).
VARIATIONS = {
    "heldout": (heldout_optimizer, 3, lambda size: size + size // 2, 1),
    "heldout2": (heldout2_optimizer, 4, lambda size: size + size // 4, 2),
    "heldout3": (lambda name: hashed_optimizer("heldout3", name), 5, lambda size: size + 3 * size // 8, 3),
    "heldout4": (lambda name: hashed_optimizer("heldout4", name), 6, lambda size: size + size // 8, 4),
    "heldout5": (lambda name: hashed_optimizer("heldout5", name), 7, lambda size: size + size // 16, 5),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--half", choices=("design", "scored", "all"), default="design")
    parser.add_argument("--models", nargs="*", default=None, help="names from tests/zoo.py (overrides --half)")
    parser.add_argument("--heldout", action="store_true", help="other batch, input size, optimizer and seed")
    parser.add_argument("--heldout2", action="store_true", help="a second variation: batch 4, inputs 1.25x, seed 2")
    parser.add_argument("--heldout3", action="store_true", help="a third variation: batch 5, inputs 1.375x, seed 3")
    parser.add_argument("--heldout4", action="store_true", help="a fourth variation: batch 6, inputs 1.125x, seed 4")
    parser.add_argument("--heldout5", action="store_true", help="a fifth variation: batch 7, inputs 1.0625x, seed 5")
    parser.add_argument("--json", default=None, help="write every outcome here")
    args = parser.parse_args(argv)
    chosen = [v for v in VARIATIONS if getattr(args, v)]
    if len(chosen) > 1:
        print(f"{' and '.join('--' + v for v in chosen)} are different variations: choose one", file=sys.stderr)
        return 2
    variation = VARIATIONS[chosen[0]] if chosen else None
    torch.set_num_threads(1)
    zoo_entries = zoo.entries()
    unknown = [m for m in args.models or [] if m not in zoo_entries]
    if unknown:
        print(f"unknown model {unknown[0]!r}; the zoo's names: {', '.join(sorted(zoo_entries))}", file=sys.stderr)
        return 2
    names = args.models or [n for n in zoo_entries if args.half == "all" or zoo.half(n) == args.half]
    rows = []
    for name in names:
        entry, start = zoo_entries[name], time.perf_counter()
        if variation is not None:
            optimizer_of, batch, size_of, seed = variation
            optimizer = optimizer_of(name)
            out = zoo.run(entry, optimizer, batch=batch, size=size_of(entry.size), seed=seed)
        else:
            optimizer, out = "sgd", zoo.run(entry)
        seconds = time.perf_counter() - start
        rows.append({"model": name, "half": zoo.half(name), "optimizer": optimizer, "flagged": out.flagged,
                     "kinds": out.kinds,
                     "crash": out.crash, "unfit": out.unfit, "seconds": round(seconds, 2),
                     "load": os.getloadavg()[0]})
        if args.json:  # after every model, so that a run stopped part-way keeps what it measured
            write(args, rows)
        status = "UNFIT " + out.unfit if out.unfit else ("CRASH " + out.crash.splitlines()[0] if out.crash else
                                                         (", ".join(out.kinds) or "clean"))
        print(f"{name:45s} {seconds:6.1f}s  {status}", flush=True)
    judged = [r for r in rows if not r["unfit"]]
    flagged = [r for r in judged if r["flagged"]]
    crashed = [r for r in judged if r["crash"]]
    kinds = Counter(k for r in judged for k in r["kinds"])
    print(f"\nmodels {len(judged)} (unfit, left out: {len(rows) - len(judged)}); with any warning or error: "
          f"{len(flagged)} ({100 * len(flagged) / max(len(judged), 1):.1f}%); crashed: {len(crashed)}")
    for kind, n in kinds.most_common():
        print(f"  {kind}: {n} models")
    return 0


def write(args: argparse.Namespace, rows: list[dict]) -> None:
    path = Path(args.json)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({**{v: getattr(args, v) for v in VARIATIONS}, "half": args.half, "rows": rows},
                              indent=1))
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())

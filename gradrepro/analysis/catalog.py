"""The experiment catalogue: one row per failure experiment, built from the configs, so the
README's table cannot drift from what the configs say (a test compares the two).

The knob column is computed, not written: the config groups whose choice differs between an
experiment and its control (``precision=fp16_noscale``), then the keys that still differ
outside those groups (``objective.stop_gradient=False``). Identity (name, claim), the
verdict's own definition (signature, references, paper) and display (key_scalar, page,
citation) are not knobs.

Beside each claim, ``held here``: on how many of the committed reference table's seeds
(``results/README.md``) the experiment's signature held, and under the table the failures and
controls for which it did not hold on every seed, by name.

``python -m gradrepro.analysis.catalog`` prints the table; ``--write README.md`` replaces the
table between the README's markers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import pandas as pd
from omegaconf import DictConfig, OmegaConf, open_dict

from gradrepro.analysis.fit_width import markdown
from gradrepro.analysis.reference_table import report_seeds, signature_held
from gradrepro.config.compose import composer, group_options_recursive
from gradrepro.records.files import atomic_write

BEGIN = "<!-- experiments: generated from the configs by `python -m gradrepro.analysis.catalog --write README.md` -->"
END = "<!-- end of the generated experiments table -->"
NOT_KNOBS = ("name", "control", "claim", "claim_kind", "signature", "references", "paper", "key_scalar", "page",
             "citation")
GROUPS = ("model", "data", "objective", "optim", "init", "precision", "probe", "logger")


def _flat(node: Any, prefix: str = "") -> Dict[str, Any]:
    if not isinstance(node, dict):
        return {prefix[:-1]: node}
    out: Dict[str, Any] = {}
    for key, value in node.items():
        out.update(_flat(value, f"{prefix}{key}."))
    return out


def _plain(cfg: DictConfig) -> Dict[str, Any]:
    """The composed config resolved, with Hydra's group choices as ``choices``."""
    choices = OmegaConf.to_container(cfg.hydra.runtime.choices)
    with open_dict(cfg):
        del cfg["hydra"]
    return {**OmegaConf.to_container(cfg, resolve=True), "choices": choices}


def knob(experiment: Dict[str, Any], control: Dict[str, Any]) -> List[str]:
    """What differs between two configs (``_plain``: resolved, with their group choices)."""
    choices, control_choices = experiment["choices"], control["choices"]
    groups = [g for g in GROUPS if choices.get(g) != control_choices.get(g)]
    out = [f"{g}={choices.get(g)}" for g in groups]
    mine, theirs = _flat(experiment), _flat(control)
    for key in sorted(set(mine) | set(theirs)):
        head = key.split(".")[0]
        if head in NOT_KNOBS or head == "choices" or head in groups or mine.get(key) == theirs.get(key):
            continue
        out.append(f"{key}={mine.get(key)}")
    return out


def catalog() -> pd.DataFrame:
    """One row per failure experiment: experiment, control, claim kind, knob, citation, page."""
    with composer() as compose:
        configs = {name: _plain(compose([f"experiment={name}"], return_hydra_config=True))
                   for name in group_options_recursive("experiment")}
    by_name = {cfg["name"]: option for option, cfg in configs.items()}
    held = signature_held()
    rows = []
    for option, cfg in configs.items():
        if cfg["control"] is None:
            continue
        control = configs[by_name[cfg["control"]]]
        rows.append({
            "experiment": f"`{option}`",
            "control": f"`{by_name[cfg['control']]}`",
            "claim": cfg["claim_kind"],
            "held here": held.get(option, "not in results/README.md"),
            "the one knob": ", ".join(f"`{k}`" for k in knob(cfg, control)),
            "source": cfg["citation"],
            "page": f"[{cfg['page']}]({cfg['page']})" if cfg["page"] else "",
        })
    return pd.DataFrame(rows)


def _not_every_seed(names: Sequence[str], held: Dict[str, str]) -> List[str]:
    out = []
    for name in names:
        done, _, total = held.get(name, "").partition("/")
        if done != total:
            out.append(f"`{name}` ({held.get(name, 'not in the table')})")
    return out


def held_sentence(table: pd.DataFrame) -> str:
    """Which failures, and which of their controls, did not hold on every seed of the reference table."""
    held = signature_held()
    if not held:
        return "`results/README.md` has no table of every check: nothing is said here of what reproduced."
    failures = [e.strip("`") for e in table["experiment"]]
    controls = sorted({c.strip("`") for c in table["control"]})
    missed, missed_controls = _not_every_seed(failures, held), _not_every_seed(controls, held)
    said = (f"`held here`: on how many of the reference table's seeds (`results/README.md`, seeds "
            f"{report_seeds() or 'as its header says'}) the experiment's signature held. ")
    said += (f"Failures whose signature did not hold on every seed: {', '.join(missed)}. " if missed
             else "Every failure's signature held on every seed. ")
    said += (f"Controls whose own signature did not hold on every seed: {', '.join(missed_controls)}."
             if missed_controls else "Every control's own signature held on every seed.")
    return said


def block() -> str:
    """The README's table, between its markers, and what did not hold on every seed."""
    table = catalog()
    return f"{BEGIN}\n\n{markdown(table)}\n\n{held_sentence(table)}\n\n{END}"


def replace_block(text: str, new_block: str) -> str:
    if BEGIN not in text or END not in text:
        raise ValueError(f"no table markers in the file: add the lines {BEGIN!r} and {END!r}")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + new_block + tail


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradrepro.analysis.catalog",
                                     description="The experiment table, from the configs.")
    parser.add_argument("--write", type=Path, metavar="README.md",
                        help="replace the table between the file's markers")
    args = parser.parse_args(argv)
    new_block = block()
    if args.write is None:
        print(new_block)
        return 0
    text = replace_block(args.write.read_text(), new_block)
    atomic_write(args.write, lambda tmp: Path(tmp).write_text(text))
    print(f"wrote the experiments table into {args.write}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

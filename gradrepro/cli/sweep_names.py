"""Sweep folder names that say only what varied.

Hydra names a sweep job's folder from ``hydra.job.override_dirname``, which it builds from
every override on the command line, swept or not (Hydra 1.3 docs, "Customizing working
directory pattern"): ``-m experiment=a,b scale=tiny`` would give ``experiment=a,scale=tiny``,
repeating in every folder a knob that is the same for all. Hydra offers one way to leave keys
out, ``hydra.job.config.override_dirname.exclude_keys``; the command line is read here, before
Hydra, and the keys of the overrides that are not swept are added to it (the seed is always
left out: it names the folder inside). What every job shares stays recorded: in the sweep's
``multirun.yaml`` and in each job's ``.hydra/overrides.yaml``. A command line that sets
``exclude_keys`` itself is left as it is."""

from __future__ import annotations

from typing import List, Optional, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser

EXCLUDE_KEY = "hydra.job.config.override_dirname.exclude_keys"


def fixed_keys(overrides: Sequence[str]) -> List[str]:
    """The keys of the task overrides that are not sweeps (``hydra.*`` overrides are Hydra's)."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # noqa: BLE001 - the preflight has reported a bad override already
        return []
    keys = []
    for o in parsed:
        key = o.key_or_group
        if not o.is_sweep_override() and not key.startswith("hydra") and key not in keys:
            keys.append(key)
    return keys


def exclude_fixed_knobs(overrides: Sequence[str]) -> Optional[str]:
    """The override that leaves the fixed knobs out of the job folder names, or None."""
    if any(o.lstrip("+").startswith(EXCLUDE_KEY + "=") for o in overrides):
        return None
    keys = ["seed", *[k for k in fixed_keys(overrides) if k != "seed"]]
    return f"{EXCLUDE_KEY}=[{','.join(repr(k) for k in keys)}]"

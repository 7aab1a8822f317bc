"""The preflight: before ``hydra.main`` runs anything, compose every config a command line
asks for (each value of a sweep once), validate it, build its model on the CPU and check its
output folder, so that bad input is one line and exit code 2, never a traceback after data
have loaded. Also: ``glob(...)`` over experiment subfolders, launchers from extras, and the
claim of the run or sweep folder (``claim_output``) before Hydra writes into it."""

from __future__ import annotations

import argparse
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob
from omegaconf import DictConfig, OmegaConf

from gradrepro.cli.messages import explain, group_options
from gradrepro.cli.override_checks import check_choice_names, check_deletions, check_references
from gradrepro.config.compose import CONFIG_DIR, Compose, composer, group_options_recursive
from gradrepro.config.validate import validate
from gradrepro.errors import UserError, first_line, quiet_unless_it_fails
from gradrepro.recipe.build import build_untrained
from gradrepro.recipe.footprint import check_footprint
from gradrepro.records.claim import claim, claim_fresh, runs_below
from gradrepro.records.files import check_writable_path

# The folder Hydra resolves a relative --config-path against: where the app is declared.
APP_DIR = Path(__file__).resolve().parent


def expand_globs(argv: Sequence[str], config_dir: Path = CONFIG_DIR) -> List[str]:
    """``group=glob(...)`` -> ``group=a,b,sub/c``: Hydra's own glob lists only a group's top
    folder, so experiments in subfolders would silently drop out of ``experiment=glob(*)``.
    Hydra's fnmatch rules apply (``*`` also matches ``/``); ``exclude=`` is honoured."""
    parser = OverridesParser.create()
    out = []
    for arg in argv:
        if arg.startswith("-") or "glob(" not in arg:
            out.append(arg)
            continue
        try:
            override = parser.parse_override(arg)
        except Exception as exc:
            raise UserError(f"could not parse the override {arg!r}: {explain(exc)}") from None
        group = override.key_or_group
        if not isinstance(override.value(), Glob) or group.startswith("hydra") or not (
            config_dir / group
        ).is_dir():
            out.append(arg)
            continue
        options = group_options_recursive(group, config_dir)
        chosen = override.value().filter(options)
        if not chosen:
            raise UserError(f"{arg} matches no {group} config; valid choices: {', '.join(options)}")
        out.append(f"{override.get_key_element()}={','.join(chosen)}")
    return out


# Launchers that come from an optional extra: a missing plugin is one line, not Hydra's report.
_LAUNCHER_PLUGINS = {
    "joblib": ("hydra_plugins.hydra_joblib_launcher", "sweep"),
    "submitit_local": ("hydra_plugins.hydra_submitit_launcher", "sweep"),
    "submitit_slurm": ("hydra_plugins.hydra_submitit_launcher", "sweep"),
    "slurm": ("hydra_plugins.hydra_submitit_launcher", "sweep"),
    "ray": ("hydra_plugins.hydra_ray_launcher", "ray"),
}


def check_launcher(argv: Sequence[str]) -> None:
    """``hydra/launcher=X`` whose plugin is not installed: a UserError naming the extra."""
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.lstrip("+") == "hydra/launcher" and value in _LAUNCHER_PLUGINS:
            module, extra = _LAUNCHER_PLUGINS[value]
            if not _installed(module):
                raise UserError(f"hydra/launcher={value} needs {module.split('.')[1]}: "
                                f"pip install -e '.[{extra}]'")


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported; a missing parent package (``hydra_plugins`` itself,
    where no plugin is installed) is missing too, not a ModuleNotFoundError."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


class RepeatedSweepValue(UserError):
    """A sweep that lists one value twice (``seed=0,0``)."""


def _sweep_variants(overrides: list[str]) -> list[list[str]]:
    """Override lists to compose: each sweep value once, the other sweeps at their first value."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    base, sweeps = [], []
    for raw, o in zip(overrides, parsed):
        if o.is_sweep_override():
            if isinstance(o.value(), Glob):  # glob(...) over a config group's choices
                values = o.value().filter(group_options(o.get_key_element().lstrip("+~")))
            else:
                values = list(o.sweep_string_iterator())
            repeated = sorted({str(v) for v in values if list(values).count(v) > 1})
            if repeated:  # two jobs of one sweep would share a folder and replace its records
                raise RepeatedSweepValue(f"{raw} lists {', '.join(map(repr, repeated))} more than once: two jobs "
                                         "would write one folder; list each value once")
            sweeps.append((o, values))
        else:
            base.append(raw)
    if not sweeps:
        return [base]
    firsts = [f"{o.get_key_element()}={vals[0]}" for o, vals in sweeps if vals]
    variants = []
    for i, (o, values) in enumerate(sweeps):
        others = [f for j, f in enumerate(firsts) if j != i]
        for v in values:
            variants.append(base + others + [f"{o.get_key_element()}={v}"])
    return variants


def parse_argv(argv: Sequence[str]) -> argparse.Namespace | None:
    """Hydra's own reading of the command line; None where Hydra must answer (usage errors,
    ``--version``): it prints those itself."""
    if "--version" in argv:
        return None
    parser = get_args_parser()
    parser.exit_on_error = False
    try:
        args, unknown = parser.parse_known_args(list(argv))
    except (argparse.ArgumentError, SystemExit):
        return None
    return None if unknown else args


def _searchpath_override(overrides: list[str], config_dir: str | None) -> list[str]:
    """``--config-dir DIR`` as the compose API understands it: a search-path entry."""
    if not config_dir:
        return overrides
    entry = "file://" + os.path.abspath(config_dir)
    for i, o in enumerate(overrides):
        if o.startswith("hydra.searchpath="):
            items = o.split("=", 1)[1].strip().strip("[]")
            overrides = list(overrides)
            overrides[i] = f"hydra.searchpath=[{entry}{',' + items if items else ''}]"
            return overrides
    return [*overrides, f"hydra.searchpath=[{entry}]"]


def _config_dir(config_path: str | None) -> Path:
    if not config_path:
        return CONFIG_DIR
    path = Path(config_path)  # Hydra: absolute, or relative to the file that declares main
    return path if path.is_absolute() else (APP_DIR / path).resolve()


@dataclass
class Checked:
    """What the preflight composed: the config (the last variant of a sweep), its overrides,
    and the output folder it names (None where only Hydra can resolve it)."""

    cfg: Optional[DictConfig]
    overrides: List[str]
    key: str  # hydra.run.dir, or hydra.sweep.dir with -m
    path: Optional[Path]
    explicit: bool  # named on the command line (claimed as is) or a default (made unique)
    sweep: bool
    forced: Dict[str, str] = field(default_factory=dict)  # override -> ++override (forced_for_sweep)


def check(argv: Sequence[str], compose_only: bool = False) -> Checked:
    """Compose and validate the config(s) that ``argv`` asks for; raise UserError if bad.
    ``compose_only``: compose, nothing more (``--cfg``, ``--help``: a config may be shown
    whatever its values)."""
    args = parse_argv(argv)
    if args is None:
        raise UserError(f"could not read the command line {' '.join(argv)!r}; see --help")
    overrides = _searchpath_override(list(args.overrides), args.config_dir)
    config_name = args.config_name or "config"
    config_dir = _config_dir(args.config_path)
    if not config_dir.is_dir():
        raise UserError(f"--config-path {str(config_dir)!r} is not a folder")
    check_choice_names(overrides, config_dir)
    with composer(config_dir) as compose:
        try:
            variants = _sweep_variants(overrides)
        except RepeatedSweepValue:
            raise
        except Exception as exc:  # noqa: BLE001 - Hydra raises many types
            raise UserError(f"could not parse the overrides: {explain(exc)}") from None
        if len(variants) > 1 and not args.multirun:
            raise UserError(
                "a sweep (a,b or range(...)) needs -m (--multirun); without it Hydra runs nothing")
        last_cfg, path = None, None
        for variant in variants:
            check_deletions(compose, variant, config_name, config_dir)
            try:
                cfg = compose(variant, config_name=config_name)
                last_cfg = cfg
                if not compose_only:  # interpolation errors and unset values surface here
                    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
            except Exception as exc:  # noqa: BLE001 - Hydra raises many types
                raise UserError(explain(exc, last_cfg)) from None
            if compose_only:
                continue
            with quiet_unless_it_fails():
                try:
                    validate(cfg)
                    check_references(compose, cfg, config_name)
                    check_footprint(cfg)  # before the real build allocates anything
                    check_buildable(cfg)
                except UserError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a value the checks could not even compare
                    raise UserError(explain(exc, last_cfg)) from None
            path = check_output_dir(compose, config_name, variant, args.multirun)
        forced = {} if compose_only or not args.multirun else forced_for_sweep(
            compose, overrides, config_name, config_dir)
    key = "hydra.sweep.dir" if args.multirun else "hydra.run.dir"
    explicit = any(o.lstrip("+").startswith(f"{key}=") for o in args.overrides)
    return Checked(last_cfg, list(args.overrides), key, path, explicit, bool(args.multirun), forced)


def forced_for_sweep(compose: Compose, overrides: List[str], config_name: str,
                     config_dir: Path) -> Dict[str, str]:
    """Before its jobs, Hydra composes a sweep's primary config with the swept overrides left
    out. A key that only a swept choice brings (``data.background_std`` beside
    ``experiment=simsiam_baseline,simsiam_nostopgrad``, whose default data has no such key)
    fails there, although every job has it. Every job was composed above with the plain
    override, so ``++`` (set the key, adding it where missing) gives each job the same config
    and lets the primary compose pass. Returns ``{override: ++override}`` (empty where nothing
    needs it); a primary config that fails for another reason is one line."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    if not any(o.is_sweep_override() for o in parsed):
        return {}
    fixed = [(raw, o) for raw, o in zip(overrides, parsed) if not o.is_sweep_override()]
    try:
        compose([raw for raw, _ in fixed], config_name=config_name)
        return {}
    except Exception:  # noqa: BLE001 - Hydra raises many types; retried below
        pass
    plain = {raw: o.key_or_group for raw, o in fixed
             if not raw.startswith(("+", "~")) and not o.key_or_group.startswith("hydra")
             and not (config_dir / o.key_or_group).is_dir()}
    try:
        primary = compose([raw for raw, _ in fixed if raw not in plain], config_name=config_name)
        absent = object()
        forced = {raw: f"++{raw}" for raw, key in plain.items()
                  if OmegaConf.select(primary, key, default=absent) is absent}
        compose([forced.get(raw, raw) for raw, _ in fixed], config_name=config_name)
    except Exception as exc:  # noqa: BLE001 - Hydra raises many types
        raise UserError(f"the sweep's primary config (the command without its swept values) does not "
                        f"compose: {explain(exc)}") from None
    return forced


def claim_output(checked: Checked) -> Path:
    """Claim the folder a run or sweep will write, before Hydra writes into it: a named one
    as is (refused if it holds a run or another run holds it), a default one under a fresh
    name. A sweep folder must hold no runs yet; each job claims its own folder when it runs."""
    what = checked.key
    if checked.sweep:
        if checked.explicit and Path(checked.path).is_dir():
            found = runs_below(checked.path)
            if found is not None:
                raise UserError(f"{what}={str(checked.path)!r} already holds runs ({str(found)!r}): "
                                "choose a new sweep folder")
            return claim(checked.path, what, markers=())
        return claim_fresh(checked.path, what)
    if checked.explicit:
        return claim(checked.path, what)
    return claim_fresh(checked.path, what)


_built: set = set()


def check_buildable(cfg: DictConfig) -> None:
    """Build the objective, model and optimizer once on the CPU (no data, no training), so a
    value that only the model's own code rejects (a zero width, say) is one line here."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    key = repr([plain[k] for k in ("model", "objective", "init", "optim", "train")])
    if key in _built:  # a sweep over seeds or data builds each distinct model once
        return
    try:
        build_untrained(cfg)
        _built.add(key)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - any error here is a config the code rejects
        first = first_line(exc)
        if isinstance(exc, KeyError) and exc.args:  # a lookup table without that entry
            keys = _keys_holding(cfg, exc.args[0])
            first = (f"{keys[0]}={exc.args[0]!r} is not a value the code knows" if keys
                     else f"unknown value {exc.args[0]!r}")
        raise UserError(f"the model, objective or optimizer cannot be built from this config: "
                        f"{first}") from None


def _keys_holding(cfg, value) -> list[str]:
    """The config keys whose value is ``value`` (to name the key behind a failed lookup)."""
    flat = []

    def walk(node, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{prefix[:-1]}[{i}].")
        elif node == value:
            flat.append(prefix[:-1])

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return flat


def check_output_dir(compose: Compose, config_name: str, overrides: list[str], multirun: bool) -> Optional[Path]:
    """The run (or sweep) folder must be creatable and writable before any training starts.

    Checks ``hydra.run.dir`` (``hydra.sweep.dir`` with -m) and returns it. Where that path
    names values Hydra fills only at run time (``hydra.job.*``), the runner checks the folder
    instead (None).
    """
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    try:
        hydra_cfg = compose(overrides, config_name=config_name, return_hydra_config=True)
        path = OmegaConf.select(hydra_cfg, key)
    except Exception:  # noqa: BLE001 - runtime-only interpolations: left to the runner
        return None
    if path is None or not str(path).strip():
        raise UserError(f"{key} is empty: it would write into the current folder; name a folder "
                        f"({key}=PATH) or leave the default")
    check_writable_path(Path(str(path)), key)
    return Path(os.path.abspath(os.path.expanduser(str(path))))  # as Hydra will name it: 'a/../b' is 'b'

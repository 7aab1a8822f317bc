"""Config errors as one line and exit code 2, before Hydra prints its multi-line report.

``python -m gradrepro ...`` first composes the config with Hydra's compose API (every
combination a sweep names, one value at a time) and validates it; only a config that
composes and validates is handed to ``hydra.main``. ``HYDRA_FULL_ERROR=1`` skips this
translation and shows Hydra's own report, as Hydra users expect. Hydra's own flags
(``--help``, ``--cfg job``, ``--info``, ...) go to Hydra untouched; ``--config-name``,
``--config-dir`` and ``hydra.searchpath`` are honoured by the preflight too.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import sys
from pathlib import Path
from typing import List, Sequence

from gradrepro.errors import EXIT_USER_ERROR, UserError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
# Flags after which Hydra prints something instead of running: these reach Hydra untouched.
_HYDRA_ONLY = ("help", "hydra_help", "cfg", "info", "shell_completion", "experimental_rerun")


def group_options(group: str) -> list[str]:
    from hydra.core.global_hydra import GlobalHydra

    loader = GlobalHydra.instance().config_loader()
    return sorted(o for o in loader.get_group_options(group) if not o.endswith("_schema"))


def _did_you_mean(word: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _schemas() -> dict[str, type]:
    """Every config dataclass by class name (the name Hydra's messages use)."""
    from gradrepro.config import Config
    from gradrepro.data import DATA_SCHEMAS
    from gradrepro.models import MODEL_SCHEMAS
    from gradrepro.objectives import OBJECTIVE_SCHEMAS

    found: dict[str, type] = {}
    todo = [Config, *MODEL_SCHEMAS.values(), *DATA_SCHEMAS.values(), *OBJECTIVE_SCHEMAS.values()]
    while todo:
        cls = todo.pop()
        if cls.__name__ in found:
            continue
        found[cls.__name__] = cls
        for f in dataclasses.fields(cls):
            factory = f.default_factory
            if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
                todo.append(factory)
    return found


def unknown_key_message(key: str, valid: Sequence[str], where: str = "", note: str = "") -> str:
    """``unknown config key 'a.b' in X (did you mean ...); valid keys under a: ...``."""
    parent, _, leaf = key.rpartition(".")
    location = (f" in {where}" if where else "") + (f" ({note})" if note else "")
    hint = _did_you_mean(leaf, valid) if valid else ""
    listing = (f"; valid keys{' under ' + parent if parent else ''}: {', '.join(valid)}"
               if valid else "")
    return f"unknown config key {key!r}{location}{hint}{listing}"


def explain(exc: BaseException) -> str:
    """One line naming the problem and, where there are some, the valid choices."""
    from omegaconf.errors import ConfigKeyError, ValidationError

    text = str(exc)
    cause = exc.__cause__ or exc.__context__
    missing = re.search(r"Could not find '([^']+)'", text)
    if missing:
        path = missing.group(1)
        group, _, choice = path.rpartition("/")
        if group:
            local = CONFIG_DIR / group
            options = group_options_recursive(group) if local.is_dir() else group_options(group)
            return (f"unknown {group} {choice!r}{_did_you_mean(choice, options)}; "
                    f"valid choices: {', '.join(options)}")
        return f"config {path!r} not found"
    where = re.match(r"In '([^']+)'", text)
    where = where.group(1) if where else ""
    for err in (exc, cause):
        if err is None:
            continue
        message = str(err)
        if isinstance(err, ConfigKeyError) or "not in struct" in message or "Key '" in message:
            key = re.search(r"Key '([^']+)'", message)
            full_key = (getattr(err, "full_key", None)
                        or (re.search(r"full_key: (\S+)", message) or [None, None])[1]
                        or (key.group(1) if key else "?"))
            valid = _valid_keys(err, message, full_key.rpartition(".")[0])
            return unknown_key_message(full_key, valid, where)
    for err in (exc, cause):
        if isinstance(err, ValidationError):
            full_key = getattr(err, "full_key", "") or "?"
            first = str(err).splitlines()[0]
            return f"{full_key}: {first}" + (f" (in {where})" if where else "")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    if len(lines) > 1 and (first.startswith(("In '", "Error parsing override"))):
        first = f"{first}: {lines[1]}"  # the second line says what is wrong
    unset = re.match(r"Missing mandatory value: (\S+)", first)
    if unset:
        key = unset.group(1)
        options = group_options(key) if "." not in key else []
        listing = f"; choose one of: {', '.join(options)}" if options else ""
        return f"{key} must be set (it is required and has no value){listing}"
    return first


_last_cfg = None


def _valid_keys(err: BaseException, message: str, parent: str) -> list[str]:
    """The keys the schema allows where an unknown key was found."""
    schema = getattr(err, "object_type", None)
    if not dataclasses.is_dataclass(schema):
        name = re.search(r"object_type=(\w+)", message) or re.search(r"not in '(\w+)'", message)
        schema = _schemas().get(name.group(1)) if name else None
    if dataclasses.is_dataclass(schema):
        return sorted(f.name for f in dataclasses.fields(schema))
    return _keys_at(parent)


def _keys_at(parent: str) -> list[str]:
    """Keys that exist at ``parent`` in the last composed (or base) config."""
    from omegaconf import OmegaConf

    from gradrepro.config import Config

    cfg = _last_cfg if _last_cfg is not None else OmegaConf.structured(Config)
    try:
        node = OmegaConf.select(cfg, parent) if parent else cfg
        return sorted(str(k) for k in node.keys())
    except Exception:  # noqa: BLE001 - a missing or non-dict parent: no listing
        return []


def group_options_recursive(group: str) -> List[str]:
    """Every config of ``group``, subfolders included (``missing_grad/x``), schemas left out."""
    folder = CONFIG_DIR / group
    return sorted(str(p.relative_to(folder).with_suffix("")) for p in folder.rglob("*.yaml"))


def expand_globs(argv: Sequence[str]) -> List[str]:
    """``group=glob(...)`` -> ``group=a,b,sub/c``: Hydra's own glob lists only a group's top
    folder, so experiments in subfolders would silently drop out of ``experiment=glob(*)``.
    Hydra's fnmatch rules apply (``*`` also matches ``/``); ``exclude=`` is honoured."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob

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
            CONFIG_DIR / group
        ).is_dir():
            out.append(arg)
            continue
        options = group_options_recursive(group)
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
    import importlib.util

    for arg in argv:
        key, _, value = arg.partition("=")
        if key.lstrip("+") == "hydra/launcher" and value in _LAUNCHER_PLUGINS:
            module, extra = _LAUNCHER_PLUGINS[value]
            if importlib.util.find_spec(module) is None:
                raise UserError(f"hydra/launcher={value} needs {module.split('.')[1]}: "
                                f"pip install -e '.[{extra}]'")


def _sweep_variants(overrides: list[str]) -> list[list[str]]:
    """Override lists to compose: each sweep value once, the other sweeps at their first value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob

    parsed = OverridesParser.create().parse_overrides(overrides)
    base, sweeps = [], []
    for raw, o in zip(overrides, parsed):
        if o.is_sweep_override():
            if isinstance(o.value(), Glob):  # glob(...) over a config group's choices
                values = o.value().filter(group_options(o.get_key_element().lstrip("+~")))
            else:
                values = list(o.sweep_string_iterator())
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
    from hydra._internal.utils import get_args_parser

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
    return path if path.is_absolute() else (Path(__file__).resolve().parent / path).resolve()


def preflight(argv: Sequence[str]) -> None:
    """Compose and validate the config(s) that ``argv`` asks for; raise UserError if bad."""
    global _last_cfg
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from gradrepro.config import register_configs, validate

    args = parse_argv(argv)
    if args is None:
        raise UserError(f"could not read the command line {' '.join(argv)!r}; see --help")
    overrides = _searchpath_override(list(args.overrides), args.config_dir)
    config_name = args.config_name or "config"
    config_dir = _config_dir(args.config_path)
    if not config_dir.is_dir():
        raise UserError(f"--config-path {str(config_dir)!r} is not a folder")
    register_configs()
    GlobalHydra.instance().clear()
    _last_cfg = None
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            try:
                variants = _sweep_variants(overrides)
            except Exception as exc:  # noqa: BLE001 - Hydra raises many types
                raise UserError(f"could not parse the overrides: {explain(exc)}") from None
            if len(variants) > 1 and not args.multirun:
                raise UserError(
                    "a sweep (a,b or range(...)) needs -m (--multirun); without it Hydra runs "
                    "nothing")
            for variant in variants:
                try:
                    cfg = compose(config_name=config_name, overrides=variant)
                    _last_cfg = cfg
                    # Interpolation errors and required values left unset surface here.
                    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
                except UserError:
                    raise
                except Exception as exc:  # noqa: BLE001 - Hydra raises many types
                    raise UserError(explain(exc)) from None
                try:
                    validate(cfg)
                    check_buildable(cfg)
                except UserError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a value the checks could not even compare
                    raise UserError(explain(exc)) from None
                check_output_dir(config_name, variant, args.multirun)
    finally:
        GlobalHydra.instance().clear()


_built: set = set()


def check_buildable(cfg) -> None:
    """Build the objective, model and optimizer once on the CPU (no data, no training), so a
    value that only the model's own code rejects (a zero width, say) is one line here."""
    from omegaconf import OmegaConf

    from gradrepro.init import initialize
    from gradrepro.models import build_model
    from gradrepro.objectives import build_objective
    from gradrepro.optim import build_optimizer, freeze

    plain = OmegaConf.to_container(cfg, resolve=True)
    key = repr([plain[k] for k in ("model", "objective", "init", "optim", "train")])
    if key in _built:  # a sweep over seeds or data builds each distinct model once
        return
    try:
        net = build_objective(cfg.objective).wrap(build_model(cfg.model))
        initialize(net, cfg.init.scheme, cfg.init.std)
        freeze(net, list(cfg.train.freeze))
        build_optimizer(net, cfg.optim, cfg.train.steps)
        _built.add(key)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - any error here is a config the code rejects
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if isinstance(exc, KeyError) and exc.args:  # a lookup table without that entry
            keys = _keys_holding(cfg, exc.args[0])
            first = (f"{keys[0]}={exc.args[0]!r} is not a value the code knows" if keys
                     else f"unknown value {exc.args[0]!r}")
        raise UserError(f"the model, objective or optimizer cannot be built from this config: "
                        f"{first}") from None


def _keys_holding(cfg, value) -> list[str]:
    """The config keys whose value is ``value`` (to name the key behind a failed lookup)."""
    from omegaconf import OmegaConf

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


def check_output_dir(config_name: str, overrides: list[str], multirun: bool) -> None:
    """The run (or sweep) folder must be creatable and writable before any training starts.

    Checks ``hydra.run.dir`` (``hydra.sweep.dir`` with -m). Where that path names values
    Hydra fills only at run time (``hydra.job.*``), the runner checks the folder instead.
    """
    from hydra import compose
    from omegaconf import OmegaConf

    from gradrepro.store import check_writable_path

    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    try:
        hydra_cfg = compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
        path = OmegaConf.select(hydra_cfg, key)
    except Exception:  # noqa: BLE001 - runtime-only interpolations: left to the runner
        return
    if path:
        check_writable_path(Path(str(path)), key)


def main(hydra_main, argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        expanded = expand_globs(argv)
        check_launcher(expanded)
    except UserError as exc:
        print(f"gradrepro: error: {exc}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    if expanded != argv:  # hydra.main reads sys.argv
        argv = sys.argv[1:] = expanded
    args = parse_argv(argv)
    hydra_only = args is None or any(getattr(args, flag, None) for flag in _HYDRA_ONLY)
    if not hydra_only and not os.environ.get("HYDRA_FULL_ERROR"):
        try:
            preflight(argv)
        except UserError as exc:
            print(f"gradrepro: error: {exc}", file=sys.stderr)
            sys.exit(EXIT_USER_ERROR)
    hydra_main()

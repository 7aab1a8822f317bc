"""Config errors as one line and exit code 2, before Hydra prints its multi-line report.

``python -m gradrepro ...`` first composes the config with Hydra's compose API (every
combination a sweep names, one value at a time) and validates it; only a config that
composes and validates is handed to ``hydra.main``. ``HYDRA_FULL_ERROR=1`` skips this
translation and shows Hydra's own report, as Hydra users expect.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from gradrepro.errors import EXIT_USER_ERROR, UserError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
# Hydra's own flags: these must reach Hydra untouched (help, --cfg, completion, ...).
_HYDRA_FLAGS = ("--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--info", "-i",
                "--shell-completion", "-sc", "--resolve", "--package", "-p")


def group_options(group: str) -> List[str]:
    from hydra.core.global_hydra import GlobalHydra

    loader = GlobalHydra.instance().config_loader()
    return sorted(o for o in loader.get_group_options(group) if not o.endswith("_schema"))


def _did_you_mean(word: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


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
            options = group_options(group)
            return (f"unknown {group} {choice!r}{_did_you_mean(choice, options)}; "
                    f"valid choices: {', '.join(options)}")
        return f"config {path!r} not found"
    for err in (exc, cause):
        if isinstance(err, ConfigKeyError) or "not in struct" in str(err) or "Key '" in str(err):
            full_key = getattr(err, "full_key", None) or ""
            key = re.search(r"Key '([^']+)'", str(err))
            name = full_key or (key.group(1) if key else "?")
            where = re.match(r"In '([^']+)'", text)
            parent = name.rpartition(".")[0]
            valid = _keys_at(parent)
            hint = _did_you_mean(name.rpartition(".")[2], valid) if valid else ""
            location = f" in {where.group(1)}" if where else ""
            listing = f"; valid keys{' under ' + parent if parent else ''}: {', '.join(valid)}" if valid else ""
            return f"unknown config key {name!r}{location}{hint}{listing}"
    for err in (exc, cause):
        if isinstance(err, ValidationError):
            full_key = getattr(err, "full_key", "") or "?"
            first = str(err).splitlines()[0]
            return f"{full_key}: {first}"
    first = next((line for line in text.splitlines() if line.strip()), text)
    return first.strip()


_last_cfg = None


def _keys_at(parent: str) -> List[str]:
    """Keys that exist at ``parent`` in the last composed (or base) config."""
    from omegaconf import OmegaConf

    from gradrepro.config import Config

    cfg = _last_cfg if _last_cfg is not None else OmegaConf.structured(Config)
    node = OmegaConf.select(cfg, parent) if parent else cfg
    try:
        return sorted(str(k) for k in node.keys())
    except AttributeError:
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


def _sweep_variants(overrides: List[str]) -> List[List[str]]:
    """Override lists to compose: each sweep value once, the other sweeps at their first value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    base, sweeps = [], []
    for raw, o in zip(overrides, parsed):
        if o.is_sweep_override():
            try:
                values = list(o.sweep_string_iterator())
            except Exception:  # glob(...) needs the group listing Hydra does later: skip
                continue
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


def _compose_without_failing_key(exc: BaseException, overrides: List[str]):
    """The config without the override that named an unknown key, to list the valid keys."""
    from hydra import compose

    cause = exc.__cause__ or exc.__context__
    full_key = getattr(exc, "full_key", None) or getattr(cause, "full_key", None)
    if not full_key:
        return None
    kept = [o for o in overrides if o.lstrip("+~").split("=")[0] != full_key]
    try:
        return compose(config_name="config", overrides=[o for o in kept if not o.startswith("hydra")])
    except Exception:
        return None


def preflight(argv: Sequence[str]) -> None:
    """Compose and validate the config(s) that ``argv`` asks for; raise UserError if bad."""
    global _last_cfg
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from gradrepro.config import register_configs, validate

    overrides = [a for a in argv if not a.startswith("-")]
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            try:
                variants = _sweep_variants(overrides)
            except Exception as exc:
                raise UserError(f"could not parse the overrides: {explain(exc)}") from None
            for variant in variants:
                try:
                    cfg = compose(config_name="config", overrides=[v for v in variant if not v.startswith("hydra")])
                    _last_cfg = cfg
                    from omegaconf import OmegaConf

                    OmegaConf.to_container(cfg, resolve=True)  # interpolation errors surface here
                except UserError:
                    raise
                except Exception as exc:
                    _last_cfg = _compose_without_failing_key(exc, variant)
                    raise UserError(explain(exc)) from None
                validate(cfg)
    finally:
        GlobalHydra.instance().clear()


def main(hydra_main, argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    wants_hydra_only = any(a.split("=")[0] in _HYDRA_FLAGS for a in argv)
    try:
        expanded = expand_globs(argv)
        check_launcher(expanded)
    except UserError as exc:
        print(f"gradrepro: error: {exc}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    if expanded != argv:  # hydra.main reads sys.argv
        argv = sys.argv[1:] = expanded
    if not wants_hydra_only and not os.environ.get("HYDRA_FULL_ERROR"):
        try:
            preflight(argv)
        except UserError as exc:
            print(f"gradrepro: error: {exc}", file=sys.stderr)
            sys.exit(EXIT_USER_ERROR)
    hydra_main()

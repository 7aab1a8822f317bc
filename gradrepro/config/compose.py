"""Where the configs live (inside the package, so a wheel carries them) and the one way to
compose them with Hydra's compose API: in a running Hydra app, or standalone (the
preflight, reference runs, the report, tests and notebooks)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from gradrepro.config.schema import register_configs

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

Compose = Callable[..., DictConfig]


def group_options_recursive(group: str, config_dir: Path = CONFIG_DIR) -> List[str]:
    """Every config of ``group``, subfolders included (``missing_grad/x``), schemas left out."""
    folder = config_dir / group
    return sorted(str(p.relative_to(folder).with_suffix("")) for p in folder.rglob("*.yaml"))


@contextlib.contextmanager
def composer(config_dir: Optional[Path] = None) -> Iterator[Compose]:
    """Hydra's compose API on ``config_dir`` (default: gradrepro's configs) for the block;
    yields ``compose(overrides, config_name="config", return_hydra_config=False)``."""
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir or CONFIG_DIR), version_base="1.3"):
            yield _compose
    finally:
        GlobalHydra.instance().clear()


def _compose(overrides: Sequence[str] = (), config_name: str = "config",
             return_hydra_config: bool = False) -> DictConfig:
    return hydra_compose(config_name=config_name, overrides=list(overrides),
                         return_hydra_config=return_hydra_config)


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """The composed config for ``overrides``: inside a running Hydra app (a reference run),
    with the app's own search path; otherwise on gradrepro's configs."""
    register_configs()
    if GlobalHydra.instance().is_initialized():
        return _compose(overrides)
    with composer() as compose_fn:
        return compose_fn(overrides)

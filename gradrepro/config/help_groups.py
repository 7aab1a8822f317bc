"""The config groups ``--help`` lists: Hydra's own listing (``$APP_CONFIG_GROUPS``) also shows
the type schemas registered beside each choice (``mlp_schema``), which are internal and not
choices. ``${help_groups:}`` in ``hydra.help.template`` lists the groups of the running app's
search path (``--config-dir`` included) without them."""

from __future__ import annotations

from typing import Dict, List

from hydra.core.global_hydra import GlobalHydra
from hydra.core.object_type import ObjectType

from gradrepro.config.short_help import listing

SCHEMA_SUFFIX = "_schema"  # a choice's schema in the ConfigStore: internal, never a choice itself


def help_groups() -> str:
    """``group: a, b, c`` per line, as Hydra's compact listing, schemas left out."""
    if not GlobalHydra.instance().is_initialized():
        return ""
    loader = GlobalHydra.instance().config_loader()

    def groups(parent: str) -> List[str]:
        found = []
        for name in loader.list_groups(parent):
            group = f"{parent}/{name}" if parent else name
            if group == "hydra" or group.startswith("hydra/"):
                continue
            if loader.get_group_options(group, ObjectType.CONFIG):
                found.append(group)
            found += groups(group)
        return found

    found: Dict[str, List[str]] = {}
    for group in sorted(groups("")):
        top, _, sub = group.partition("/")  # a subfolder's configs are choices of its top group: by path
        options = [f"{sub}/{o}" if sub else o for o in sorted(loader.get_group_options(group, ObjectType.CONFIG))
                   if not o.endswith(SCHEMA_SUFFIX)]
        if options:
            found.setdefault(top, []).extend(options)
    return listing({group: sorted(options) for group, options in found.items()})

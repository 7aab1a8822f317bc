"""The config groups ``--help`` lists: Hydra's own listing (``$APP_CONFIG_GROUPS``) also shows
the type schemas registered beside each choice (``mlp_schema``), which are internal and not
choices. ``${help_groups:}`` in ``hydra.help.template`` lists the groups of the running app's
search path (``--config-dir`` included) without them."""

from __future__ import annotations

from typing import List

from hydra.core.global_hydra import GlobalHydra
from hydra.core.object_type import ObjectType

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

    lines = []
    for group in sorted(groups("")):
        options = [o for o in sorted(loader.get_group_options(group, ObjectType.CONFIG))
                   if not o.endswith(SCHEMA_SUFFIX)]
        if options:
            lines.append(f"{group}: {', '.join(options)}")
    return "\n".join(lines)

"""Model sizes: every width, depth, kernel and input size of the ``model`` and ``objective``
nodes (the objective's heads: SimSiam's ``dim``, ``pred_dim``) is a whole number >= 1. A
zero width builds without complaint in torch (``nn.Linear(4, 0)`` is a valid, empty layer)
and then trains a network whose signal is cut, under the experiment's name; a negative one
fails deep inside torch. ``num_classes`` alone may be 0 (a feature extractor)."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from gradrepro.errors import UserError

# Sizes where 0 means something (the model's own docs): no classifier head.
ZERO_MEANS_NONE = ("num_classes",)


def _check_size(key: str, value: Any, allow_zero: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise UserError(f"{key}={value} must be a whole number {'>= 0' if allow_zero else '>= 1'}: "
                        f"a {'negative' if value < 0 else 'zero'} size leaves the network without that layer's signal")


def check_sizes(cfg: Any) -> None:
    """Raise UserError for a model or head size below 1 (``num_classes`` below 0), naming the key."""
    for key in ("channels", "image_size"):  # the data's shape feeds the model's first layer: named first
        _check_size(f"data.{key}", OmegaConf.select(cfg, f"data.{key}"), False)
    for group in ("model", "objective"):
        node = cfg.get(group)
        if not isinstance(node, DictConfig):
            continue
        for key, value in OmegaConf.to_container(node, resolve=True).items():
            allow_zero = key in ZERO_MEANS_NONE
            for i, item in enumerate(value) if isinstance(value, list) else [(None, value)]:
                _check_size(f"{group}.{key}" + ("" if i is None else f"[{i}]"), item, allow_zero)


__all__ = ["check_sizes"]

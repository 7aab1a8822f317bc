"""Several optimizers over one model, seen by the recorder as one.

Loops that train one model with two optimizers are common: Muon for the hidden matrices and
AdamW for the rest (Jordan et al. 2024, "Muon: an optimizer for hidden layers"), SparseAdam
for sparse embeddings and Adam for the rest (the PyTorch documentation of ``SparseAdam``).
Each training step runs one backward and then each optimizer's ``step()`` in turn.
``gradrepro.record(model, [opt_a, opt_b], ...)`` wraps them in an ``OptimizerSet``:

- its ``param_groups`` are every member's groups in the members' order, its ``state`` every
  member's state, so the membership checks (a trainable tensor no group holds) read them all;
- one training step begins at the first member's step pre-hook (the gradients are complete)
  and ends after each member has stepped once (every update is taken). A member that steps
  again before the others have (one was skipped, as ``GradScaler.step`` skips an optimizer
  whose gradients are not finite) ends the step in progress first.
- ``member_groups`` pairs each group with the optimizer whose rule updates it (the live update
  rule check predicts each group by its own optimizer's rule).
"""

from __future__ import annotations

from collections import ChainMap
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from gradrepro.errors import UserError


class OptimizerSet:
    """``members`` as one optimizer for the recorder (module docstring)."""

    def __init__(self, members: Sequence[Any]) -> None:
        members = tuple(members)
        for i, member in enumerate(members):
            if not hasattr(member, "param_groups"):
                raise UserError(f"optimizer[{i}] must be a torch.optim.Optimizer, not {type(member).__name__}")
        if not members:
            raise UserError("optimizer is an empty list: give one optimizer, or a list of the optimizers that "
                            "update the model")
        owner: dict = {}
        for i, member in enumerate(members):
            for group in member.param_groups:
                for p in group["params"]:
                    j = owner.setdefault(id(p), i)
                    if j != i:
                        raise UserError(f"optimizer[{j}] and optimizer[{i}] both hold a tensor of shape "
                                        f"{tuple(p.shape)}: each step would update it twice; give each tensor "
                                        "to one optimizer")
        self.members = members
        self._pre: List[Callable] = []
        self._post: List[Callable] = []
        self._stepped: set = set()
        self._open = False
        self._handles: list = []

    @property
    def param_groups(self) -> list:
        return [g for m in self.members for g in m.param_groups]

    @property
    def state(self) -> ChainMap:
        return ChainMap(*(m.state for m in self.members))

    def register_step_pre_hook(self, hook: Callable) -> "_Handle":
        """``hook(optimizer, args, kwargs)`` at the first member's step of a training step, with
        that member and its arguments; what it returns replaces them, as for one optimizer."""
        return self._register(self._pre, hook)

    def register_step_post_hook(self, hook: Callable) -> "_Handle":
        """``hook(self, (), {})`` once each member has stepped."""
        return self._register(self._post, hook)

    def _register(self, hooks: list, hook: Callable) -> "_Handle":
        if not self._handles:
            for k, member in enumerate(self.members):
                self._handles += [member.register_step_pre_hook(self._member_pre(k)),
                                  member.register_step_post_hook(self._member_post(k))]
        hooks.append(hook)
        return _Handle(self, hooks, hook)

    def _unregister(self, hooks: list, hook: Callable) -> None:
        if hook in hooks:
            hooks.remove(hook)
        if not (self._pre or self._post):
            for handle in self._handles:
                handle.remove()
            self._handles = []

    def _member_pre(self, k: int) -> Callable:
        def hook(optimizer: Any, args: tuple, kwargs: dict) -> Optional[tuple]:
            if k in self._stepped:  # a member steps twice: the step in progress ended short
                self._end()
            if self._open:
                return None
            self._open = True
            result = None
            for pre in list(self._pre):
                out = pre(optimizer, args, kwargs)
                if out is not None:
                    args, kwargs = out
                    result = out
            return result
        return hook

    def _member_post(self, k: int) -> Callable:
        def hook(optimizer: Any, args: tuple, kwargs: dict) -> None:
            self._stepped.add(k)
            if len(self._stepped) == len(self.members):
                self._end()
        return hook

    def _end(self) -> None:
        self._stepped.clear()
        self._open = False
        for post in list(self._post):
            post(self, (), {})

    def __repr__(self) -> str:
        return f"OptimizerSet({', '.join(type(m).__name__ for m in self.members)})"


class _Handle:
    def __init__(self, owner: OptimizerSet, hooks: list, hook: Callable) -> None:
        self.owner, self.hooks, self.hook = owner, hooks, hook

    def remove(self) -> None:
        self.owner._unregister(self.hooks, self.hook)


def as_optimizer(optimizer: Any) -> Any:
    """One optimizer as it is; a list or tuple of them as an ``OptimizerSet`` (one alone: itself)."""
    if isinstance(optimizer, (list, tuple)):
        return optimizer[0] if len(optimizer) == 1 and hasattr(optimizer[0], "param_groups") \
            else OptimizerSet(optimizer)
    return optimizer


def member_groups(optimizer: Any) -> Iterator[Tuple[torch.optim.Optimizer, dict]]:
    """Each param group with the optimizer whose rule updates it."""
    for member in getattr(optimizer, "members", (optimizer,)):
        for group in member.param_groups:
            yield member, group

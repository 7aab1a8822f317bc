"""The checks ``gradrepro.record`` makes on every logged step (``watch.watcher``), each a pure
function of the model, the optimizer and the probe's columns of that step. Each returns
``(kind, name, detail, evidence)`` tuples; ``watcher.Watch`` turns them into findings.

The kinds and what each rests on:

- ``not_in_optimizer``, ``stale_optimizer_param``: the optimizer's tensors against the model's,
  by identity (a module replaced after the optimizer was built leaves both).
- ``lr_zero``, ``not_updated``: a finite gradient and an update of exactly zero; its group's
  learning rate says which.
- ``no_gradient``: a trainable tensor whose ``.grad`` is None at the step (the whole model:
  the loss does not reach it).
- ``nonfinite_gradient``: NaN or Inf in a gradient the optimizer is about to use.
- ``eval_mode``: dropout or normalisation modules in eval mode during a gradient step.
- ``frozen_norm_drift``: a BatchNorm whose weight and bias are frozen while, in train mode,
  its running statistics move with every forward pass.
- ``optimizer_attribute``: a hyper-parameter assigned on the optimizer object, where its step
  never reads it (it reads the param groups).
"""

from __future__ import annotations

import inspect
import math
import re
from typing import Any, Iterable, Optional

import numpy as np
import torch
from torch import nn

from gradrepro.diagnose.registration import scan_attributes

Hit = tuple[str, str, str, dict]  # kind, name, detail, evidence

# Modules whose forward differs between train and eval mode (torch.nn.Module.train's docs:
# "This has an effect only on certain modules ... e.g. Dropout, BatchNorm").
_DROPOUT = nn.modules.dropout._DropoutNd
_NORM = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


def mode_sensitive(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules whose behaviour a wrong mode changes: dropout with p > 0, and normalisation
    layers that keep running statistics."""
    found = []
    for name, m in model.named_modules():
        if isinstance(m, _DROPOUT) and float(getattr(m, "p", 0.0)) > 0:
            found.append((name or "<root>", m))
        elif isinstance(m, _NORM) and getattr(m, "track_running_stats", False):
            found.append((name or "<root>", m))
    return found


def frozen_norm(m: nn.Module) -> bool:
    """A normalisation layer with parameters, none of which trains: deliberately frozen."""
    params = list(m.parameters(recurse=False))
    return bool(params) and not any(p.requires_grad for p in params)


def in_frozen_part(modules: dict, name: str) -> bool:
    """Whether the module ``name`` sits in a frozen part of the model: its nearest enclosing
    module with parameters (the model itself excluded) has none that trains (a distillation
    teacher, a frozen backbone kept in eval mode on purpose)."""
    parts = name.split(".")
    for k in range(len(parts) - 1, 0, -1):
        params = list(modules[".".join(parts[:k])].parameters())
        if params:
            return not any(p.requires_grad for p in params)
    return False


def mode_hits(model: nn.Module, sensitive: list[tuple[str, nn.Module]]) -> list[Hit]:
    """Modules in eval mode during a gradient step. A frozen normalisation layer in eval mode
    is the documented way to freeze it, so it is not one; nor is a module in a frozen part of
    the model (``in_frozen_part``)."""
    if not sensitive:
        return []
    if not model.training:
        kinds = sorted({type(m).__name__ for _, m in sensitive})
        return [("eval_mode", "<model>", f"the whole model is in eval mode during a training step: its "
                 f"{len(sensitive)} {', '.join(kinds)} module(s) run their evaluation behaviour (dropout off, "
                 "normalisation by running statistics)", {"modules_in_eval": len(sensitive)})]
    off = [(n, m) for n, m in sensitive if not m.training and not (isinstance(m, _NORM) and frozen_norm(m))]
    if off:
        modules = dict(model.named_modules())
        off = [(n, m) for n, m in off if not in_frozen_part(modules, n)]
    if not off:
        return []
    names = ", ".join(n for n, _ in off[:5]) + (" ..." if len(off) > 5 else "")
    return [("eval_mode", off[0][0], f"{len(off)} module(s) in eval mode while the model trains ({names}): "
             "dropout is off and normalisation uses running statistics on these", {"modules_in_eval": len(off)})]


def drifting_norms(sensitive: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Frozen normalisation layers in train mode: the ones whose statistics a step may move."""
    return [(n, m) for n, m in sensitive
            if isinstance(m, _NORM) and m.training and frozen_norm(m) and m.running_mean is not None]


def drift_hits(watched: list[tuple[str, nn.Module]], before: list[torch.Tensor]) -> list[Hit]:
    """The watched layers whose running mean moved since the step began (one host transfer)."""
    if not watched:
        return []
    with torch.no_grad():
        moved = torch.stack([torch.linalg.vector_norm((m.running_mean - b).float())
                             for (_, m), b in zip(watched, before)])
        scale = torch.stack([torch.linalg.vector_norm(b.float()) for b in before])
        moved, scale = moved.cpu().numpy(), scale.cpu().numpy()
    hits = []
    for (name, _), d, s in zip(watched, moved, scale):
        if d > 0:
            hits.append(("frozen_norm_drift", name, (
                f"weight and bias are frozen (requires_grad=False) but the layer is in train mode: its "
                f"running_mean moved by {d:.3g} (norm {s:.3g} before) during this step"),
                {"running_mean_change": float(d), "running_mean_norm": float(s)}))
    return hits


def registration_hits(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> tuple[list[Hit], set]:
    """Trainable tensors the model holds in plain attributes or containers without registering
    them (layers in a Python list, a requires-grad tensor not wrapped in ``nn.Parameter``;
    ``diagnose.registration.scan_attributes``): ``not_in_optimizer`` where no param group holds
    them (an optimizer built from ``model.parameters()`` never got them: they never train),
    ``unregistered`` where one does (they train, but ``named_parameters()``, ``state_dict()``
    and ``.to()`` miss them). With the ids of those tensors."""
    known = {id(p) for p in model.parameters()}
    held = {id(p) for g in optimizer.param_groups for p in g["params"]} if optimizer is not None else set()
    hits, ids = [], set()
    for path, thing in scan_attributes(model, known)[0]:
        module = isinstance(thing, nn.Module)
        tensors = [p for p in thing.parameters() if id(p) not in known] if module else [thing]
        tensors = [t for t in tensors if t.requires_grad]
        if not tensors:
            continue
        ids.update(id(t) for t in tensors)
        what = (f"a {type(thing).__name__} with {len(tensors)} trainable tensor(s)" if module
                else f"a requires-grad tensor {tuple(thing.shape)}")
        where = f"{what} held in a plain attribute or container, not registered (nn.ModuleList, nn.Parameter)"
        numbers = {"tensors": len(tensors), "numel": sum(t.numel() for t in tensors)}
        if optimizer is not None and not any(id(t) in held for t in tensors):
            hits.append(("not_in_optimizer", path, f"{where}: model.parameters() misses it, so the optimizer "
                         "built from it does not hold it and it never trains; hold layers in nn.ModuleList or "
                         "nn.ModuleDict and trainable tensors in nn.Parameter", numbers))
        else:
            hits.append(("unregistered", path, f"{where}: it trains, but named_parameters(), state_dict() and "
                         ".to() miss it, and it is not recorded", numbers))
    return hits, ids


def structure_hits(model: nn.Module) -> list[Hit]:
    """Two ways a model's structure says other than its author meant, read from the modules:

    - ``repeated_module``: one module object at several places of one ``nn.ModuleList`` or
      ``nn.Sequential`` (``nn.ModuleList([Block()] * n)``): the places share one set of weights,
      where a list of n layers says n were built. Weights shared on purpose are one module
      applied in a loop, or one module held by several attributes (tied embeddings, timm's CoaT
      sharing one MLP between branches), neither of which this finds.
    - ``freeze_noop``: a module whose instance attribute ``requires_grad`` is False while its own
      parameters train: ``module.requires_grad = False`` sets an attribute and freezes nothing
      (``module.requires_grad_(False)`` freezes).
    - ``dropout_all``: a dropout module in train mode with p >= 1: it zeroes every entry.
    - ``norm_momentum``: a normalisation layer whose running-statistics momentum is above 1/2,
      where each batch weighs more than all the earlier ones together: the statistics follow the
      last batch (TensorFlow's convention, 0.99 for keeping 99% of the old value, given to
      PyTorch, where the default 0.1 keeps 90%)."""
    hits: list[Hit] = []
    for name, module in model.named_modules():
        places: dict[int, list[str]] = {}
        sequence = isinstance(module, (nn.ModuleList, nn.Sequential))  # attributes may share on purpose (CoaT)
        for key, child in (module._modules.items() if sequence else ()):
            if child is not None and any(True for _ in child.parameters()):
                places.setdefault(id(child), []).append(key)
        for keys in places.values():
            if len(keys) > 1:
                where = [f"{name}.{k}" if name else k for k in keys]
                child = module._modules[keys[0]]
                hits.append(("repeated_module", where[0], (
                    f"one {type(child).__name__} object sits at {len(keys)} places of {name or 'the model'} "
                    f"({', '.join(where[:6])}{' ...' if len(where) > 6 else ''}): they share one set of weights "
                    f"({sum(p.numel() for p in child.parameters())} entries), not {len(keys)}; "
                    "[module] * n repeats a reference, build each with its own call"), {"places": len(keys)}))
        if isinstance(module, _DROPOUT) and module.training and float(getattr(module, "p", 0.0)) >= 1.0:
            hits.append(("dropout_all", name or "<model>", (
                f"{name or 'the model'} is a {type(module).__name__} with p = {float(module.p):g}: in training it "
                "zeroes every entry, so nothing before it gets a gradient through it (a flag passed where the rate "
                "goes: Dropout(True) is p = 1)"), {"p": float(module.p)}))
        momentum = getattr(module, "momentum", None) if isinstance(module, _NORM) else None
        if isinstance(momentum, float) and momentum > 0.5 and getattr(module, "track_running_stats", False):
            hits.append(("norm_momentum", name or "<model>", (
                f"{name or 'the model'} is a {type(module).__name__} with momentum {momentum:g}: PyTorch's running "
                f"statistics keep {1 - momentum:g} of the old value and take {momentum:g} of each batch, so they "
                "follow the last batch, and evaluation normalises with one batch's statistics (TensorFlow's "
                f"momentum convention? there {momentum:g} means keeping {momentum:g} of the old value)"),
                {"momentum": momentum}))
        if vars(module).get("requires_grad") is False and any(p.requires_grad for p in module.parameters()):
            hits.append(("freeze_noop", name or "<model>", (
                f"{name or 'the model'}.requires_grad is False, an attribute of the module, while its parameters "
                "still require grad and train: module.requires_grad = False freezes nothing; call "
                "module.requires_grad_(False)"), {"trainable": sum(p.requires_grad for p in module.parameters())}))
    return hits


def membership_hits(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], unregistered: set = frozenset()
                    ) -> list[Hit]:
    """Trainable tensors no param group holds, and tensors the optimizer holds that the model
    no longer owns, compared by identity (``unregistered``: ids of tensors the model holds
    without registering them, reported by ``registration_hits``, not as stale)."""
    if optimizer is None:
        return []
    names = {id(p): n for n, p in model.named_parameters()}
    held = [(g, p) for g, group in enumerate(optimizer.param_groups) for p in group["params"]]
    held_ids = {id(p) for _, p in held}
    hits = []
    outside = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held_ids]
    for n in outside:
        hits.append(("not_in_optimizer", n, "trainable and registered, but no param group holds it (compared by "
                     "identity): it gets a gradient and never moves", {"param_groups": len(optimizer.param_groups)}))
    stale = [(g, p) for g, p in held if id(p) not in names and id(p) not in unregistered and p.requires_grad]
    if stale:
        shapes = ", ".join(str(tuple(p.shape)) for _, p in stale[:4]) + (" ..." if len(stale) > 4 else "")
        hits.append(("stale_optimizer_param", f"<optimizer group {stale[0][0]}>", (
            f"the optimizer holds {len(stale)} tensor(s) the model no longer owns ({shapes})"
            + (f"; the model's {', '.join(outside[:4])} is in no param group: replaced after the optimizer was "
               "built?" if outside else "")), {"stale_tensors": len(stale), "model_tensors_outside": len(outside)}))
    return hits


def _class_reads(cls: type, name: str) -> bool:
    """Whether an optimizer class's own code (its MRO outside torch.optim) reads ``self.<name>``;
    a class whose code cannot be read counts as reading it (nothing is said of it)."""
    pattern = re.compile(rf"\bself\.{re.escape(name)}\b")
    for klass in cls.__mro__:
        if klass is object or klass.__module__.startswith("torch.optim"):
            continue
        try:
            if pattern.search(inspect.getsource(klass)):
                return True
        except (OSError, TypeError):
            return True
    return False


def setting_hits(optimizer: Any) -> list[Hit]:
    """Hyper-parameters assigned on an optimizer object (``optimizer.lr = 0.01``): an instance
    attribute named like one of its defaults, which the step never reads (torch's optimizers
    read each param group's value; a subclass that reads ``self.<name>`` is left alone), so the
    param groups keep the value they had. Checked on every logged step: a hand-written schedule
    assigns it as training goes."""
    hits: list[Hit] = []
    for opt in getattr(optimizer, "members", (optimizer,)):
        if not isinstance(opt, torch.optim.Optimizer):
            continue
        for name in sorted(set(vars(opt)) & set(getattr(opt, "defaults", {}))):
            if _class_reads(type(opt), name):
                continue
            used = sorted({repr(g.get(name)) for g in opt.param_groups})
            hits.append(("optimizer_attribute", f"<optimizer>.{name}", (
                f"{type(opt).__name__}.{name} = {vars(opt)[name]!r} is an attribute of the optimizer object, which its "
                f"step never reads: the param groups' {name} is still {', '.join(used[:4])}"),
                {"assigned": repr(vars(opt)[name]), "param_groups": used[:4]}))
    return hits


def scaled_step_hits(scaler: Any, optimizer: Any) -> list[Hit]:
    """``optimizer.step()`` on gradients the ``GradScaler`` scaled and did not unscale: the loss
    was scaled (``scaler.scale(loss).backward()``) but the step was taken directly, not through
    ``scaler.step`` (which unscales first, then steps, or skips a step with non-finite
    gradients), so every gradient the optimizer uses is the scale times too large. Read from
    the scaler's record of the optimizer at the step's start (READY: nothing unscaled it)."""
    if scaler is None or optimizer is None or hasattr(optimizer, "members") or not scaler.is_enabled():
        return []
    states = getattr(scaler, "_per_optimizer_states", None)
    scale = float(scaler.get_scale())
    if states is None or scale == 1.0:
        return []
    stage = states.get(id(optimizer), {}).get("stage")
    if getattr(stage, "value", stage) not in (None, 0):  # UNSCALED (1) or STEPPED (2): through the scaler
        return []
    return [("scaled_step", "<model>", (
        f"optimizer.step() ran on gradients still multiplied by the GradScaler's scale ({scale:g}): nothing "
        "unscaled them (scaler.step(optimizer) does, or scaler.unscale_(optimizer)), so each update is that "
        "many times too large, and steps with non-finite gradients are not skipped"), {"loss_scale": scale})]


def group_lrs(optimizer: Optional[torch.optim.Optimizer]) -> dict[int, float]:
    """id(tensor) -> its param group's learning rate."""
    if optimizer is None:
        return {}
    return {id(p): float(g.get("lr", math.nan)) for g in optimizer.param_groups for p in g["params"]}


def column_hits(step: int, names: list[str], params: list[torch.Tensor], columns: dict[str, np.ndarray],
                lrs: dict[int, float], end_norms: Optional[dict[int, float]]) -> list[Hit]:
    """From the probe's columns of one logged step: no gradient, a gradient edited away between
    backward and the step, non-finite gradients, and finite gradients that moved nothing.
    ``end_norms``: index -> the norm of .grad when backward ended (None: not seen)."""
    state, g_norm, u_to_p = columns["grad_state"], columns["grad_norm"], columns["update_to_param"]
    hits: list[Hit] = []
    trainable = [i for i, p in enumerate(params) if p.requires_grad]
    missing = [i for i in trainable if state[i] == "none"]
    removed = [i for i in missing if end_norms and end_norms.get(i, 0.0) > 0]
    zeroed = [i for i in trainable if state[i] == "zero" and end_norms and end_norms.get(i, 0.0) > 0]
    for i in removed + zeroed:
        what = "set to None" if state[i] == "none" else "zeroed"
        hits.append(("grad_modified", names[i], (
            f"backward left a gradient of norm {end_norms[i]:.4g}; at optimizer.step() it was {what} (something "
            "between backward and step wrote .grad: zero_grad() in the wrong place, a hook, a custom clip)"),
            {"grad_norm_after_backward": end_norms[i], "grad_norm_at_step": float(np.nan_to_num(g_norm[i]))}))
    missing = [i for i in missing if i not in removed]
    if missing and len(missing) == len(trainable):
        hits.append(("no_gradient", "<model>", f"none of the {len(trainable)} trainable tensors has a gradient at "
                     f"step {step}: the loss does not reach the model (detached, computed from .item() values or "
                     "under no_grad)", {"tensors_without_grad": len(missing)}))
    else:
        for i in missing:
            hits.append(("no_gradient", names[i], f"requires_grad=True but .grad is None at step {step}: no graph "
                         "path from the loss (cut by .detach()/.item()/a rebuild with torch.tensor, or unused in "
                         "forward)", {"grad_state": 0.0}))
    for i in trainable:
        if state[i] == "nonfinite":
            frac, numel = float(columns["frac_nonfinite"][i]), params[i].numel()
            count = int(round(frac * numel))  # the probe's column is a fraction of the entries
            hits.append(("nonfinite_gradient", names[i], f"{count} of its {numel} gradient entries ({frac:.1%}) are "
                         f"NaN or Inf at step {step}", {"frac_nonfinite": frac, "nonfinite_entries": count}))
        elif state[i] in ("finite", "tiny") and u_to_p[i] == 0 and id(params[i]) in lrs:
            lr = lrs[id(params[i])]
            step_norm, p_norm = lr * float(g_norm[i]), float(columns["param_norm"][i])
            if lr > 0 and _below_resolution(params[i], step_norm, p_norm):
                if _lost_to_dtype(params[i], step_norm, p_norm):
                    dtype = str(params[i].dtype).replace("torch.", "")
                    hits.append(("not_updated", names[i], (
                        f"a finite gradient, held by the optimizer with lr {lr:g}, and no change at step {step}: an "
                        f"SGD-sized step (lr x ||grad|| = {step_norm:.3g}) is under half a unit in the last place of "
                        f"the {dtype} weights (norm {p_norm:.3g}) and rounds away, where float32 would keep it: "
                        f"{dtype} weights without a float32 master copy"), {"lr": lr, "step_norm": step_norm}))
                continue
            ratio = float(columns["grad_to_param"][i])
            if lr == 0:
                hits.append(("lr_zero", names[i], f"a finite gradient (grad/param {ratio:.3g}) but no change: its "
                             f"param group's learning rate is 0 at step {step}", {"lr": lr, "grad_to_param": ratio}))
            else:
                hits.append(("not_updated", names[i], f"a finite gradient (grad/param {ratio:.3g}), held by the "
                             f"optimizer with lr {lr:g}, and no change at step {step}",
                             {"lr": lr, "grad_to_param": ratio}))
    return hits


def _below_resolution(p: torch.Tensor, step_norm: float, p_norm: float) -> bool:
    """An SGD-sized step (lr x ||grad||) under half an ulp of the tensor's norm rounds away: no
    change is then what the dtype allows (a bias in front of a BatchNorm has a ~0 gradient)."""
    return step_norm < 0.5 * torch.finfo(p.dtype).eps * p_norm if p.is_floating_point() else False


def _lost_to_dtype(p: torch.Tensor, step_norm: float, p_norm: float) -> bool:
    """A step that rounds away in ``p``'s 16-bit dtype but not in float32: lost to the dtype,
    not to a gradient that is ~0 by the model's algebra (which float32 loses too)."""
    return (p.is_floating_point() and torch.finfo(p.dtype).bits == 16
            and step_norm >= 0.5 * torch.finfo(torch.float32).eps * p_norm)


def stale_hits(names: list[str], carried: Iterable[tuple[int, float, float]]) -> list[Hit]:
    """``carried``: (index, norm of what .grad held when the step began, norm of the difference
    between that and .grad when the step's last backward began). A difference of exactly zero
    means nothing zeroed .grad in between: the previous step's gradient is summed into this one.
    Exactly, because the probe's copy of .grad is exact (same or wider dtype)."""
    stale = [(i, c) for i, c, d in carried if c > 0 and d == 0]
    if not stale:
        return []
    i, c = stale[0]
    return [("stale_gradient", "<model>", (
        f"{len(stale)} tensor(s) (first {names[i]}) entered backward still holding the previous step's gradient "
        f"(norm {c:.4g}), unchanged: nothing called zero_grad(), so the step uses the running sum of gradients"),
        {"tensors_carrying": len(stale), "carried_norm": c})]


def describe_evidence(evidence: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in evidence.items())

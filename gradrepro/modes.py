"""Module modes and what they change: BatchNorm's two functions (issue 6).

Training normalises with mini-batch statistics, inference with running (population)
statistics (Ioffe & Szegedy 2015, arXiv 1502.03167, Sec. 3.1): two functions, not one
function in different clothes. ``module.eval()`` switches the function; it does not switch
off autograd. Three mechanisms, each recording run constants (``summary.json``):

- ``hold_eval``: the mode policy ``train.eval_modules``: named modules stay in eval mode
  while the rest of the network trains (the usual repair for a frozen BN backbone).
- ``diagnostic_pass``: ``eval.diagnose``: after training, a diagnostic pass (loss, gradients,
  per-module statistics) over the held-out set in the chosen mode, measured against the
  eval-mode function the model deploys: output, loss and gradient differences, running
  statistics drift, and the small-batch cases.
- ``FrozenAudit``: for modules with frozen parameters (``train.freeze``), parameters,
  buffers and mode checked separately ("Check parameter, buffer, and mode policies
  separately if a supposedly frozen model changes behavior", shared/seeds/
  diagnose-missing-gradients.txt), and the change of their eval-mode output on a fixed input.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from gradrepro.data import Batch

COMPANION_EXAMPLES = 8  # examples whose outputs are compared across two companion batches


def _under(name: str, prefixes: Sequence[str]) -> bool:
    return any(name == pre or name.startswith(pre + ".") for pre in prefixes)


def hold_eval(net: nn.Module, prefixes: Sequence[str]) -> list[str]:
    """Put the modules under ``prefixes`` (and their children) in eval mode; return their names.

    ``net.train()`` undoes this (it sets every child), so call it again after anything that
    switches the whole network, as the runner does after each evaluation."""
    held = []
    for name, module in net.named_modules():
        if name and _under(name, prefixes):
            module.eval()
            held.append(name)
    return held


@contextlib.contextmanager
def modes_kept(net: nn.Module) -> Iterator[None]:
    """Restore every module's own training flag on exit (``net.train(flag)`` would not)."""
    flags = [(m, m.training) for m in net.modules()]
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag


def _buffers(net: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in net.named_buffers()}


def _restore_buffers(net: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, b in net.named_buffers():
            b.copy_(saved[name])


def _drift(net: nn.Module, saved: dict[str, torch.Tensor], suffix: str) -> float:
    """L2 norm of the change of every buffer named ``*suffix`` (all BN layers together)."""
    sq = 0.0
    for name, b in net.named_buffers():
        if name.endswith(suffix):
            sq += float((b.detach().double() - saved[name].double()).pow(2).sum())
    return math.sqrt(sq)


def _flat(output: Any) -> torch.Tensor:
    """A network's output (a tensor, or a tuple of them as SimSiam's (z, p)) as N x D."""
    if isinstance(output, (tuple, list)):
        return torch.cat([_flat(o) for o in output], dim=1)
    return output.detach().float().reshape(len(output), -1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||."""
    denom = float(b.double().norm())
    return float((a.double() - b.double()).norm()) / denom if denom > 0 else math.nan


def _pass(net: nn.Module, objective: Any, x: torch.Tensor, y: torch.Tensor,
          x2: torch.Tensor | None, batch_size: int) -> dict[str, Any] | None:
    """Loss, outputs and loss gradients over (x, y) in full batches of ``batch_size`` (a
    partial last batch would be another batch size: its examples are left out), in whatever
    mode ``net`` is in. Gradients come from ``torch.autograd.grad``: ``.grad`` is untouched.
    Returns None when the forward raises ValueError (BN in train mode with one example)."""
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    grads = [torch.zeros_like(p) for p in params]
    present = [False] * len(params)
    outputs: list[torch.Tensor] = []
    calls: list[torch.Tensor] = []  # an objective may call the network more than once
    handle = net.register_forward_hook(lambda m, i, o: calls.append(_flat(o)))
    n = len(x) - len(x) % batch_size if len(x) >= batch_size else len(x)
    loss_sum = 0.0
    try:
        for start in range(0, n, batch_size):
            sl = slice(start, start + batch_size)
            batch = Batch(x[sl], y[sl], None if x2 is None else x2[sl])
            with torch.enable_grad():
                try:
                    out = objective(net, batch)
                except ValueError:
                    return None
                outputs.append(calls[0])  # the first call sees batch.x
                calls.clear()
                share = len(batch.x) / n  # the loss is a batch mean: weight it to a set mean
                loss = out.loss.float() * share
                loss_sum += float(loss.detach())
                for i, g in enumerate(torch.autograd.grad(loss, params, allow_unused=True)):
                    if g is not None:
                        grads[i] += g
                        present[i] = True
    finally:
        handle.remove()
    return {
        "loss": loss_sum,
        "out": torch.cat(outputs),
        "names": [name for name, _ in named],
        "grads": grads,
        "present": present,
    }


def _set_mode(net: nn.Module, mode: str, held: Sequence[str]) -> None:
    net.train(mode == "train")
    hold_eval(net, held)


def diagnostic_pass(net: nn.Module, objective: Any, data: Any, cfg: Any,
                    held: Sequence[str] = ()) -> dict[str, float]:
    """The diagnostic pass of ``eval.diagnose`` beside the eval-mode reference; run constants.

    Every pass starts from the same buffers; the network's buffers, modes and ``.grad`` are
    as before when this returns (the drift is measured, then undone)."""
    _, _, x, y = data.eval_sets()
    x2 = data.augment(x, torch.Generator().manual_seed(0)) if data.views else None
    out: dict[str, float] = {}
    with modes_kept(net):
        saved = _buffers(net)
        _set_mode(net, "eval", held)
        ref = _pass(net, objective, x, y, x2, cfg.batch_size)
        _set_mode(net, cfg.mode, held)
        diag = _pass(net, objective, x, y, x2, cfg.batch_size)
        # What the pass did to the running statistics, before anything is restored.
        out["diag_running_mean_drift"] = _drift(net, saved, "running_mean")
        out["diag_running_var_drift"] = _drift(net, saved, "running_var")
        out["diag_buffers_identical"] = float(all(
            torch.equal(b, saved[name]) for name, b in net.named_buffers()))
        # The model as deployed after this pass: eval-mode metrics with the moved buffers.
        net.eval()
        with torch.no_grad():
            after = objective.evaluate(net, data)
        out.update({f"diag_after_{k}": float(v) for k, v in after.items()})
        _restore_buffers(net, saved)
        if diag is None:
            out["diag_raised"] = 1.0
        else:
            out.update(_compare(diag, ref))
        # Eval mode is a function of each example; train mode also of its companions.
        k = min(COMPANION_EXAMPLES, len(x) // 2)
        if k > 0 and len(x) >= 2 * k:
            rest = torch.arange(k, len(x))
            c = max(cfg.batch_size - k, k)  # companions: the rest of a diagnostic batch
            first = torch.cat([torch.arange(k), rest[:c]])
            second = torch.cat([torch.arange(k), rest.flip(0)[:c]])
            outs = []
            for idx in (first, second):
                _set_mode(net, cfg.mode, held)
                with torch.no_grad():
                    outs.append(_flat(net(x[idx]))[:k])
                _restore_buffers(net, saved)
            out["diag_companion_diff"] = _rel(outs[1], outs[0])
        for size in cfg.small_batches:
            _set_mode(net, cfg.mode, held)
            small = _pass(net, objective, x, y, x2, int(size))
            _restore_buffers(net, saved)
            out[f"diag_raised_bs{size}"] = float(small is None)
            if small is not None:
                # Both passes cover full batches from the first example on: compare the shared ones.
                m = min(len(small["out"]), len(ref["out"]))
                out[f"diag_out_rel_diff_bs{size}"] = _rel(small["out"][:m], ref["out"][:m])
                out[f"diag_loss_bs{size}"] = small["loss"]
    return out


def _flat_grads(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads])


def _compare(diag: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    g_norm = np.array([float(g.double().norm()) for g in diag["grads"]])
    r_norm = np.array([float(g.double().norm()) for g in ref["grads"]])
    with np.errstate(divide="ignore", invalid="ignore"):
        norm_rel = np.abs(g_norm - r_norm) / r_norm
    out = {
        "diag_raised": 0.0,
        "diag_loss": diag["loss"],
        "diag_loss_ref": ref["loss"],
        "diag_loss_rel_diff": abs(diag["loss"] - ref["loss"]) / abs(ref["loss"]),
        "diag_out_rel_diff": _rel(diag["out"], ref["out"]),
        "diag_grad_rel_diff": _rel(_flat_grads(diag["grads"]), _flat_grads(ref["grads"])),
        "diag_grad_norm_rel_diff_median": float(np.nanmedian(norm_rel)),
        "diag_grad_norm_rel_diff_max": float(np.nanmax(norm_rel)),
        # Fraction of trainable tensors that got a gradient: eval mode is not no_grad.
        "diag_grad_present": float(np.mean(diag["present"])),
        "diag_grad_present_ref": float(np.mean(ref["present"])),
    }
    for name, g, r in zip(diag["names"], g_norm, r_norm):
        out[f"diag_grad_norm/{name}"] = float(g)
        out[f"diag_grad_norm_ref/{name}"] = float(r)
    return out


class FrozenAudit:
    """Modules that own frozen parameters, checked three ways at the end of training:
    their parameters, their buffers and their mode, plus the change of their eval-mode
    output on the input they saw at the start (so a change of the layers before them does
    not count): with frozen parameters, only moved buffers can change that output."""

    def __init__(self, net: nn.Module, frozen: Sequence[str], x: torch.Tensor) -> None:
        owners = sorted({name.rpartition(".")[0] for name in frozen})
        self.modules = {name: net.get_submodule(name) for name in owners}
        self.params = {name: p.detach().clone() for name, p in net.named_parameters() if name in frozen}
        self.buffers = {f"{m}.{b}": t.detach().clone() for m, mod in self.modules.items()
                        for b, t in mod.named_buffers() if t.is_floating_point()}
        self.inputs: dict[str, torch.Tensor] = {}
        handles = [mod.register_forward_pre_hook(self._keep_input(name))
                   for name, mod in self.modules.items()]
        with modes_kept(net), torch.no_grad():
            net.eval()
            net(x)
        for h in handles:
            h.remove()
        self.outputs = self._outputs()

    def _keep_input(self, name: str):
        def hook(module, inputs):
            self.inputs[name] = inputs[0].detach().clone()
        return hook

    @torch.no_grad()
    def _outputs(self) -> dict[str, torch.Tensor]:
        outs = {}
        for name, mod in self.modules.items():
            if name in self.inputs:
                with modes_kept(mod):
                    mod.eval()
                    outs[name] = mod(self.inputs[name]).detach().clone()
        return outs

    def finish(self, net: nn.Module) -> dict[str, float]:
        params = dict(net.named_parameters())
        buffers = {f"{m}.{b}": t for m, mod in self.modules.items() for b, t in mod.named_buffers()}

        def change(now: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> float:
            """L2 norm of the change of all the named tensors together."""
            if not start:
                return math.nan
            return math.sqrt(sum(float((now[n].detach().double() - t.double()).pow(2).sum())
                                 for n, t in start.items()))

        now = self._outputs()
        return {
            "frozen_param_change": change(params, self.params),
            "frozen_buffer_change": change(buffers, self.buffers),
            # Fraction of these modules in train mode at the end of training.
            "frozen_train_mode": float(np.mean([m.training for m in self.modules.values()])),
            # Relative change of their eval-mode output on the input they saw at the start.
            "frozen_output_change": max((_rel(now[n], o) for n, o in self.outputs.items()),
                                        default=math.nan),
        }

"""The mode pass (``eval.mode_pass``): after training, a diagnostic pass (loss, gradients,
per-module statistics) over the held-out set in the chosen mode, measured against the
eval-mode function the model deploys.

Training normalises with mini-batch statistics, inference with running (population)
statistics (Ioffe & Szegedy 2015, arXiv 1502.03167, Sec. 3.1): two functions, not one
function in different clothes. The pass records, as run constants prefixed ``diag_``:
output, loss and gradient differences from the eval-mode function, the drift of the running
statistics, the dependence of an example's output on its companions in the batch, and the
small-batch cases (a batch of one raises ValueError in train mode, recorded as a result).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from gradrepro.data import Batch
from gradrepro.measure.base import Measurement, measurement
from gradrepro.recipe.mode_policy import hold_eval, modes_kept

COMPANION_EXAMPLES = 8  # examples whose outputs are compared across two companion batches


@measurement
class ModePass(Measurement):
    """``eval.mode_pass.mode``: after a completed run, the pass in that mode beside the eval-mode
    function (``mode_pass``)."""

    name = "mode_pass"
    switch = "eval.mode_pass.mode=eval|train"
    constants = ("diag_*",)

    @staticmethod
    def enabled(cfg: Any) -> bool:
        return cfg.eval.mode_pass.mode is not None

    def after_training(self, completed: bool) -> dict[str, float]:
        if not completed:
            return {}
        t = self.ctx.training
        return mode_pass(t.net, t.objective, t.data, self.ctx.cfg.eval.mode_pass, t.held)


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


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
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


def mode_pass(net: nn.Module, objective: Any, data: Any, cfg: Any,
                    held: Sequence[str] = ()) -> dict[str, float]:
    """The pass of ``eval.mode_pass`` beside the eval-mode function; run constants.

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
            after = objective.held_out_metrics(net, data)
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
            out["diag_companion_diff"] = relative_difference(outs[1], outs[0])
        for size in cfg.small_batches:
            _set_mode(net, cfg.mode, held)
            small = _pass(net, objective, x, y, x2, int(size))
            _restore_buffers(net, saved)
            out[f"diag_raised_bs{size}"] = float(small is None)
            if small is not None:
                # Both passes cover full batches from the first example on: compare the shared ones.
                m = min(len(small["out"]), len(ref["out"]))
                out[f"diag_out_rel_diff_bs{size}"] = relative_difference(small["out"][:m], ref["out"][:m])
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
        "diag_out_rel_diff": relative_difference(diag["out"], ref["out"]),
        "diag_grad_rel_diff": relative_difference(_flat_grads(diag["grads"]), _flat_grads(ref["grads"])),
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

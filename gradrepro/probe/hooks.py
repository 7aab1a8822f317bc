"""The hooks that gather a logged step's samples: a forward hook per module with parameters
(its output, one copy into the outputs' stash), a tensor hook on each output (its gradient,
one copy into the output gradients' stash) and, for a loop that may zero ``.grad`` between
forward and backward, a tensor hook per parameter that keeps what ``.grad`` carried in.
Armed on logged steps only; the configured extras (histograms, per-example variances, the
loss terms' contributions) are gathered beside the samples."""

from __future__ import annotations

from typing import Dict

import torch
from torch import nn

from gradrepro.probe.buffers import StepBuffers
from gradrepro.probe.extras import contribution_norms
from gradrepro.probe.kernels import log2_histogram, per_example_stats
from gradrepro.probe.tensors import ProbedTensors, summarised


class Hooks:
    """The hooks of one probe (``cfg``: its ProbeConfig), writing into ``buffers``."""

    def __init__(self, tensors: ProbedTensors, cfg, buffers: StepBuffers) -> None:
        self.tensors, self.cfg, self.buffers = tensors, cfg, buffers
        self.loss_scale = 1.0  # of the current step (the hooks unscale their std with it)
        self.handles: list = []
        self._hook_fns: Dict[str, object] = {}
        self.act_grad_hist: Dict[str, torch.Tensor] = {}
        self.contributions: Dict[str, tuple] = {}  # term -> (tensors it reaches, their norm rows)
        self._inputs: Dict[str, torch.Tensor] = {}
        self.per_example: Dict[str, torch.Tensor] = {}

    @property
    def armed(self) -> bool:
        return bool(self.handles)

    def arm(self, activations: bool, carry_at_backward: bool) -> None:
        """Forget the last step's gathered values; arm the forward hooks (``activations``) and
        the parameters' tensor hooks (``carry_at_backward``)."""
        self.clear()
        self.contributions.clear()
        if activations and self.cfg.activations:
            # The same hook functions on every logged step: torch.compile guards on a module's
            # hooks, so new ones would compile the model anew each logged step.
            if not self._hook_fns:
                self._hook_fns = {name: self._forward_hook(name) for name in self.tensors.hooked}
            for name, module in self.tensors.hooked.items():
                self.handles.append(module.register_forward_hook(self._hook_fns[name]))
        if carry_at_backward:
            self._carry_when_backward_arrives()

    def disarm(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def clear(self) -> None:
        """Drop what the hooks kept (the loss terms' rows stay until the columns are made)."""
        for kept in (self.act_grad_hist, self._inputs, self.per_example):
            kept.clear()

    def contribute(self, terms: Dict[str, torch.Tensor]) -> None:
        """Per loss term, the norms of the gradient it alone sends (after the main backward)."""
        for term_name, term in terms.items():
            self.contributions[term_name] = contribution_norms(self.tensors.params, term)

    def _carry_when_backward_arrives(self) -> None:
        """The carried part is what ``.grad`` holds when this step's first backward reaches each
        parameter (a tensor hook runs before the gradient is accumulated into ``.grad``), not
        what it held at the forward pass: a loop may call ``zero_grad()`` between the two."""
        reached: set = set()
        params, buffers = self.tensors.params, self.buffers

        def hook_for(i: int):
            def hook(grad: torch.Tensor) -> None:
                param = params[i]
                if i in reached or param.grad is None:
                    reached.add(i)
                    return
                reached.add(i)
                with torch.no_grad():
                    buffers.carry_one(i, summarised(param.grad))
            return hook

        for i, param in enumerate(params):
            if param.requires_grad:
                self.handles.append(param.register_hook(hook_for(i)))

    def _examples(self, t: torch.Tensor) -> int:
        """How many of ``t``'s first examples the sample takes: ``act_sample``, or fewer where
        ``act_values`` caps the values (at least one example)."""
        n, cap = self.cfg.act_sample, self.cfg.act_values
        if cap and t.dim() > 1 and t.shape[0]:
            n = max(1, min(n, cap // max(1, t.numel() // t.shape[0])))
        return n

    def _forward_hook(self, name: str):
        acts = self.buffers.acts

        def hook(module, inputs, output):
            # Inside a compiled graph torch.compile would trace the hook's bookkeeping (and break
            # the graph at the tensor hook below): a compiled module's activations are left out.
            if _compiling():
                return
            out = output[0] if isinstance(output, (tuple, list)) else output
            # A module called twice in one step (SimSiam's two views) is recorded once: the first call.
            if (name in acts or not torch.is_tensor(out) or not out.is_floating_point()
                    or out.dim() == 0):
                return
            with torch.no_grad():
                acts.put(name, out, take=self._examples(out))
            if (self.cfg.per_example and isinstance(module, nn.Linear)
                    and inputs and torch.is_tensor(inputs[0]) and inputs[0].dim() == 2):
                self._inputs[name] = inputs[0].detach()[:self.cfg.act_sample].float()
            if out.requires_grad:
                out.register_hook(self._grad_hook(name))

        return hook

    def _grad_hook(self, name: str):
        n, buffers = self.cfg.act_sample, self.buffers

        def hook(grad: torch.Tensor) -> None:
            if name in buffers.act_grads:  # only the main backward, not task-contribution passes
                return
            if not buffers.acts.closed:  # backward has begun: the outputs' samples are complete
                with torch.no_grad():
                    buffers.close_acts()
            # std is reported without the loss scale; the zero/flush counts are of the
            # values backward actually carried (scaled), which is what fp16 has to hold.
            with torch.no_grad():
                buffers.act_grads.put(name, grad, self.loss_scale, take=self._examples(grad))
                if not (self.cfg.act_grad_hist or name in self._inputs):
                    return
                g = grad[:n] if grad.shape[0] > n else grad
                if self.cfg.act_grad_hist:
                    self.act_grad_hist[name] = log2_histogram(g)
                if name in self._inputs:
                    self.per_example[name] = per_example_stats(
                        g.float() * (grad.shape[0] / self.loss_scale), self._inputs.pop(name))

        return hook


def _compiling() -> bool:
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)  # torch >= 2.3
    return bool(is_compiling()) if is_compiling is not None else False

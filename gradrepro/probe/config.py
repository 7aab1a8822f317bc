"""What the probe measures and how often (the ``probe`` config group's schema; the recorder
builds one from its arguments). A plain dataclass: the probe needs no config library."""

from __future__ import annotations

from dataclasses import dataclass

# probe.before_on: where the pre-step copy of the parameters lives (ProbeConfig.before_on).
BEFORE_ON = ("device", "host")


@dataclass
class ProbeConfig:
    every: int = 10  # log every N steps (and the last step)
    activations: bool = True  # forward/backward hook statistics per module
    # Examples of each batch whose activations and activation gradients the hooks summarise.
    # Their passes are the probe's largest cost (benchmarks/README.md); 8 examples still give
    # >= 80 values a module (a 10-way output) and 131 K at resnet18's first conv.
    # Experiments whose verdict reads these columns set their own (precision 128, glorot 64).
    act_sample: int = 8
    # At most this many values of each hooked output (and of its gradient) are summarised: of
    # the act_sample examples, as many whole examples as fit, never fewer than one; 0: no cap.
    # The experiments keep 0 (their records unchanged); gradrepro.record caps (RecordOptions).
    act_values: int = 0
    # "tiny": grad/param ratio at least this many times below the model's median ratio.
    tiny_factor: float = 1e4
    # Per loss term, the gradient norm each term alone sends to each parameter.
    task_contribution: bool = True
    # Per module, counts of log2|activation gradient| from 2^-40 to 2^0 plus an exact-zero
    # bin (gradrepro.probe.kernels.HIST_COLUMNS), as columns of modules.parquet. Off by default (43 columns).
    act_grad_hist: bool = False
    # On logged steps, a shadow fp32 backward of the same loss on the same weights and batch
    # (gradrepro/measure/shadow_fp32.py): per module, which activation gradients that are
    # non-zero in fp32 this run carried as exact zeros (act_grad_lost and its companions).
    # It measures flush under real autocast too, where a flushed value is already zero.
    act_grad_reference: bool = False
    # For the first N steps the probe logs every step and rebuilds the running sum of the
    # fresh gradients, to check what the optimizer stepped with (a forgotten zero_grad).
    running_sum_steps: int = 0
    # Per-example statistics of linear layers (Glorot & Bengio's histograms are per example):
    # pe_act_grad_var, the variance of dloss_i/d(output), and pe_grad_var, of dloss_i/dW.
    per_example: bool = False
    # Where the copy of the parameters taken before the optimizer's step (for the update)
    # lives: "device" beside the parameters; "host" in host memory (pinned on CUDA), brought
    # back a fixed-size window at a time after the step, so the device holds two windows
    # (2 x 8 MiB) instead of a copy of the model. On the CPU host memory is the device's: no
    # saving there. Not with running_sum_steps (that check needs the whole update per tensor
    # on the device): the copy then stays beside the parameters.
    before_on: str = "device"

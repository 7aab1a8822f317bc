"""The benchmark's models and tools (bare loop, gradrepro's probe, Cockpit, detect_anomaly),
each one training step on its own copy of a model; shared by ``overhead.py``,
``op_count.py`` and ``probe_segments.py``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gradrepro.probe import Probe  # noqa: E402
from gradrepro.probe.config import ProbeConfig  # noqa: E402

# ----------------------------------------------------------------------------------------
# Models


def cifar10_3c3d(num_classes: int = 10) -> nn.Module:
    """DeepOBS/Cockpit's cifar10_3c3d: 3 conv + 3 dense, 3x32x32 input (Schneider et al.
    2019, DeepOBS App. A). TF "same" max-pooling is a one-sided zero pad (inputs are
    post-ReLU, so zero padding equals -inf padding)."""

    def pool() -> List[nn.Module]:
        return [nn.ZeroPad2d((0, 1, 0, 1)), nn.MaxPool2d(3, stride=2)]

    return nn.Sequential(
        nn.Conv2d(3, 64, 5), nn.ReLU(), *pool(),  # Nx64x28x28 -> 14x14
        nn.Conv2d(64, 96, 3), nn.ReLU(), *pool(),  # Nx96x12x12 -> 6x6
        nn.Conv2d(96, 128, 3, padding=1), nn.ReLU(), *pool(),  # Nx128x6x6 -> 3x3
        nn.Flatten(),
        nn.Linear(3 * 3 * 128, 512), nn.ReLU(),
        nn.Linear(512, 256), nn.ReLU(),
        nn.Linear(256, num_classes),
    )


def resnet18_32(num_classes: int = 10) -> nn.Module:
    """torchvision's resnet18 with gradrepro's CIFAR stem (3x3 conv, no max-pool)."""
    from gradrepro.models.resnet import ResNet18Cifar, ResNet18CifarConfig

    return ResNet18Cifar(ResNet18CifarConfig(in_channels=3, num_classes=num_classes)).net


def plain30(num_classes: int = 10, width: int = 32) -> nn.Module:
    """A 30-layer plain net: 27 conv 3x3 + 3 fc, ReLU, no normalisation, 8x8 input.
    Defined here (same shape as gradrepro's depth experiments' plain net, which lives on
    another branch) so the benchmark does not depend on it."""
    layers: List[nn.Module] = [nn.Conv2d(3, width, 3, padding=1), nn.ReLU()]
    for _ in range(26):
        layers += [nn.Conv2d(width, width, 3, padding=1), nn.ReLU()]
    layers += [nn.Flatten(), nn.Linear(width * 8 * 8, 128), nn.ReLU(),
               nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, num_classes)]
    return nn.Sequential(*layers)


def deep_mlp(tensors: int, width: int = 32, in_dim: int = 32) -> nn.Module:
    """``tensors // 2`` Linear layers with bias: the growth study's tensor-count knob."""
    layers: List[nn.Module] = []
    for i in range(max(tensors // 2, 1)):
        layers += [nn.Linear(in_dim if i == 0 else width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


# name -> (builder, input shape without batch, default batch, quick batch)
MODELS: Dict[str, Tuple[Callable[[], nn.Module], Tuple[int, ...], int, int]] = {
    "cifar10_3c3d": (cifar10_3c3d, (3, 32, 32), 128, 32),
    "resnet18": (resnet18_32, (3, 32, 32), 32, 8),
    "plain30": (plain30, (3, 8, 8), 128, 32),
}

# ----------------------------------------------------------------------------------------
# Tools: one training step each, on the tool's own copy of the model


class Bare:
    """The bare loop: zero_grad, forward, loss (read on the host, as the runner does),
    backward, SGD step."""

    name = "bare"
    every = 1

    def __init__(self, net: nn.Module, batch: Tuple[torch.Tensor, torch.Tensor]) -> None:
        self.net = net
        self.x, self.y = batch
        self.loss_fn = nn.CrossEntropyLoss()
        self.opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

    def logs(self, step: int) -> bool:
        return step % self.every == 0

    def forward_backward(self, step: int) -> None:
        loss = self.loss_fn(self.net(self.x), self.y)
        float(loss.detach())
        loss.backward()

    def step(self, step: int) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.forward_backward(step)
        self.opt.step()


class Anomaly(Bare):
    name = "detect_anomaly"

    def forward_backward(self, step: int) -> None:
        with torch.autograd.detect_anomaly():
            super().forward_backward(step)


class ProbeTool(Bare):
    """The runner's sequence: zero_grad, then inside ``probe.step(...)``: forward -> backward
    -> collect -> optimizer step; the columns come out when the block ends."""

    name = "gradrepro"

    def __init__(self, net, batch, every: int, act_sample: Optional[int] = None, before_on: str = "device") -> None:
        super().__init__(net, batch)
        self.every = every
        if before_on != "device":
            self.name = f"gradrepro_copy_on_{before_on}"
        cfg = ProbeConfig(every=every, activations=True, task_contribution=True, before_on=before_on)
        if act_sample is not None:
            cfg.act_sample = act_sample
        self.probe = Probe(net, cfg, total_steps=10**12)

    def logs(self, step: int) -> bool:
        return self.probe.logs(step)

    def step(self, step: int) -> None:
        self.opt.zero_grad(set_to_none=True)
        with self.probe.step(step, lr=self.opt.param_groups[0]["lr"]) as p:
            loss = self.loss_fn(self.net(self.x), self.y)
            float(loss.detach())
            loss.backward()
            p.collect()
            self.opt.step()
        if p.logged:
            self.columns = p.columns


class CockpitTool(Bare):
    """Cockpit "economy" (Schneider et al. 2021), the documented usage: extended model and
    loss, individual losses passed in, backward inside the cockpit context."""

    name = "cockpit_economy"

    def __init__(self, net, batch, every: int) -> None:
        from backpack import extend
        from cockpit import Cockpit, quantities  # noqa: F401
        from cockpit.utils.configuration import configuration
        from cockpit.utils.schedules import linear

        has_skip = any(type(m).__name__ == "BasicBlock" for m in net.modules())
        net = extend(net, use_converter=has_skip)
        super().__init__(net, batch)
        self.every = every
        self.loss_fn = extend(nn.CrossEntropyLoss())
        self.individual = nn.CrossEntropyLoss(reduction="none")
        self.cockpit = Cockpit(net.parameters(),
                               quantities=configuration("economy", track_schedule=linear(every)))

    def forward_backward(self, step: int) -> None:
        out = self.net(self.x)
        loss = self.loss_fn(out, self.y)
        losses = self.individual(out, self.y)
        float(loss.detach())
        info = {"batch_size": self.x.shape[0], "individual_losses": losses, "loss": loss,
                "optimizer": self.opt}
        with self.cockpit(step, info=info):
            loss.backward(create_graph=self.cockpit.create_graph(step))


def make_tool(tool: str, every: int, net: nn.Module, batch) -> Bare:
    if tool == "bare":
        return Bare(net, batch)
    if tool == "gradrepro":
        return ProbeTool(net, batch, every)
    if tool == "gradrepro_copy_on_host":  # probe.before_on=host: the pre-step copy in host memory
        return ProbeTool(net, batch, every, before_on="host")
    if tool == "cockpit_economy":
        return CockpitTool(net, batch, every)
    if tool == "detect_anomaly":
        return Anomaly(net, batch)
    raise ValueError(tool)


def make_batch(shape: Sequence[int], batch: int, seed: int = 0, device="cpu"):
    """A fixed synthetic batch (the same on every device: drawn on the CPU, then moved)."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(batch, *shape, generator=g), torch.randint(0, 10, (batch,), generator=g)
    return x.to(device), y.to(device)


def synchronize(device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously: timing needs this)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)

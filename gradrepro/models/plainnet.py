"""A plain ReLU network without normalisation: conv 3x3 layers, then fully connected layers.

He et al., ICCV 2015 (arXiv 1502.01852), Sec. 2.2 and Fig. 3: a plain 30-layer net (27 conv
+ 3 fc, no batch normalisation) converges under their init and "completely stalls" under
"Xavier". At CPU scale (experiments/depth_init.md): 8x8 digits, every conv keeps the
resolution (stride 1, padding 1), so ``depth`` alone sets how many times the signal is
multiplied by (1/2) n Var[w].

The same class builds the VGG "model B" conv stack (10 conv 3x3: 64, 64, 128, 128, 256, 256,
512, 512, 512, 512 filters) when ``widths`` lists the filters, with a global-average-pool
head (``gradrepro/configs/model/vggb_convs.yaml``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch
from torch import nn


@dataclass
class PlainNetConfig:
    name: str = "plainnet"
    in_channels: int = "${data.channels}"  # type: ignore[assignment]
    image_size: int = "${data.image_size}"  # type: ignore[assignment]
    num_classes: int = "${data.num_classes}"  # type: ignore[assignment]
    # Weight layers in all: conv layers = depth - len(fc_widths) - 1 (He et al.'s count:
    # 30 = 27 conv + 3 fc). Ignored when ``widths`` lists the conv filters.
    depth: Optional[int] = 30
    width: int = 32  # filters of every conv layer when ``widths`` is not given
    widths: Optional[List[int]] = None
    kernel: int = 3
    # "zeros" as the papers; "circular" gives every position k^2 inputs, the n of the
    # derivation, so border effects do not add to the per-layer factor.
    padding_mode: str = "zeros"
    fc_widths: List[int] = field(default_factory=lambda: [128, 128])  # hidden fc layers
    head: str = "flatten"  # flatten | avgpool (global average pool before the fc layers)


class PlainNet(nn.Module):
    def __init__(self, cfg: PlainNetConfig) -> None:
        super().__init__()
        widths = list(cfg.widths) if cfg.widths else None
        if widths is None:
            if cfg.depth is None:
                raise ValueError("plainnet needs model.depth or model.widths")
            n_conv = int(cfg.depth) - len(cfg.fc_widths) - 1
            if n_conv < 1:
                raise ValueError(f"model.depth={cfg.depth} leaves no conv layer "
                                 f"with {len(cfg.fc_widths) + 1} fc layers")
            widths = [int(cfg.width)] * n_conv
        if cfg.head not in ("flatten", "avgpool"):
            raise ValueError(f"model.head={cfg.head!r}: choose flatten or avgpool")
        convs: list[nn.Module] = []
        channels = int(cfg.in_channels)
        for w in widths:
            convs += [nn.Conv2d(channels, w, cfg.kernel, padding=cfg.kernel // 2,
                                padding_mode=cfg.padding_mode), nn.ReLU()]
            channels = w
        self.features = nn.Sequential(*convs)
        self.avgpool = cfg.head == "avgpool"
        dim = channels if self.avgpool else channels * int(cfg.image_size) ** 2
        fcs: list[nn.Module] = []
        for w in cfg.fc_widths:
            fcs += [nn.Linear(dim, w), nn.ReLU()]
            dim = w
        fcs.append(nn.Linear(dim, int(cfg.num_classes)))
        self.classifier = nn.Sequential(*fcs)
        self.out_dim = int(cfg.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x)  # NxCxHxW, H and W kept by every conv
        h = h.mean(dim=(2, 3)) if self.avgpool else h.flatten(1)  # NxC or NxCHW
        return self.classifier(h)  # NxK

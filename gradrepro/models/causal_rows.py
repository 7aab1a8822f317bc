"""A tiny causal sequence model that reads an image row by row: row t is token t.

    x: N x C x H x W  ->  tokens N x H x (C W)  ->  e = embed(tokens)          N x H x d
    prefix mean m_t = (e_1 + ... + e_t) / t (no weights: the model's only mixing across rows)
    h = relu(mix([e_t, m_t]))  ->  logits = head(h)                            N x H x K

The output is the logits of the last row, having read the whole image (a classifier), or with
``per_row`` set (a next-token objective sets it) those of every row. Each output row depends on rows up to
its own only, so a row's prediction never sees the tokens after it. Every weight is a
``nn.Linear`` applied to each row alike: a weight's gradient is one sum over the batch's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class CausalRowsConfig:
    name: str = "causal_rows"
    row_dim: int = "${calc:'${data.channels} * ${data.image_size}'}"  # type: ignore[assignment]
    width: int = 32
    # Logits for this many classes per row; 0 means the model is a feature extractor (SimSiam).
    num_classes: int = "${data.num_classes}"  # type: ignore[assignment]


class CausalRows(nn.Module):
    def __init__(self, cfg: CausalRowsConfig) -> None:
        super().__init__()
        width = int(cfg.width)
        self.embed = nn.Linear(int(cfg.row_dim), width)
        self.mix = nn.Linear(2 * width, width)
        self.head = nn.Linear(width, cfg.num_classes) if cfg.num_classes > 0 else nn.Identity()
        self.out_dim = cfg.num_classes if cfg.num_classes > 0 else width
        self.per_row = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # NxCxHxW -> NxHxK (per_row) or NxK
        n, c, h, w = x.shape
        e = self.embed(x.permute(0, 2, 1, 3).reshape(n, h, c * w))  # NxHxd
        count = torch.arange(1, h + 1, device=e.device, dtype=e.dtype)[None, :, None]
        prefix = e.cumsum(1) / count  # NxHxd, causal: row t sees rows 1..t
        logits = self.head(torch.relu(self.mix(torch.cat([e, prefix], dim=-1))))
        return logits if self.per_row else logits[:, -1]

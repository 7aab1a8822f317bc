"""SimSiam's CIFAR-10 augmentation (Chen & He 2021, App. D, following its ImageNet recipe in
Sec. 4: random resized crop with scale in [0.2, 1], horizontal flip, colour jitter of
brightness, contrast and saturation 0.4 and hue 0.1 applied with probability 0.8, grayscale
with probability 0.2; no blur on CIFAR), as batched tensor operations with one random draw per
image, on images in [0, 1].

It follows torchvision's ``RandomResizedCrop``, ``ColorJitter`` and ``RandomGrayscale`` with two
simplifications, both for speed on whole batches: the crop's aspect ratio is clipped to the
image instead of redrawn, and the jitter is applied in one fixed order (brightness, contrast,
saturation, hue) instead of a random one. Hue is a rotation of the chroma plane (YIQ). On one
channel, saturation, hue and grayscale change nothing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_GRAY = (0.299, 0.587, 0.114)  # ITU-R 601 luma, as torchvision's rgb_to_grayscale
_RGB_TO_YIQ = torch.tensor([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])


def _uniform(n: int, low: float, high: float, generator: torch.Generator) -> torch.Tensor:
    return low + (high - low) * torch.rand(n, generator=generator)


def _gray(x: torch.Tensor) -> torch.Tensor:
    if x.shape[1] != 3:
        return x
    weights = torch.tensor(_GRAY, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
    return (x * weights).sum(dim=1, keepdim=True).expand_as(x)


def resized_crop_and_flip(x: torch.Tensor, generator: torch.Generator, scale=(0.2, 1.0),
                          ratio=(3 / 4, 4 / 3)) -> torch.Tensor:
    """A crop of area fraction in ``scale`` and aspect ratio in ``ratio``, resized to the image's
    size (bilinear), mirrored with probability 1/2."""
    n = len(x)
    area = _uniform(n, *scale, generator)
    aspect = torch.exp(_uniform(n, math.log(ratio[0]), math.log(ratio[1]), generator))
    w = torch.sqrt(area * aspect).clamp(max=1.0)  # fractions of the side
    h = torch.sqrt(area / aspect).clamp(max=1.0)
    cx = (1 - w) * (2 * torch.rand(n, generator=generator) - 1)  # centre, in [-1, 1] coordinates
    cy = (1 - h) * (2 * torch.rand(n, generator=generator) - 1)
    flip = torch.where(torch.rand(n, generator=generator) < 0.5, -1.0, 1.0)
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0], theta[:, 0, 2] = w * flip, cx
    theta[:, 1, 1], theta[:, 1, 2] = h, cy
    grid = F.affine_grid(theta.to(x.device, x.dtype), list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="reflection", align_corners=False)


def color_jitter(x: torch.Tensor, generator: torch.Generator, strength: float = 0.4, hue: float = 0.1,
                 p: float = 0.8) -> torch.Tensor:
    """Brightness, contrast and saturation factors in [1 - strength, 1 + strength], a hue shift
    in [-hue, hue] of a turn, on each image with probability ``p``; values clamped to [0, 1]."""
    n = len(x)

    def factor() -> torch.Tensor:
        return _uniform(n, 1 - strength, 1 + strength, generator).to(x.device, x.dtype).view(n, 1, 1, 1)

    on = (torch.rand(n, generator=generator) < p).to(x.device).view(n, 1, 1, 1)
    b, c, s = factor(), factor(), factor()
    angle = (2 * math.pi * _uniform(n, -hue, hue, generator)).to(x.device, x.dtype)
    y = (x * b).clamp(0, 1)
    mean = _gray(y).mean(dim=(1, 2, 3), keepdim=True)
    y = ((y - mean) * c + mean).clamp(0, 1)
    y = ((y - _gray(y)) * s + _gray(y)).clamp(0, 1)
    if x.shape[1] == 3:
        y = rotate_hue(y, angle).clamp(0, 1)
    return torch.where(on, y, x)


def rotate_hue(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Rotate each RGB image's chroma (the I, Q plane of YIQ) by ``angle`` radians."""
    to_yiq = _RGB_TO_YIQ.to(x.device, x.dtype)
    cos, sin = torch.cos(angle), torch.sin(angle)
    rot = torch.zeros(len(x), 3, 3, device=x.device, dtype=x.dtype)
    rot[:, 0, 0] = 1
    rot[:, 1, 1], rot[:, 1, 2], rot[:, 2, 1], rot[:, 2, 2] = cos, -sin, sin, cos
    matrix = torch.linalg.inv(to_yiq) @ rot @ to_yiq  # N x 3 x 3, RGB -> RGB
    return torch.einsum("nij,njhw->nihw", matrix, x)


def random_grayscale(x: torch.Tensor, generator: torch.Generator, p: float = 0.2) -> torch.Tensor:
    on = (torch.rand(len(x), generator=generator) < p).to(x.device).view(-1, 1, 1, 1)
    return torch.where(on, _gray(x), x)


def simsiam_view(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One augmented view of each image of ``x`` (N x C x H x W, values in [0, 1])."""
    return random_grayscale(color_jitter(resized_crop_and_flip(x, generator), generator), generator)

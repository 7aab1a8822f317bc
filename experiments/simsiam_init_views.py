"""How much the two views of one image share under a fresh SimSiam network, per seed.

    python experiments/simsiam_init_views.py SEED [SEED ...] [-- OVERRIDE ...]

For each seed: the experiment's network as its run builds it (`experiment=simsiam_baseline`,
train mode, nothing trained), over eight training batches of that seed's views: the mean cosine
between the two views' normalised z of one image, the same between one image's view and
another image's (the batch rolled by one), their gap (what the predictor can regress at the
start), the norm of the batch's mean normalised z (what a constant p can match) and the first
conv's DC content (per filter |sum of its weights| / (sqrt(k) x its norm), k = its 9 weights: 1
for a constant filter, the mean over the filters; such a filter answers the background's
coarse, view-independent blobs rather than the template's edges). Overrides
after `--` go to the config (`-- data.background_std=3.0`). The page's "The control's stuck
state" reads these.
"""

from __future__ import annotations

import statistics
import sys

import torch
import torch.nn.functional as F

from gradrepro.config.compose import compose
from gradrepro.recipe.build import build_training
from gradrepro.train.session import seed_everything

BATCHES = 8


def view_agreement(seed: int, overrides: list[str]) -> dict:
    cfg = compose(["experiment=simsiam_baseline", f"seed={seed}", *overrides])
    device = torch.device("cpu")
    seed_everything(seed, device)
    training = build_training(cfg, device)
    net = getattr(training.net, "module", training.net)
    generator = torch.Generator().manual_seed(seed)
    same, other, mean_norm = [], [], []
    with torch.no_grad():
        for _ in range(BATCHES):
            batch = training.data.sample(generator)
            z1 = F.normalize(net.heads(batch.x)[1], dim=1)
            z2 = F.normalize(net.heads(batch.x2)[1], dim=1)
            same.append(float((z1 * z2).sum(1).mean()))
            other.append(float((z1 * z2.roll(1, 0)).sum(1).mean()))
            mean_norm.append(float(z1.mean(0).norm()))
    same_m, other_m = statistics.mean(same), statistics.mean(other)
    return {"seed": seed, "cos_same_image": same_m, "cos_other_image": other_m,
            "gap": same_m - other_m, "mean_zhat_norm": statistics.mean(mean_norm),
            "first_conv_dc": first_conv_dc(net.backbone)}


def first_conv_dc(backbone: torch.nn.Module) -> float:
    """The mean over the first conv's filters of |sum w| / (sqrt(k) |w|) (k weights each)."""
    conv = next(m for m in backbone.modules() if isinstance(m, torch.nn.Conv2d))
    w = conv.weight.detach().flatten(1)
    return float((w.sum(1).abs() / (w.shape[1] ** 0.5 * w.norm(dim=1))).mean())


def main(argv: list[str]) -> int:
    seeds, overrides = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    if not seeds or not all(s.lstrip("-").isdigit() for s in seeds):
        print("usage: python experiments/simsiam_init_views.py SEED [SEED ...] [-- OVERRIDE ...]", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    print("| seed | cos(z1, z2), same image | cos, other image | gap | norm of mean z/|z| | first conv's DC |")
    print("| --: | --: | --: | --: | --: | --: |")
    for seed in seeds:
        r = view_agreement(int(seed), overrides)
        print(f"| {r['seed']} | {r['cos_same_image']:.3f} | {r['cos_other_image']:.3f} | {r['gap']:.3f} "
              f"| {r['mean_zhat_norm']:.3f} | {r['first_conv_dc']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""An eighth held-out set of silent training errors, written blind: each case is our own toy
reconstruction (CPU, well under a second) of a public report, in its buggy and its fixed form,
written without reading how the recorder works and without running it on any case here.
``CASES[name]`` is a ``cases.Case``; ``CAUSES`` maps each cause to the finding kind that would name
it (the kinds table of docs/record.md), decided before anything ran and not changed since, or to
None where no existing kind names it (such a case counts as cause not named whatever is found).
Every mechanism differs from those of cases.py, cases_invariants.py and cases_heldout*.py.

Scored with ``score.py --set heldout8``; this registry is separate from the other sets'."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from cases import Case
from harness import STEPS, SmallCNN, batch, images, mlp
from torch import nn
from torch.utils.checkpoint import checkpoint

# The cause a report established -> the finding kind that names it (None: no existing kind can).
CAUSES: dict[str, Optional[str]] = {
    "sub_discriminator_left_out": "not_in_optimizer",  # params_disc = mrd + mrd: the second discriminator never steps
    "ctc_infeasible_alignment": "nonfinite_gradient",  # CTC targets longer than the input, zero_infinity=False: inf/NaN
    "unbiased_std_single_sample": "nonfinite_gradient",  # batch standardisation with std() over a last batch of one
    "adapter_merge_not_idempotent": "frozen_moved",  # merged twice, unmerged once: the frozen base keeps a delta
    "norm_conversion_resets_eval": "frozen_norm_drift",  # a BatchNorm converter drops the eval flag of frozen norms
    "adversarial_term_on_detached_fake": None,  # the generator's adversarial loss on fake.detach(): only L1 trains it
    "labels_preshifted_for_causal_lm": None,  # labels shifted in the collator and again in the model: predicts t+2
    "mask_resized_bilinear": None,  # segmentation labels resized with bilinear interpolation: boundary classes invented
    "global_seed_reset_by_sampling": None,  # an in-loop sampler seeds the global RNG: the same batches and noise repeat
    "actor_loss_sign_missing": None,  # the DDPG actor minimises Q instead of maximising it
    "checkpoint_rng_not_preserved": None,  # checkpoint(preserve_rng_state=False) with dropout: recompute uses new masks
    "clip_norm_per_shard": None,  # clip_grad_norm_ on each shard's own gradients: a different scale per shard
    "episode_mean_log_prob": None,  # REINFORCE: the episode's mean log-prob times each return
    "ranking_loss_without_log": None,  # pairwise reward-model loss -sigmoid(d) instead of -logsigmoid(d): saturates
}

CASES: dict[str, Case] = {}

# Objects and numbers the loops make besides the recorded model, kept for check_heldout8.py.
SIDE: dict[tuple, object] = {}


def case(cause: str, url: str, report: str):
    assert cause in CAUSES, cause

    def register(fn):
        CASES[fn.__name__] = Case(fn, cause, url, report)
        return fn
    return register


def _train(model, opt, record, make=batch, loss_fn=F.cross_entropy, steps=STEPS, after_step=None, **options):
    record(model, opt, **options)
    for step in range(steps):
        x, y = make()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        if after_step is not None:
            after_step(step)


# -- GANs ---------------------------------------------------------------------------------------------
def paired_signals(n=32):
    """A conditional generation task (image2reverb in miniature): a condition and the target it maps to."""
    c = torch.randn(n, 4)
    return c, torch.cat([torch.tanh(c), c[:, :2] * c[:, 2:]], 1)


@case("adversarial_term_on_detached_fake", "https://github.com/nikhilsinghmus/image2reverb/issues/37",
      "in the generator step the fake is detached before the discriminator (d(fake.detach(), f)): the adversarial "
      "term G_loss1 sends no gradient into the generator, which is trained by its reconstruction term alone while "
      "the discriminator takes over (confirmed a bug by the author)")
def generator_adversarial_term_detached(buggy, record):
    gen = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 6))
    disc = nn.Sequential(nn.Linear(10, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    opt_g, opt_d = torch.optim.Adam(gen.parameters(), lr=2e-3), torch.optim.Adam(disc.parameters(), lr=2e-3)
    record(gen, opt_g)
    adv_norms = []
    for _ in range(STEPS):
        c, real = paired_signals()
        fake = gen(c)
        # the discriminator (LSGAN)
        opt_d.zero_grad()
        d_loss = F.mse_loss(disc(torch.cat([real, c], 1)), torch.ones(32, 1)) + \
            F.mse_loss(disc(torch.cat([fake.detach(), c], 1)), torch.zeros(32, 1))
        d_loss.backward()
        opt_d.step()
        # the generator
        opt_g.zero_grad()
        seen = fake.detach() if buggy else fake
        g_adv = F.mse_loss(disc(torch.cat([seen, c], 1)), torch.ones(32, 1))
        g_rec = 10.0 * F.l1_loss(fake, real)
        grads = torch.autograd.grad(g_adv, list(gen.parameters()), retain_graph=True, allow_unused=True)
        adv_norms.append(sum(float(g.norm()) for g in grads if g is not None))
        (g_adv + g_rec).backward()
        opt_g.step()
    SIDE["adversarial_term_on_detached_fake", buggy] = adv_norms
    return 0


class MultiDiscriminator(nn.Module):
    """Two discriminators on two views of a waveform-like vector (the multi-resolution and multi-period
    discriminators of UNIVERSE++'s GAN loss, in miniature)."""

    def __init__(self) -> None:
        super().__init__()
        self.mrd = nn.Sequential(nn.Linear(8, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
        self.mpd = nn.Sequential(nn.Linear(8, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

    def forward(self, x):
        return self.mrd(x), self.mpd(x.reshape(-1, 2, 4).transpose(1, 2).reshape(-1, 8))


def real_waves(n=32):
    t = torch.linspace(0, 1, 8)
    return torch.sin(6.0 * t + 3.0 * torch.rand(n, 1)) * (0.5 + torch.rand(n, 1))


@case("sub_discriminator_left_out", "https://github.com/line/open-universe/issues/5",
      "the discriminators' optimizer is built from list(self.loss_mrd.parameters()) + list(self.loss_mrd.parameters"
      "()): the multi-period discriminator is never optimized (and the other one is listed twice); the fix puts "
      "loss_mpd's parameters in its place")
def second_discriminator_not_optimized(buggy, record):
    gen = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 8))
    discs = MultiDiscriminator()
    params_disc = list(discs.mrd.parameters()) + list((discs.mrd if buggy else discs.mpd).parameters())
    opt_d = torch.optim.Adam(params_disc, lr=2e-3)
    opt_g = torch.optim.Adam(gen.parameters(), lr=2e-3)
    record(discs, opt_d)
    for _ in range(STEPS):
        fake = gen(torch.randn(32, 4))
        opt_d.zero_grad()
        d_loss = sum(F.mse_loss(o, torch.ones_like(o)) for o in discs(real_waves())) + \
            sum(F.mse_loss(o, torch.zeros_like(o)) for o in discs(fake.detach()))
        d_loss.backward()
        opt_d.step()
        opt_g.zero_grad()
        sum(F.mse_loss(o, torch.ones_like(o)) for o in discs(fake)).backward()
        opt_g.step()
    SIDE["sub_discriminator_left_out", buggy] = gen
    return 0


# -- losses whose value or gradient is not finite ----------------------------------------------------------
_T, _CTC_CLASSES = 8, 6  # frames per crop; blank 0 and 5 characters


def text_crops(n=16):
    """Features of n text crops, 8 frames each, and their transcriptions (2 to 3 characters, each spelled by a
    feature of the frames). The last crop of every batch carries a transcription of 10 characters (a mislabelled
    crop: longer than its 8 frames, so no CTC alignment exists)."""
    lengths = torch.randint(2, 4, (n,))
    lengths[-1] = 10
    targets = torch.randint(1, _CTC_CLASSES, (n, 10))
    x = 0.3 * torch.randn(n, _T, 8)
    for i in range(n - 1):
        for k in range(int(lengths[i])):
            x[i, 2 * k + 1, int(targets[i, k])] += 2.0
    return x, targets, lengths


class CRNNHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(8, 16, batch_first=True)
        self.out = nn.Linear(16, _CTC_CLASSES)

    def forward(self, x):
        return self.out(self.rnn(x)[0]).log_softmax(2)


@case("ctc_infeasible_alignment", "https://github.com/open-mmlab/mmocr/pull/159",
      "CTCLoss with zero_infinity=False on batches holding a sample whose target is longer than its input: that "
      "sample's loss is infinite and the gradients NaN (fixed with zero_infinity=True)")
def ctc_without_zero_infinity(buggy, record):
    model = CRNNHead()
    ctc = nn.CTCLoss(blank=0, zero_infinity=not buggy)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    record(model, opt)
    for _ in range(STEPS):
        x, targets, lengths = text_crops()
        opt.zero_grad()
        log_probs = model(x).transpose(0, 1)  # (T, N, C)
        ctc(log_probs, targets, torch.full((x.shape[0],), _T), lengths).backward()
        opt.step()
    return 0


class BatchStandardised(nn.Module):
    """A feature standardisation over the batch (mean and std of the current batch), then a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(10, 32), nn.Linear(32, 3)

    def forward(self, x):
        h = self.body(x)
        h = (h - h.mean(0)) / (h.std(0) + 1e-5)
        return self.head(torch.relu(h))


_DATASET = 97  # 3 batches of 32 and one of 1


@case("unbiased_std_single_sample", "https://github.com/pytorch/pytorch/issues/29372",
      "torch.std() of a single item is NaN (the unbiased estimate divides by n - 1 = 0): a per-batch "
      "standardisation over a data set whose last batch holds one sample gives NaN outputs and gradients on that "
      "batch (fixed here by dropping the last, incomplete batch)")
def last_batch_of_one_standardised(buggy, record):
    torch.manual_seed(0)
    data_x = torch.randn(_DATASET, 10)
    data_y = data_x[:, :3].argmax(1)
    model = BatchStandardised()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    record(model, opt)

    def batches():
        while True:
            order = torch.randperm(_DATASET)
            for i in range(0, _DATASET, 32):
                idx = order[i:i + 32]
                if buggy or len(idx) == 32:  # DataLoader(drop_last=False) vs drop_last=True
                    yield data_x[idx], data_y[idx]
    it = batches()
    for _ in range(STEPS):
        x, y = next(it)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return 3


# -- adapters, norms and conversions -----------------------------------------------------------------------
class LoraLinear(nn.Module):
    """A frozen base linear layer with a LoRA adapter (B starts at zero). ``idempotent`` is the fix of the
    report: merge() does nothing where the adapter is already merged."""

    def __init__(self, base: nn.Linear, r=4, alpha=8, idempotent=True) -> None:
        super().__init__()
        self.base = base
        self.base.requires_grad_(False)
        self.lora_A = nn.Parameter(0.1 * torch.randn(r, base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))
        self.scaling, self.idempotent, self.merged = alpha / r, idempotent, False

    def delta(self):
        return self.scaling * self.lora_B @ self.lora_A

    @torch.no_grad()
    def merge(self):
        if self.idempotent and self.merged:
            return
        self.base.weight += self.delta()
        self.merged = True

    @torch.no_grad()
    def unmerge(self):
        if self.merged:
            self.base.weight -= self.delta()
            self.merged = False

    def forward(self, x):
        out = self.base(x)
        return out if self.merged else out + x @ self.delta().T


class LoraClassifier(nn.Module):
    def __init__(self, idempotent: bool) -> None:
        super().__init__()
        torch.manual_seed(1)  # the 'pretrained' base
        self.fc1 = LoraLinear(nn.Linear(10, 32), idempotent=idempotent)
        self.fc2 = LoraLinear(nn.Linear(32, 3), idempotent=idempotent)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))

    def adapters(self):
        return [self.fc1, self.fc2]


def generate(model, x):
    """Fast inference for the evaluation callback: adapters merged into the base weights."""
    for m in model.adapters():
        m.merge()
    with torch.no_grad():
        return model(x).argmax(1)


def evaluate(model, x, y):
    for m in model.adapters():
        m.merge()  # the evaluation wrapper merges too (as merge_and_unload-style helpers do implicitly)
    acc = float((generate(model, x) == y).float().mean())
    for m in model.adapters():
        m.unmerge()
    return acc


@case("adapter_merge_not_idempotent", "https://github.com/huggingface/peft/pull/1355",
      "merging LoRA weights was not idempotent: a merge called on an already merged adapter adds the delta weights "
      "again, and merges happen implicitly; an evaluation that merges twice and unmerges once leaves one delta in "
      "the frozen base weights while the adapter stays active, so it counts twice from then on")
def lora_evaluation_merges_twice(buggy, record):
    model = LoraClassifier(idempotent=not buggy)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    base0 = [m.base.weight.detach().clone() for m in model.adapters()]
    xe, ye = batch(256)
    SIDE["adapter_merge_not_idempotent", buggy] = (model, base0)
    _train(model, opt, record, after_step=lambda step: evaluate(model, xe, ye) if step % 10 == 4 else None)
    return 5  # the first training forward pass after the first evaluation


class FrozenBackboneNet(nn.Module):
    """SmallCNN with a pretrained, frozen backbone whose BatchNorms are kept in eval mode (norm_eval)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = SmallCNN()
        self.net.backbone.requires_grad_(False)

    def forward(self, x):
        return self.net(x)


def convert_norms(module: nn.Module, keep_mode: bool) -> nn.Module:
    """convert_sync_batchnorm's recursion in miniature (the new module shares the affine parameters and copies
    the running statistics). ``keep_mode`` is the fix of the report: the new module keeps the old one's training
    flag; without it, the new module is in train mode whatever the old one was."""
    if isinstance(module, nn.BatchNorm2d):
        new = nn.BatchNorm2d(module.num_features, module.eps, module.momentum, module.affine)
        new.weight, new.bias = module.weight, module.bias
        new.running_mean, new.running_var = module.running_mean, module.running_var
        new.num_batches_tracked = module.num_batches_tracked
        if keep_mode:
            new.train(module.training)
        return new
    for name, child in module.named_children():
        module.add_module(name, convert_norms(child, keep_mode))
    return module


def shifted_images(n=16):
    x, y = images(n)
    return 0.5 * x + 1.0, y  # the fine-tuning data's statistics differ from the pretraining data's


@case("norm_conversion_resets_eval", "https://github.com/pytorch/pytorch/pull/111998",
      "converting BatchNorm layers (convert_sync_batchnorm) created the new layers in train mode even where the "
      "original ones had been put in eval mode to freeze them: the frozen backbone's running statistics move with "
      "every batch (fixed by keeping the converted layer's training flag)")
def frozen_norms_reenabled_by_conversion(buggy, record):
    model = FrozenBackboneNet()
    model.train()
    for m in model.net.backbone.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eval()  # norm_eval: the pretrained statistics stay as they are
    model = convert_norms(model, keep_mode=not buggy)  # the distributed set-up, after freezing
    opt = torch.optim.SGD(model.net.head.parameters(), lr=0.05, momentum=0.9)
    _train(model, opt, record, make=shifted_images)
    return 0


# -- labels and data ----------------------------------------------------------------------------------------
_LM_V, _LM_L = 11, 12


def lm_sequences(n=16):
    """Token sequences following x[t+1] = (3 x[t] + 1) mod 11."""
    x = torch.empty(n, _LM_L, dtype=torch.long)
    x[:, 0] = torch.randint(0, _LM_V, (n,))
    for t in range(1, _LM_L):
        x[:, t] = (3 * x[:, t - 1] + 1) % _LM_V
    return x


class TinyCausalLM(nn.Module):
    """A causal LM whose loss shifts the labels itself (as Hugging Face's *ForCausalLM models do)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(_LM_V, 32), nn.Linear(32, _LM_V)

    def forward(self, input_ids, labels=None):
        logits = self.out(torch.tanh(self.emb(input_ids)))
        if labels is None:
            return logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, _LM_V), labels[:, 1:].reshape(-1), ignore_index=-100)


def collate(x, preshift):
    if not preshift:
        return x, x.clone()  # labels = input_ids
    return x, torch.cat([x[:, 1:], torch.full((x.shape[0], 1), -100)], 1)  # the next token, shifted by hand


@case("labels_preshifted_for_causal_lm", "https://github.com/huggingface/transformers/pull/44642",
      "causal LM models shift the labels internally; users who pre-shift their labels in the collator train "
      "next-next-token prediction by accident (the loss falls all the same)")
def causal_lm_labels_shifted_twice(buggy, record):
    model = TinyCausalLM()
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    record(model, opt)
    for _ in range(STEPS):
        ids, labels = collate(lm_sequences(), preshift=buggy)
        opt.zero_grad()
        model(ids, labels).backward()
        opt.step()
    return 0


_SEG = 16


def label_maps(n=8):
    """Images of 16x16 with two rectangles, class 1 and class 3 (0 background), and their label maps. The
    images are noisy renderings of the maps (one channel per class)."""
    y = torch.zeros(n, _SEG, _SEG, dtype=torch.long)
    for i in range(n):
        r, c = torch.randint(0, 8, (2,)).tolist()
        y[i, r:r + 6, c:c + 6] = 1
        r, c = torch.randint(0, 8, (2,)).tolist()
        y[i, r:r + 6, c:c + 6] = 3
    x = F.one_hot(y, 4).permute(0, 3, 1, 2).float() + 0.3 * torch.randn(n, 4, _SEG, _SEG)
    return x, y


def resize_pair(x, y, buggy, size=8):
    """The data pipeline's resize to the network's input size: the image bilinearly, the label map with the same
    interpolation (buggy) or nearest-neighbour (fixed)."""
    x = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
    if buggy:
        y = F.interpolate(y[:, None].float(), size=size, mode="bilinear", align_corners=False)[:, 0].round().long()
    else:
        y = F.interpolate(y[:, None].float(), size=size, mode="nearest")[:, 0].long()
    return x, y


def seg_head() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(4, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 4, 1))


@case("mask_resized_bilinear", "https://github.com/shekkizh/FCN.tensorflow/issues/4",
      "annotations resized with the default bilinear interpolation: label values between two classes are averaged, "
      "so pixels on object edges get wrong labels (here class 2 appears between 1 and 3, where no object is); "
      "acknowledged as a bug and fixed with nearest-neighbour resizing")
def label_maps_resized_bilinear(buggy, record):
    model = seg_head()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    record(model, opt)
    for _ in range(STEPS):
        x, y = resize_pair(*label_maps(), buggy)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return 0


_POINTS = torch.Generator().manual_seed(5)
_DATA = torch.cat([torch.randn(128, 2, generator=_POINTS) * 0.2 + torch.tensor([1.0, 1.0]),
                   torch.randn(128, 2, generator=_POINTS) * 0.2 - torch.tensor([1.0, 1.0])])


class Denoiser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 64), nn.SiLU(), nn.Linear(64, 2))

    def forward(self, x, t):
        return self.net(torch.cat([x, t[:, None]], 1))


def sample(model, buggy, n=16):
    """The in-training sampling of the example script: the noise generator is made with torch.manual_seed(0),
    which reseeds the global generator (buggy); the fix uses a generator of its own."""
    gen = torch.manual_seed(0) if buggy else torch.Generator().manual_seed(0)
    x = torch.randn(n, 2, generator=gen)
    with torch.no_grad():
        for t in torch.linspace(1, 0.1, 5):
            x = x - 0.2 * model(x, t.expand(n))
    return x


@case("global_seed_reset_by_sampling", "https://github.com/huggingface/diffusers/issues/175",
      "the unconditional training example makes its sampling generator with torch.manual_seed(0) inside the "
      "training loop: that reseeds the global RNG, so the shuffling, noise and timesteps that follow repeat after "
      "every sampling (same mini-batches in the same order)")
def sampling_reseeds_training_rng(buggy, record):
    model = Denoiser()
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    record(model, opt)
    drawn = []
    for step in range(STEPS):
        idx = torch.randint(0, len(_DATA), (32,))
        t = torch.rand(32)
        noise = torch.randn(32, 2)
        drawn.append(idx)
        x0 = _DATA[idx]
        xt = (1 - t[:, None]) * x0 + t[:, None] * noise
        opt.zero_grad()
        F.mse_loss(model(xt, t), noise - x0).backward()
        opt.step()
        if step % 8 == 7:
            sample(model, buggy)  # save_images every few steps
    SIDE["global_seed_reset_by_sampling", buggy] = drawn
    return 16  # the first step whose draws repeat an earlier step's (8 draws after the first reseed)


# -- reinforcement learning -------------------------------------------------------------------------------
def bandit_states(n=64):
    s = torch.randn(n, 4)
    return s, torch.tanh(s[:, :2] - s[:, 2:])  # the best action for each state


def bandit_reward(s, a):
    return -((a - bandit_states_best(s)) ** 2).sum(1, keepdim=True)


def bandit_states_best(s):
    return torch.tanh(s[:, :2] - s[:, 2:])


@case("actor_loss_sign_missing", "https://github.com/KanishJebaMathewM/Truxify/pull/11885",
      "the actor loss of a deterministic policy gradient is written without its minus sign: the actor minimises "
      "the critic's Q instead of maximising it (fixed: actor_loss = -q_values.mean())")
def ddpg_actor_minimises_q(buggy, record):
    actor = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2), nn.Tanh())
    critic = nn.Sequential(nn.Linear(6, 64), nn.ReLU(), nn.Linear(64, 1))
    opt_a, opt_c = torch.optim.Adam(actor.parameters(), lr=3e-3), torch.optim.Adam(critic.parameters(), lr=1e-2)
    record(actor, opt_a)
    rewards = []
    for _ in range(STEPS):
        s, _ = bandit_states()
        for _ in range(4):  # the critic updated more often than the actor (delayed policy updates)
            with torch.no_grad():
                a = (actor(s) + 0.5 * torch.randn(len(s), 2)).clamp(-1, 1)
            opt_c.zero_grad()
            F.mse_loss(critic(torch.cat([s, a], 1)), bandit_reward(s, a)).backward()
            opt_c.step()
        q = critic(torch.cat([s, actor(s)], 1))
        actor_loss = q.mean() if buggy else -q.mean()
        opt_a.zero_grad()
        actor_loss.backward()
        opt_a.step()
        with torch.no_grad():
            rewards.append(float(bandit_reward(s, actor(s)).mean()))
    SIDE["actor_loss_sign_missing", buggy] = rewards
    return 0


_EP_LEN, _ARMS = 4, 3


def run_episodes(policy, n=32):
    """n episodes of 4 steps; at each step the state is one of 3 contexts (one-hot) and action == context pays 1."""
    ctx = torch.randint(0, _ARMS, (n, _EP_LEN))
    logits = policy(F.one_hot(ctx, _ARMS).float())
    dist = torch.distributions.Categorical(logits=logits)
    a = dist.sample()
    return dist.log_prob(a), (a == ctx).float()


def reinforce_loss(log_probs, rewards, buggy, gamma=0.99):
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    if buggy:  # the tutorial's update: the mean log-prob of the episode times every return
        return -(log_probs.mean(1, keepdim=True) * returns).sum(1).mean()
    return -(log_probs * returns).sum(1).mean()


@case("episode_mean_log_prob", "https://github.com/Farama-Foundation/Gymnasium/issues/1336",
      "the REINFORCE tutorial multiplies the mean of the episode's log-probabilities by the discounted returns: "
      "every action of an episode gets the same weight, so no action is credited with its own return-to-go")
def reinforce_with_mean_log_prob(buggy, record):
    policy = nn.Sequential(nn.Linear(_ARMS, 16), nn.Tanh(), nn.Linear(16, _ARMS))
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    record(policy, opt)
    for step in range(STEPS):
        log_probs, rewards = run_episodes(policy)
        loss = reinforce_loss(log_probs, rewards, buggy)
        if step == 0:
            g_used = torch.autograd.grad(loss, list(policy.parameters()), retain_graph=True)
            g_pg = torch.autograd.grad(reinforce_loss(log_probs, rewards, False), list(policy.parameters()),
                                       retain_graph=True)
            SIDE["episode_mean_log_prob", buggy] = (torch.cat([g.flatten() for g in g_used]),
                                                    torch.cat([g.flatten() for g in g_pg]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return 0


# -- checkpointing, sharding, reward models ----------------------------------------------------------------
class CheckpointedDropoutNet(nn.Module):
    def __init__(self, preserve_rng: bool) -> None:
        super().__init__()
        self.preserve_rng = preserve_rng
        self.stem = nn.Linear(10, 64)
        self.block = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 64))
        self.head = nn.Linear(64, 3)
        self.use_checkpoint = True

    def forward(self, x):
        h = torch.relu(self.stem(x))
        if self.use_checkpoint:
            h = h + checkpoint(self.block, h, use_reentrant=False, preserve_rng_state=self.preserve_rng)
        else:
            h = h + self.block(h)
        return self.head(h)


@case("checkpoint_rng_not_preserved", "https://github.com/allenai/OLMo-core/pull/828",
      "activation checkpointing with preserve_rng_state=False on blocks with dropout: the recompute in backward draws "
      "fresh dropout masks, so the gradients are taken for a different sample than the loss (turning checkpointing "
      "off moved the loss; fixed by preserving the RNG state)")
def checkpoint_without_rng_state(buggy, record):
    model = CheckpointedDropoutNet(preserve_rng=not buggy)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    record(model, opt)
    for step in range(STEPS):
        x, y = batch()
        if step == 0:  # the gradient the same forward pass would have without checkpointing
            state = torch.get_rng_state()
            model.use_checkpoint = False
            true = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
            model.use_checkpoint = True
            torch.set_rng_state(state)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if step == 0:
            SIDE["checkpoint_rng_not_preserved", buggy] = (torch.cat([g.flatten() for g in true]),
                                                         torch.cat([p.grad.flatten() for p in model.parameters()]))
        opt.step()
    return 0


def shards(model):
    """Two 'ranks' of a fully sharded model, in one process: each holds the gradients of some of the tensors."""
    params = list(model.parameters())
    return [params[:2], params[2:]]


def clip_sharded(model, max_norm, buggy):
    norms = [torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in shard])) for shard in shards(model)]
    if buggy:  # torch.nn.utils.clip_grad_norm_(model.parameters(), ...) on each rank: its shard's norm only
        coefs = [min(1.0, max_norm / (float(n) + 1e-6)) for n in norms]
    else:  # FSDP's clip_grad_norm_: the norm all-reduced over the shards
        total = float(torch.linalg.vector_norm(torch.stack(norms)))
        coefs = [min(1.0, max_norm / (total + 1e-6))] * len(norms)
    for shard, coef in zip(shards(model), coefs):
        for p in shard:
            p.grad.mul_(coef)
    return coefs


@case("clip_norm_per_shard", "https://github.com/pytorch/pytorch/issues/72548",
      "with FSDP the parameters are sharded across ranks: torch.nn.utils.clip_grad_norm_ sees only the local shard, "
      "so each rank computes its own norm and scales its part of the gradient differently, and the clipped update "
      "is no longer the gradient's direction (fixed by FSDP's clip_grad_norm_, which reduces the norm)")
def gradient_clipped_per_shard(buggy, record):
    model = mlp(hidden=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    record(model, opt)
    coefs = []
    for _ in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        (4.0 * F.cross_entropy(model(x), y)).backward()
        coefs.append(clip_sharded(model, max_norm=0.5, buggy=buggy))
        opt.step()
    SIDE["clip_norm_per_shard", buggy] = coefs
    return 0


def preference_pairs(n=32):
    """Pairs (chosen, rejected) of feature vectors; the hidden preference is feature 0."""
    a, b = torch.randn(n, 10), torch.randn(n, 10)
    swap = (a[:, 0] < b[:, 0])[:, None]
    return torch.where(swap, b, a), torch.where(swap, a, b)


class RewardModel(nn.Module):
    """A reward head on a 'pretrained' body; the head starts with large weights, so some pairs start far on the
    wrong side."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 32), nn.Tanh())
        self.head = nn.Linear(32, 1)
        with torch.no_grad():
            self.head.weight.mul_(20.0)

    def forward(self, x):
        return self.head(self.body(x)).squeeze(1)


def pairwise_loss(model, chosen, rejected, buggy):
    d = model(chosen) - model(rejected)
    return -torch.sigmoid(d).mean() if buggy else -F.logsigmoid(d).mean()


@case("ranking_loss_without_log", "https://github.com/HarderThenHarder/transformers_tasks/issues/15",
      "the RLHF reward model's pairwise loss maximises sigmoid(r_good - r_bad) without the log the paper uses: the "
      "gradient vanishes on pairs ranked badly wrong, which then stay wrong (fixed by switching to logsigmoid)")
def reward_model_sigmoid_loss(buggy, record):
    model = RewardModel()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    record(model, opt)
    for _ in range(STEPS):
        chosen, rejected = preference_pairs()
        opt.zero_grad()
        pairwise_loss(model, chosen, rejected, buggy).backward()
        opt.step()
    return 0

"""Eighth held-out set of healthy loops: unusual but correct patterns real users write, written
blind (without reading how the recorder works and without running it on them) for
``score.py --set heldout8``. Any finding at warning or error level on one of them is a false
alarm. Each is ``fn(ok, record) -> -1`` like healthy.py's; this registry is separate from the
other sets'. None repeats a pattern of healthy.py, healthy_patterns.py or healthy_heldout*.py.
``LOSSES[name]`` keeps each loop's training losses, for check_heldout8.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from harness import STEPS, batch, mlp
from torch import nn

HEALTHY: dict[str, object] = {}
LOSSES: dict[str, list] = {}


def healthy(fn):
    HEALTHY[fn.__name__] = fn
    return fn


def _log(name, loss):
    LOSSES.setdefault(name, []).append(float(loss))


@healthy
def ctc_zero_infinity_noisy_labels(_, record):
    """CTC on text crops where some transcriptions are longer than the crop: zero_infinity=True zeroes those
    samples' infinite losses and their gradients; the rest trains."""
    import cases_heldout8 as c8
    LOSSES.pop("ctc_zero_infinity_noisy_labels", None)
    model = c8.CRNNHead()
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    record(model, opt)
    for _ in range(STEPS):
        x, targets, lengths = c8.text_crops()
        opt.zero_grad()
        loss = ctc(model(x).transpose(0, 1), targets, torch.full((x.shape[0],), c8._T), lengths)
        loss.backward()
        opt.step()
        _log("ctc_zero_infinity_noisy_labels", loss)
    return -1


@healthy
def lora_merge_unmerge_for_eval(_, record):
    """A LoRA classifier evaluated every 10 steps with its adapters merged into the frozen base weights (once) and
    unmerged right after: the base weights change during evaluation and are back before the next step."""
    import cases_heldout8 as c8
    LOSSES.pop("lora_merge_unmerge_for_eval", None)
    model = c8.LoraClassifier(idempotent=True)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    xe, ye = batch(128)
    record(model, opt)
    for step in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        _log("lora_merge_unmerge_for_eval", loss)
        if step % 10 == 4:
            c8.generate(model, xe)
            for m in model.adapters():
                m.unmerge()
    return -1


@healthy
def reward_model_logsigmoid_margin(_, record):
    """A pairwise reward model trained with -logsigmoid(r_chosen - r_rejected - margin) and a small penalty on the
    rewards' size (centring, as some RLHF recipes add)."""
    import cases_heldout8 as c8
    LOSSES.pop("reward_model_logsigmoid_margin", None)
    model = c8.RewardModel()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    record(model, opt)
    for _ in range(STEPS):
        chosen, rejected = c8.preference_pairs()
        rc, rr = model(chosen), model(rejected)
        loss = -F.logsigmoid(rc - rr - 0.1).mean() + 1e-3 * (rc ** 2 + rr ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        _log("reward_model_logsigmoid_margin", loss)
    return -1


class _PolicyWithBaseline(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 16), nn.Tanh())
        self.pi, self.v = nn.Linear(16, 3), nn.Linear(16, 1)

    def forward(self, s):
        h = self.body(s)
        return self.pi(h), self.v(h).squeeze(-1)


@healthy
def reinforce_reward_to_go_baseline(_, record):
    """REINFORCE with per-step rewards-to-go and a learned value baseline sharing the body: the advantage is
    detached for the policy term, the value head regresses the returns, and an entropy bonus is subtracted; the
    total loss goes negative."""
    LOSSES.pop("reinforce_reward_to_go_baseline", None)
    model = _PolicyWithBaseline()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    record(model, opt)
    for _ in range(STEPS):
        ctx = torch.randint(0, 3, (32, 4))
        logits, v = model(F.one_hot(ctx, 3).float())
        dist = torch.distributions.Categorical(logits=logits)
        a = dist.sample()
        r = (a == ctx).float()
        returns = r.flip(1).cumsum(1).flip(1)
        adv = (returns - v).detach()
        loss = -(dist.log_prob(a) * adv).mean() + 0.5 * F.mse_loss(v, returns) - 0.01 * dist.entropy().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        _log("reinforce_reward_to_go_baseline", -float(r.mean()))
    return -1


@healthy
def two_discriminators_one_optimizer(_, record):
    """A generator against two discriminators on two views, both in one optimizer built from the concatenated
    parameter lists (the fixed form of the UNIVERSE++ report); LSGAN losses."""
    import cases_heldout8 as c8
    LOSSES.pop("two_discriminators_one_optimizer", None)
    gen = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 8))
    discs = c8.MultiDiscriminator()
    opt_d = torch.optim.Adam(list(discs.mrd.parameters()) + list(discs.mpd.parameters()), lr=2e-3)
    opt_g = torch.optim.Adam(gen.parameters(), lr=2e-3)
    record(gen, opt_g)
    for _ in range(STEPS):
        fake = gen(torch.randn(32, 4))
        opt_d.zero_grad()
        (sum(F.mse_loss(o, torch.ones_like(o)) for o in discs(c8.real_waves())) +
         sum(F.mse_loss(o, torch.zeros_like(o)) for o in discs(fake.detach()))).backward()
        opt_d.step()
        opt_g.zero_grad()
        g_loss = sum(F.mse_loss(o, torch.ones_like(o)) for o in discs(fake))
        g_loss.backward()
        opt_g.step()
        _log("two_discriminators_one_optimizer", F.mse_loss(fake.detach().mean(0), c8.real_waves(256).mean(0)))
    return -1


@healthy
def batch_standardise_population_std(_, record):
    """Per-batch feature standardisation with the population std (unbiased=False) plus eps, on a data set whose
    last batch is a single sample: that batch's standardised features are 0 and only the head's bias learns from
    it."""
    import cases_heldout8 as c8
    LOSSES.pop("batch_standardise_population_std", None)

    class Model(c8.BatchStandardised):
        def forward(self, x):
            h = self.body(x)
            var = h.var(0, unbiased=False)
            h = (h - h.mean(0)) * torch.rsqrt(var + 1e-5)
            return self.head(torch.relu(h))
    gen = torch.Generator().manual_seed(3)
    data_x = torch.randn(c8._DATASET, 10, generator=gen)
    data_y = data_x[:, :3].argmax(1)
    model = Model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    record(model, opt)
    step = 0
    while step < STEPS:
        order = torch.randperm(c8._DATASET)
        for i in range(0, c8._DATASET, 32):
            if step == STEPS:
                break
            idx = order[i:i + 32]
            opt.zero_grad()
            loss = F.cross_entropy(model(data_x[idx]), data_y[idx])
            loss.backward()
            opt.step()
            if len(idx) > 1:
                _log("batch_standardise_population_std", loss)
            step += 1
    return -1


@healthy
def sharded_clip_global_norm(_, record):
    """Gradient clipping over two shards (one process) done right: the shards' norms combined into the global
    norm, one coefficient for all; clipping is active on most steps."""
    import cases_heldout8 as c8
    LOSSES.pop("sharded_clip_global_norm", None)
    model = mlp(hidden=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    record(model, opt)
    for _ in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        (4.0 * loss).backward()
        c8.clip_sharded(model, max_norm=0.5, buggy=False)
        opt.step()
        _log("sharded_clip_global_norm", loss)
    return -1


@healthy
def seeded_generator_per_epoch(_, record):
    """Data order from a torch.Generator seeded with the epoch number (reproducible, different every epoch), and
    evaluation noise from a generator of its own; the global RNG is never reseeded."""
    import cases_heldout8 as c8
    LOSSES.pop("seeded_generator_per_epoch", None)
    model = c8.Denoiser()
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    record(model, opt)
    for step in range(STEPS):
        epoch, k = divmod(step, 8)
        order = torch.randperm(len(c8._DATA), generator=torch.Generator().manual_seed(epoch))
        idx = order[32 * k:32 * (k + 1)]
        t, noise = torch.rand(32), torch.randn(32, 2)
        x0 = c8._DATA[idx]
        xt = (1 - t[:, None]) * x0 + t[:, None] * noise
        opt.zero_grad()
        loss = F.mse_loss(model(xt, t), noise - x0)
        loss.backward()
        opt.step()
        _log("seeded_generator_per_epoch", loss)
        if k == 7:
            c8.sample(model, buggy=False)
    return -1


@healthy
def segmentation_nearest_with_ignore(_, record):
    """Label maps resized with nearest-neighbour interpolation and a border of 'void' pixels (255) excluded by
    ignore_index; the images bilinearly."""
    import cases_heldout8 as c8
    LOSSES.pop("segmentation_nearest_with_ignore", None)
    model = c8.seg_head()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    record(model, opt)
    for _ in range(STEPS):
        x, y = c8.resize_pair(*c8.label_maps(), buggy=False)
        y[:, 0, :] = 255
        y[:, :, 0] = 255
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y, ignore_index=255)
        loss.backward()
        opt.step()
        _log("segmentation_nearest_with_ignore", loss)
    return -1


@healthy
def causal_lm_prompt_masked_labels(_, record):
    """A causal LM trained with labels = input_ids (shifted once, inside the model) and the prompt's first three
    tokens masked with -100, so only the completion is scored."""
    import cases_heldout8 as c8
    LOSSES.pop("causal_lm_prompt_masked_labels", None)
    model = c8.TinyCausalLM()
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    record(model, opt)
    for _ in range(STEPS):
        ids = c8.lm_sequences()
        labels = ids.clone()
        labels[:, :3] = -100
        opt.zero_grad()
        loss = model(ids, labels)
        loss.backward()
        opt.step()
        _log("causal_lm_prompt_masked_labels", loss)
    return -1


@healthy
def ddpg_actor_through_frozen_critic(_, record):
    """A deterministic policy gradient: the actor maximises Q(s, actor(s)); the critic's gradients from the actor
    loss are discarded by its own zero_grad() before its next update; four critic steps (on noisy actions) per actor
    step."""
    import cases_heldout8 as c8
    LOSSES.pop("ddpg_actor_through_frozen_critic", None)
    actor = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2), nn.Tanh())
    critic = nn.Sequential(nn.Linear(6, 64), nn.ReLU(), nn.Linear(64, 1))
    opt_a, opt_c = torch.optim.Adam(actor.parameters(), lr=3e-3), torch.optim.Adam(critic.parameters(), lr=1e-2)
    record(actor, opt_a)
    for _ in range(STEPS):
        s, _ = c8.bandit_states()
        for _ in range(4):  # delayed policy updates: four critic steps per actor step
            with torch.no_grad():
                a = (actor(s) + 0.5 * torch.randn(len(s), 2)).clamp(-1, 1)
            opt_c.zero_grad()
            F.mse_loss(critic(torch.cat([s, a], 1)), c8.bandit_reward(s, a)).backward()
            opt_c.step()
        opt_a.zero_grad()
        (-critic(torch.cat([s, actor(s)], 1)).mean()).backward()
        opt_a.step()
        with torch.no_grad():
            _log("ddpg_actor_through_frozen_critic", -float(c8.bandit_reward(s, actor(s)).mean()))
    return -1

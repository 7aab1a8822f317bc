"""Checks that the sixth held-out set's cases hold their bugs, without the recorder:

    python benchmarks/silent_errors/check_heldout6.py

Every case (cases_heldout6.py) runs in both forms, and every healthy loop (healthy_heldout6.py)
once, with the stand-in recorder of stub_check.py, which keeps references to the model and
optimizers and each step's largest gradient entry, whether it is finite and the lrs; it records
nothing and checks nothing of gradrepro's. A few checks run a case once more under ``Trace``, a
stand-in that also copies the weights before each forward pass of the model and after each step of
the recorded optimizer. Per case, a line says whether the buggy form shows its bug and the fixed
form does not, with the numbers; a healthy loop must run, stay finite and train. Exit status 1 if
any check fails."""

import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cases_heldout6 as c6  # noqa: E402
import healthy_heldout6 as h6  # noqa: E402
from cases_heldout6 import CASES  # noqa: E402
from harness import batch, mlp  # noqa: E402
from healthy_heldout6 import HEALTHY  # noqa: E402
from stub_check import CHECKS, Stub, check_all, check_of, dist, moved, trained_on_held_aside  # noqa: E402


class Trace(Stub):
    """The stand-in recorder, plus copies of the weights before every forward pass of the recorded model
    (``before_forward``) and after every step of the recorded optimizer (``after_step``)."""

    def __init__(self):
        super().__init__()
        self.before_forward, self.after_step = [], []

    def __call__(self, model, optimizer, **options):
        super().__call__(model, optimizer, **options)

        def snap():
            return [p.detach().clone() for p in model.parameters()]
        model.register_forward_pre_hook(lambda m, a: self.before_forward.append(snap()))
        optimizer.register_step_post_hook(lambda o, a, k: self.after_step.append(snap()))


def traced(fn, buggy):
    torch.manual_seed(0)
    trace = Trace()
    fn(buggy, trace)
    return trace


def _changed_after_step(trace):
    """Forward passes whose weights differ from those the previous step left."""
    count, pairs = 0, zip(trace.after_step, trace.before_forward[1:])
    for after, before in pairs:
        count += any(not torch.equal(a, b) for a, b in zip(after, before))
    return count


def _eval_loss(model, make, loss_fn=F.cross_entropy, seed=123):
    torch.manual_seed(seed)
    x, y = make()
    was = model.training
    model.eval()
    with torch.no_grad():
        out = float(loss_fn(model(x), y))
    model.train(was)
    return out


# -- optimizers and the step ----------------------------------------------------------------------------
@check_of("encoder_stepped_by_two_optimizers")
def _two_optimizers(b, f):
    tb, tf = traced(c6.encoder_stepped_by_two_optimizers, True), traced(c6.encoder_stepped_by_two_optimizers, False)
    nb, nf = _changed_after_step(tb), _changed_after_step(tf)

    def first_change(t, k):  # largest change of parameter k over iteration 0
        return float((t.before_forward[1][k] - t.before_forward[0][k]).abs().max())
    eb, ef, hb = first_change(tb, 0), first_change(tf, 0), first_change(tb, 2)
    return nb == len(tb.after_step) - 1 and nf == 0 and abs(eb / ef - 2) < 0.01 and abs(hb / ef - 1) < 0.01, \
        f"forward passes whose weights changed after the recorded step: buggy {nb}, fixed {nf}; encoder's first " \
        f"update (Adam, lr 5e-3): buggy {eb:.4g}, fixed {ef:.4g} (head, buggy {hb:.4g})"


@check_of("nan_step_skipped_without_zero_grad")
def _nan_skip(b, f):
    nb, nf = len(b[0].steps), len(f[0].steps)
    gb = all(p.grad is not None and not bool(torch.isfinite(p.grad).all()) for p in b[0].model.parameters())
    gf = all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in f[0].model.parameters())
    return nb == c6._BAD_STEP and nf == 39 and gb and gf, \
        f"optimizer steps taken of 40: buggy {nb}, fixed {nf} (one skipped); every .grad NaN at the end: buggy " \
        f"{gb}, fixed finite {gf}"


@check_of("custom_optimizer_decays_gradless")
def _gradless_decay(b, f):
    rb, rf = b[0].model.features.weight.requires_grad, f[0].model.features.weight.requires_grad
    mb, mf = moved(b[0], "features.weight"), moved(f[0], "features.weight")
    nb = float(b[0].model.features.weight.norm() / b[0].init["features.weight"].norm())
    hb, hf = moved(b[0], "head.weight"), moved(f[0], "head.weight")
    return not rb and not rf and mb > 0 and mf == 0 and hb > 0 and hf > 0, \
        f"frozen features (requires_grad {rb}) moved: buggy {mb:.3g} (norm x{nb:.3f} = 0.995^40), fixed {mf:.3g}; " \
        f"head moved {hb:.3g} / {hf:.3g}"


@check_of("gem_pooling_without_clamp")
def _gem(b, f):
    fb, ff = [s["finite"] for s in b[0].steps], [s["finite"] for s in f[0].steps]
    pool = c6.GeM(None)  # one blank frame: the pooled value is finite, its gradient is not
    x = torch.zeros(1, 1, 2, 2, requires_grad=True)
    y = pool(torch.relu(x - 1.0))
    y.sum().backward()
    return not fb[0] and all(ff) and bool(torch.isfinite(y).all()) and not bool(torch.isfinite(pool.p.grad)), \
        f"finite gradients at step 0: buggy {fb[0]}, fixed {ff[0]} (fixed all 40 {all(ff)}); an all-zero map pools " \
        f"to {float(y.detach()):.3g} with d/dp = {float(pool.p.grad)}"


def _adam_updates(count_steps, steps=5):
    """A tensor stepped by HandAdamW (as the case sets it) and by torch.optim.AdamW on the same gradients."""
    c6.HandAdamW.count_steps = count_steps
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(20, generator=gen) for _ in range(steps)]
    p, q = torch.zeros(20, requires_grad=True), torch.zeros(20, requires_grad=True)
    hand, ref = c6.HandAdamW([p], lr=1e-2, weight_decay=0.01), torch.optim.AdamW([q], lr=1e-2, weight_decay=0.01)
    worst = 0.0
    for g in grads:
        p.grad, q.grad = g.clone(), g.clone()
        hand.step()
        ref.step()
        worst = max(worst, float((p - q).detach().abs().max()))
    return worst, float(hand.state[p]["step"])


@check_of("adamw_step_counter_not_incremented")
def _adam_step(b, f):
    sb = float(b[0].opts[0].state[b[0].model[0].weight]["step"])
    sf = float(f[0].opts[0].state[f[0].model[0].weight]["step"])
    (wb, _), (wf, _) = _adam_updates(False), _adam_updates(True)
    return sb == 0 and sf == 40 and wb > 1e-3 and wf < 1e-7, \
        f"step counter after 40 steps: buggy {sb:.0f}, fixed {sf:.0f}; largest gap to torch.optim.AdamW over 5 " \
        f"steps on the same gradients: buggy {wb:.3g}, fixed {wf:.3g}"


@check_of("loss_requires_grad_forced")
def _forced(b, f):
    db, df = dist(b[0]), dist(f[0])
    nb = all(p.grad is None for p in b[0].model.parameters())
    x, y = batch()
    loss = c6.balanced_ce(True)(b[0].model(x), y)
    return db == 0 and nb and df > 0 and loss.grad_fn is None, \
        f"distance moved: buggy {db:.3g} (every .grad None {nb}), fixed {df:.3g}; the buggy loss has grad_fn " \
        f"{loss.grad_fn} and requires_grad {loss.requires_grad}"


@check_of("local_losses_wiped_by_zero_grad")
def _local(b, f):
    s1b, s1f = moved(b[0], "stage1.0.weight"), moved(f[0], "stage1.0.weight")
    a1b, a1f = moved(b[0], "aux1.weight"), moved(f[0], "aux1.weight")
    s2b, s2f = moved(b[0], "stage2.0.weight"), moved(f[0], "stage2.0.weight")
    return s1b == 0 and a1b == 0 and s1f > 0 and a1f > 0 and s2b > 0 and s2f > 0, \
        f"stage 1 moved: buggy {s1b:.3g} (its aux head {a1b:.3g}), fixed {s1f:.3g} ({a1f:.3g}); stage 2 moved " \
        f"{s2b:.3g} / {s2f:.3g}"


# -- sequences and attention ----------------------------------------------------------------------------
def _walks(n=256):
    torch.manual_seed(5)
    inp, tgt = c6._token_walks(n)
    return torch.cat([inp, tgt[:, -1:]], 1)


@check_of("decoder_without_causal_mask")
def _causal(b, f):
    seq = _walks()

    def leak(e):  # change token 4: how much do the outputs at positions 0..3 move?
        seq2 = seq.clone()
        seq2[:, 4] = (seq2[:, 4] + 5) % c6._VOCAB
        with torch.no_grad():
            return float((e.model(seq)[:, :4] - e.model(seq2)[:, :4]).abs().max())

    def teacher_forced(e):
        with torch.no_grad():
            return float(c6._lm_loss(e.model(seq)[:, :-1], seq[:, 1:]))

    def prefix_only(e):  # each next token predicted from its prefix alone, as in decoding
        with torch.no_grad():
            losses = [F.cross_entropy(e.model(seq[:, : t + 1])[:, -1], seq[:, t + 1]) for t in range(c6._LEN - 1)]
        return float(sum(losses) / len(losses))
    kb, kf = leak(b[0]), leak(f[0])
    tb, tf, pb, pf = teacher_forced(b[0]), teacher_forced(f[0]), prefix_only(b[0]), prefix_only(f[0])
    return kb > 1e-3 and kf == 0 and tb < tf and pb > pf + 0.1, \
        f"outputs at positions 0-3 moved by changing token 4: buggy {kb:.3g}, fixed {kf:.3g}; teacher-forced loss " \
        f"{tb:.3f} / {tf:.3f} (ln 3 = 1.099 without peeking), from the prefix alone {pb:.3f} / {pf:.3f}"


@check_of("bilstm_last_step_readout")
def _bilstm(b, f):
    torch.manual_seed(6)
    x, _ = c6._first_token_task(256)
    x2 = x.clone()
    x2[:, 0] += 3.0

    def backward_half_moves(e):
        with torch.no_grad():
            return float((e.model.features(x)[:, 16:] - e.model.features(x2)[:, 16:]).abs().max())
    kb, kf = backward_half_moves(b[0]), backward_half_moves(f[0])
    lb = _eval_loss(b[0].model, lambda: c6._first_token_task(512))
    lf = _eval_loss(f[0].model, lambda: c6._first_token_task(512))
    return kb == 0 and kf > 1e-3 and lb > lf + 0.1, \
        f"backward-direction features moved by changing the first step: buggy {kb:.3g}, fixed {kf:.3g}; " \
        f"held-aside loss {lb:.3f} / {lf:.3f}"


@check_of("log_softmax_over_batch_axis")
def _log_softmax(b, f):
    x, _ = batch(64)
    with torch.no_grad():
        rb, rf = (float((e.model(x).exp().sum(1) - 1).abs().max()) for e in (b[0], f[0]))
    lb = _eval_loss(b[0].model.net, lambda: batch(512))
    lf = _eval_loss(f[0].model.net, lambda: batch(512))
    return rb > 0.5 and rf < 1e-5 and lb > lf + 0.1, \
        f"largest |sum over classes of exp(output) - 1|: buggy {rb:.3g}, fixed {rf:.3g}; held-aside cross-entropy " \
        f"of the logits {lb:.3f} / {lf:.3f}"


# -- data pipelines ----------------------------------------------------------------------------------------
@check_of("loader_workers_share_numpy_seed")
def _workers(b, f):
    def distinct(batches):
        return len({(tuple(x.flatten()[:8].tolist())) for x, _ in batches})
    bb, bf = c6.worker_batches(True), c6.worker_batches(False)
    db, df = distinct(bb), distinct(bf)
    same = all(torch.equal(bb[0][0], bb[k][0]) for k in range(1, 4))
    return db == len(bb) // 4 and df == len(bf) and same, \
        f"distinct batches of 40: buggy {db}, fixed {df}; buggy batches 0-3 identical {same}"


@check_of("weighted_sampler_class_weights")
def _sampler(b, f):
    ib, i_f = c6.sampler_indices(True), c6.sampler_indices(False)
    nb, nf = len(set(ib.flatten().tolist())), len(set(i_f.flatten().tolist()))
    _, y = c6.imbalanced_set()
    share = torch.bincount(y[i_f.flatten()], minlength=3).float() / i_f.numel()
    lb, lf = _eval_loss(b[0].model, lambda: batch(512)), _eval_loss(f[0].model, lambda: batch(512))
    return nb <= 3 and int(ib.max()) <= 2 and nf > 200 and lb > lf + 0.1, \
        f"distinct samples drawn: buggy {nb} (indices {sorted(set(ib.flatten().tolist()))}), fixed {nf} (class " \
        f"shares {[round(float(s), 2) for s in share]}); held-aside loss {lb:.3f} / {lf:.3f}"


# -- reinforcement learning, checkpoints, averaging -------------------------------------------------------
@check_of("critic_trained_by_policy_loss")
def _advantage(b, f):
    def critic_grad(e, buggy):
        torch.manual_seed(7)
        s, best = c6.bandit(256)
        policy, _ = c6.a2c_losses(e.model, s, best, buggy)
        grads = torch.autograd.grad(policy, list(e.model.critic.parameters()), allow_unused=True)
        return max(0.0 if g is None else float(g.abs().max()) for g in grads)
    gb, gf = critic_grad(b[0], True), critic_grad(f[0], False)

    def value_error(e):  # the critic against the true expected reward, pi(best arm | s)
        torch.manual_seed(8)
        s, best = c6.bandit(1024)
        with torch.no_grad():
            logits, v = e.model(s)
            return float((v - F.softmax(logits, 1).gather(1, best[:, None]).squeeze(1)).abs().mean())
    vb, vf = value_error(b[0]), value_error(f[0])
    return gb > 1e-4 and gf == 0 and vb > vf, \
        f"largest gradient of the policy loss on the critic: buggy {gb:.3g}, fixed {gf:.3g}; critic's mean error " \
        f"against the expected reward {vb:.3f} / {vf:.3f}"


@check_of("best_checkpoint_aliased")
def _best(b, f):
    bb, bf = c6.SIDE["best_state_aliased", True], c6.SIDE["best_state_aliased", False]
    vb, vf = c6.val_loss(b[0].model), c6.val_loss(f[0].model)
    return vb > bb + 0.05 and vf == bf, \
        f"validation loss of the restored model: buggy {vb:.3f} against the best seen {bb:.3f}; fixed {vf:.3f} " \
        f"against {bf:.3f}"


@check_of("ema_without_batchnorm_buffers")
def _ema(b, f):
    eb, ef = c6.SIDE["ema_skips_buffers", True], c6.SIDE["ema_skips_buffers", False]
    mb, mf = float(eb.ema[1].running_mean.abs().max()), float((ef.ema[1].running_mean -
                                                                f[0].model[1].running_mean).abs().max())
    lb, lf = _eval_loss(eb.ema, lambda: c6.shifted_batch(512)), _eval_loss(ef.ema, lambda: c6.shifted_batch(512))
    lm = _eval_loss(f[0].model, lambda: c6.shifted_batch(512))
    return mb == 0 and mf == 0 and float(f[0].model[1].running_mean.abs().max()) > 0.1 and lb > lf + 0.3, \
        f"EMA BatchNorm running mean: buggy largest |entry| {mb:.3g} (never set), fixed equal to the model's " \
        f"{mf == 0}; held-aside loss of the EMA model {lb:.3f} / {lf:.3f} (training model {lm:.3f})"


@check_of("pad_targets_in_loss")
def _pad(b, f):
    torch.manual_seed(9)
    x, t = c6.padded_walks(512)
    real = t != c6._PAD

    def stats(e):
        with torch.no_grad():
            logits = e.model(x)[real]
        return float(F.cross_entropy(logits, t[real])), float(F.softmax(logits, 1)[:, c6._PAD].mean())
    (lb, pb), (lf, pf) = stats(b[0]), stats(f[0])
    return lb > lf + 0.1 and pb > 0.05 and pf < pb / 5, \
        f"cross-entropy on real-token targets: buggy {lb:.3f}, fixed {lf:.3f}; mean probability of [PAD] where a " \
        f"real token follows {pb:.3f} / {pf:.3f} (padded share of targets {float((~real).float().mean()):.2f})"


# -- healthy loops -------------------------------------------------------------------------------------------
CLASSIFIERS = {"albert_cross_layer_sharing", "lion_optimizer_subclass", "progressive_growing_fade_in",
               "simulated_allreduce_two_replicas", "r_drop_two_passes", "ema_swapped_in_and_restored",
               "zero_gamma_residual_init", "adagrad_lr_decay"}


def _before_after(e, start, make, loss_fn=F.cross_entropy):
    return _eval_loss(start, make, loss_fn), _eval_loss(e.model, make, loss_fn)


def trained(name, entries):
    e = entries[0]
    if name == "magnitude_pruning_midway":  # a pruned module cannot be deep-copied: rebuild the first weights
        start = mlp()
        with torch.no_grad():
            for n, p in start.named_parameters():
                p.copy_(e.init[n.replace("0.weight", "0.weight_orig")])
        before, after = _before_after(e, start, lambda: batch(512))
        kept = float((e.model[0].weight_mask == 1).float().mean())
        return after < before and kept == 0.5, f" held-aside loss {before:.3f} -> {after:.3f}, kept {kept:.2f}"
    if name == "embedding_padding_idx":
        start = copy.deepcopy(e.model)
        with torch.no_grad():
            for n, p in start.named_parameters():
                p.copy_(e.init[n])
        before, after = _before_after(e, start, lambda: h6._bags(512))
        pad_row = float(e.model.emb.weight[h6._PAD].detach().abs().max())
        return after < before and pad_row == 0, f" held-aside loss {before:.3f} -> {after:.3f}, pad row {pad_row}"
    if name == "discriminator_paused_when_ahead":
        n = len(e.steps)
        return 0 < n < 40, f" discriminator steps {n} of 40"
    return trained_on_held_aside(dict.fromkeys(CLASSIFIERS))(name, entries)


def main():
    return check_all(CASES, HEALTHY, CHECKS, trained)


if __name__ == "__main__":
    sys.exit(main())

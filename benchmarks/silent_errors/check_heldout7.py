"""Checks that the seventh held-out set's cases hold their bugs, without the recorder:

    python benchmarks/silent_errors/check_heldout7.py

Every case (cases_heldout7.py) runs in both forms, and every healthy loop (healthy_heldout7.py)
once, with the stand-in recorder of stub_check.py, which keeps references to the model and
optimizers and each step's largest gradient entry, whether it is finite and the lrs; it records
nothing and checks nothing of gradrepro's. A few checks run a case once more under ``Trace``, a
stand-in that also copies the weights (and the dropout modules' mode) before each forward pass of
the model. Per case, a line says whether the buggy form shows its bug and the fixed form does not,
with the numbers; a healthy loop must run, stay finite and train. Exit status 1 if any check
fails."""

import copy
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cases_heldout7 as c7  # noqa: E402
import healthy_heldout7 as h7  # noqa: E402
from cases_heldout7 import CASES  # noqa: E402
from harness import batch, images  # noqa: E402
from healthy_heldout7 import HEALTHY  # noqa: E402
from stub_check import CHECKS, Stub, check_all, check_of, moved, trained_on_held_aside  # noqa: E402

warnings.filterwarnings("ignore")  # reentrant checkpoint's "None of the inputs ...", eager quantisation deprecations


class Trace(Stub):
    """The stand-in recorder, plus, before every forward pass of the recorded model, a copy of its weights
    (``before_forward``) and whether grad was enabled and any dropout module was in train mode (``modes``)."""

    def __init__(self):
        super().__init__()
        self.before_forward, self.modes = [], []

    def __call__(self, model, optimizer, **options):
        super().__call__(model, optimizer, **options)
        dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]

        def pre(m, a):
            self.before_forward.append([p.detach().clone() for p in model.parameters()])
            self.modes.append((torch.is_grad_enabled(), any(d.training for d in dropouts)))
        model.register_forward_pre_hook(pre)


def traced(fn, buggy):
    torch.manual_seed(0)
    trace = Trace()
    fn(buggy, trace)
    return trace


def start_model(e):
    """The recorded model as it was when recorded (a deep copy given the first weights)."""
    start = copy.deepcopy(e.model)
    with torch.no_grad():
        for n, p in start.named_parameters():
            p.copy_(e.init[n])
    return start


def eval_loss(model, make, loss_fn=F.cross_entropy, seed=123):
    torch.manual_seed(seed)
    x, y = make()
    was = model.training
    model.eval()
    with torch.no_grad():
        out = float(loss_fn(model(x), y))
    model.train(was)
    return out


def cosine(a, b):
    return float(F.cosine_similarity(a.flatten(), b.flatten(), dim=0))


def first_nonfinite(e):
    return next((i for i, s in enumerate(e.steps) if not s["finite"]), -1)


# -- freezing, checkpointing, teachers ------------------------------------------------------------------
@check_of("reentrant_checkpoint_on_frozen_embeddings")
def _reentrant(b, f):
    mb = max(moved(b[0], n) for n, _ in b[0].model.blocks.named_parameters(prefix="blocks"))
    mf = max(moved(f[0], n) for n, _ in f[0].model.blocks.named_parameters(prefix="blocks"))
    nb = all(p.grad is None for p in b[0].model.blocks.parameters())
    hb, hf = moved(b[0], "head.weight"), moved(f[0], "head.weight")
    return mb == 0 and nb and mf > 0 and hb > 0 and hf > 0, \
        f"checkpointed blocks moved: buggy {mb:.3g} (every .grad None {nb}), fixed {mf:.3g}; head moved " \
        f"{hb:.3g} / {hf:.3g}"


@check_of("self_distillation_teacher_eval")
def _shared_teacher(b, f):
    tb, tf = traced(c7.self_distillation_teacher_eval, True), traced(c7.self_distillation_teacher_eval, False)

    def dropout_off(t):  # training forward passes (grad enabled) with every dropout module in eval mode
        grad_passes = [on for grad, on in t.modes if grad]
        return sum(not on for on in grad_passes), len(grad_passes)
    (ob, nb), (of, nf) = dropout_off(tb), dropout_off(tf)
    return ob == nb == 40 and of == 0 and nf == 40, \
        f"student forward passes with dropout off: buggy {ob} of {nb}, fixed {of} of {nf}"


# -- attention and metric losses -------------------------------------------------------------------------
@check_of("local_attention_fully_masked_rows")
def _masked_rows(b, f):
    torch.manual_seed(1)
    _, _, pad = c7.padded_tokens()
    empty = int((pad[:, 1:] & pad[:, :-1]).sum())  # padded queries whose two window keys are both padded
    sb, sf = first_nonfinite(b[0]), first_nonfinite(f[0])
    nan_w = not all(bool(torch.isfinite(p).all()) for p in b[0].model.parameters())
    return sb == 0 and sf == -1 and nan_w and empty > 0, \
        f"first step with a non-finite gradient: buggy {sb}, fixed {sf} (none); buggy weights non-finite at the " \
        f"end {nan_w}; fully masked query rows in a batch of 16: {empty}"


@check_of("arc_margin_identical_views")
def _arc_margin(b, f):
    torch.manual_seed(2)
    model = c7.EmbedClassifier()
    x1, x2, _ = c7.two_views()
    with torch.no_grad():
        cos = F.cosine_similarity(model.body(x1), model.body(x2))
    ones, above = int((cos == 1).sum()), int((cos > 1).sum())
    sb, sf = first_nonfinite(b[0]), first_nonfinite(f[0])
    return sb == 0 and sf == -1 and ones + above > 0, \
        f"first step with a non-finite gradient: buggy {sb}, fixed {sf} (none); pairs of a batch of 32 whose cosine " \
        f"is exactly 1.0: {ones}, above 1.0 by rounding: {above}"


# -- optimizers and their parameters ------------------------------------------------------------------------
@check_of("uncertainty_weights_left_out")
def _loss_params(b, f):
    sb = max(moved(b[0], "loss.s_det"), moved(b[0], "loss.s_id"))
    sf = max(moved(f[0], "loss.s_det"), moved(f[0], "loss.s_id"))
    gb = b[0].model.loss.s_det.grad
    held = {id(p) for g in b[0].opts[0].param_groups for p in g["params"]}
    inb = id(b[0].model.loss.s_det) in held
    return sb == 0 and gb is not None and float(gb.abs()) > 0 and not inb and sf > 0.05, \
        f"uncertainty weights moved: buggy {sb:.3g} (gradient {float(gb):.3g}, in the optimizer {inb}), fixed {sf:.3g}"


@check_of("estimator_with_optimizer_instance")
def _optimizer_instance(b, f):
    db, df = max(moved(b[0], n) for n in b[0].init), max(moved(f[0], n) for n in f[0].init)

    def holds_network(e):
        held = {id(p) for g in e.opts[0].param_groups for p in g["params"]}
        return all(id(p) in held for p in e.model.parameters())
    gb = max(float(p.grad.abs().max()) for p in b[0].model.parameters())
    before, after = eval_loss(start_model(b[0]), lambda: batch(512)), eval_loss(b[0].model, lambda: batch(512))
    lf = eval_loss(f[0].model, lambda: batch(512))
    return db == 0 and gb > 0 and not holds_network(b[0]) and holds_network(f[0]) and df > 0 and lf < before, \
        f"network moved: buggy {db:.3g} (largest gradient {gb:.3g}; optimizer holds the network " \
        f"{holds_network(b[0])}), fixed {df:.3g} ({holds_network(f[0])}); held-aside loss {before:.3f} -> buggy " \
        f"{after:.3f}, fixed {lf:.3f}"


# -- quantisation, pruning -----------------------------------------------------------------------------------
@check_of("qat_rounds_master_weights")
def _qat(b, f):
    tb, tf = traced(c7.qat_rounds_master_weights, True), traced(c7.qat_rounds_master_weights, False)

    def weight_change(t, e):  # weights (not biases) from the second forward pass (after step 0) to the end
        final = [p.detach() for p in e.model.parameters()]
        return max(float((final[k] - t.before_forward[1][k]).abs().max()) for k in (0, 2))
    cb, cf = weight_change(tb, b[0]), weight_change(tf, f[0])
    on_grid = all(bool(((p / c7._QSTEP) == (p / c7._QSTEP).round()).all()) for p in (b[0].model[0].weight,
                                                                                     b[0].model[2].weight))
    lb, lf = eval_loss(b[0].model, lambda: batch(512)), eval_loss(f[0].model, lambda: batch(512))
    return cb == 0 and on_grid and cf > c7._QSTEP and lf < lb, \
        f"weights' largest change after step 0: buggy {cb:.3g} (every weight on the 1/16 grid {on_grid}), fixed " \
        f"(full-precision latent weights) {cf:.3g}; held-aside loss {lb:.3f} / {lf:.3f}"


@check_of("pruned_weights_regrow")
def _pruning(b, f):
    def regrown(e, buggy):
        mask = c7.SIDE["pruning_mask_applied_once", buggy]
        w = e.model[0].weight.detach()
        return float((w[mask == 0] != 0).float().mean()), float((w == 0).float().mean())
    (rb, sb), (rf, sf) = regrown(b[0], True), regrown(f[0], False)
    return rb > 0.9 and rf == 0 and sf >= 0.5, \
        f"pruned entries no longer zero after fine-tuning: buggy {rb:.2f}, fixed {rf:.2f}; sparsity of the layer " \
        f"{sb:.2f} / {sf:.2f}"


# -- accumulation, data and labels ------------------------------------------------------------------------------
@check_of("accumulation_token_means")
def _token_means(b, f):
    torch.manual_seed(3)
    model, window = c7.TokenModel(), c7.bucketed_microbatches()
    tokens = sum(y.numel() for _, y in window)

    def accumulated(buggy):
        model.zero_grad()
        for x, y in window:
            c7.microbatch_loss(model, x, y, buggy, tokens).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    xs = torch.cat([x.flatten() for x, _ in window])
    ys = torch.cat([y.flatten() for _, y in window])
    F.cross_entropy(model(xs), ys).backward()
    full = torch.cat([p.grad.flatten() for p in model.parameters()])
    eb, ef = (float((accumulated(bb) - full).norm() / full.norm()) for bb in (True, False))

    def share_a(e):  # mean probability of the short micro-batches' rule A target, tokens 1..11
        x = torch.arange(1, c7._LM_VOCAB)
        with torch.no_grad():
            p = F.softmax(e.model(x), 1)
        return float(p.gather(1, c7.rule_a(x)[:, None]).mean())
    ab, af = share_a(b[0]), share_a(f[0])
    return eb > 0.1 and ef < 1e-5 and ab > af + 0.1, \
        f"relative gap of the accumulated gradient to the window's token-mean gradient: buggy {eb:.3f}, fixed " \
        f"{ef:.1e}; probability of the short micro-batch's rule (weight {8 / tokens:.3f} of the tokens): buggy " \
        f"{ab:.3f}, fixed {af:.3f}"


@check_of("segmentation_flips_unsynced")
def _flips(b, f):
    def misaligned(buggy):
        torch.manual_seed(4)
        _, m, m_true = c7.augmented_scenes(buggy, n=256)
        return float((m != m_true).flatten(1).any(1).float().mean())
    wb, wf = misaligned(True), misaligned(False)

    def iou(e):
        torch.manual_seed(5)
        x, _, m = c7.augmented_scenes(False, n=256)
        with torch.no_grad():
            pred = e.model(x) > 0
        return float((pred & (m > 0)).sum() / (pred | (m > 0)).sum())
    ib, i_f = iou(b[0]), iou(f[0])
    return wb > 0.5 and wf == 0 and i_f > ib + 0.1, \
        f"training pairs whose mask does not match its image: buggy {wb:.2f}, fixed {wf:.2f}; held-aside IoU " \
        f"{ib:.3f} / {i_f:.3f}"


def _q_star():
    """Q*(s, a) of the chain by value iteration."""
    v = torch.zeros(c7._CHAIN + 1)
    for _ in range(50):
        q = torch.zeros(c7._CHAIN, 2)
        for s in range(c7._CHAIN):
            for a, s2 in ((0, max(s - 1, 0)), (1, s + 1)):
                q[s, a] = 1.0 if s2 == c7._CHAIN else c7._GAMMA * v[s2]
        v[: c7._CHAIN] = q.max(1).values
    return q


@check_of("dqn_without_done_mask")
def _done_mask(b, f):
    s, a, r, s2, done = c7.chain_transitions()

    def stats(e, buggy):
        target = c7.td_targets(e.model, r, s2, done, buggy)
        with torch.no_grad():
            q = e.model(F.one_hot(torch.arange(c7._CHAIN), c7._CHAIN + 1).float())
        return float(target[done == 1]), float((q - _q_star()).abs().mean())
    (tb, qb), (tf, qf) = stats(b[0], True), stats(f[0], False)
    return abs(tb - 1) > 0.1 and tf == 1.0 and qb > qf, \
        f"target of the transition into the goal (true value 1): buggy {tb:.3f}, fixed {tf:.3f}; mean |Q - Q*|: " \
        f"{qb:.3f} / {qf:.3f}"


# -- checkpoints, custom autograd, recurrent nets ------------------------------------------------------------------
@check_of("resume_reinitialises_weights")
def _reinit(b, f):
    def gap(e, buggy):
        ckpt = c7.SIDE["init_after_checkpoint_load", buggy]
        return max(float((e.init[n] - ckpt[n]).abs().max()) for n in ckpt)
    gb, gf = gap(b[0], True), gap(f[0], False)
    sb, eb = eval_loss(start_model(b[0]), lambda: batch(512)), eval_loss(b[0].model, lambda: batch(512))
    sf, ef = eval_loss(start_model(f[0]), lambda: batch(512)), eval_loss(f[0].model, lambda: batch(512))
    return gb > 0.1 and gf == 0 and sb > sf + 0.3 and eb > ef + 0.1, \
        f"weights at the start of fine-tuning against the checkpoint: buggy largest gap {gb:.3g}, fixed {gf:.3g}; " \
        f"held-aside loss at the start {sb:.3f} / {sf:.3f}, at the end {eb:.3f} / {ef:.3f}"


@check_of("custom_add_backward_fills_ones")
def _custom_add(b, f):
    def stem_cosine(e, fill):
        torch.manual_seed(6)
        x, y = batch(256)
        c7.ResidualAdd.fill_ones = fill
        model = e.model
        used = torch.autograd.grad(F.cross_entropy(model(x), y), [model.stem.weight])[0]
        true = torch.autograd.grad(F.cross_entropy(model(x, custom=False), y), [model.stem.weight])[0]
        return cosine(used, true)
    cb, cf = stem_cosine(b[0], True), stem_cosine(f[0], False)
    c7.ResidualAdd.fill_ones = False
    lb, lf = eval_loss(b[0].model, lambda: batch(512)), eval_loss(f[0].model, lambda: batch(512))
    return cb < 0.5 and abs(cf - 1) < 1e-5 and lb > lf + 0.1, \
        f"cosine of the stem's gradient with the true gradient: buggy {cb:.3f}, fixed {cf:.3f}; held-aside loss " \
        f"{lb:.3f} / {lf:.3f}"


@check_of("packed_batch_left_sorted")
def _packed(b, f):
    torch.manual_seed(7)
    (x, lengths), y = c7.variable_length_batch(64)

    def misplaced(e):  # batch outputs that are not the output of the sample at their position
        with torch.no_grad():
            together = e.model((x, lengths))
            alone = torch.cat([e.model((x[i:i + 1], lengths[i:i + 1])) for i in range(len(x))])
        return float(((together - alone).abs().max(1).values > 1e-4).float().mean())
    mb, mf = misplaced(b[0]), misplaced(f[0])
    order = lengths.argsort(descending=True)
    wrong = float((y[order] != y).float().mean())  # labels the sorted outputs are scored against that are not theirs

    def loss(e):
        return eval_loss(e.model, lambda: c7.variable_length_batch(512))
    lb, lf = loss(b[0]), loss(f[0])
    return mb > 0.5 and mf == 0 and wrong > 0.4 and lb > lf + 0.1, \
        f"outputs not at their sample's position: buggy {mb:.2f}, fixed {mf:.2f} (buggy: scored against a different " \
        f"label {wrong:.2f}); held-aside loss {lb:.3f} / {lf:.3f} (ln 3 = 1.099)"


@check_of("loss_scale_divided_twice")
def _unscale_twice(b, f):
    gb, gf = b[0].steps[0]["gmax"], f[0].steps[0]["gmax"]  # step 0: same weights, same batch
    db, df = max(moved(b[0], n) for n in b[0].init), max(moved(f[0], n) for n in f[0].init)
    lb, lf = eval_loss(b[0].model, lambda: batch(512)), eval_loss(f[0].model, lambda: batch(512))
    before = eval_loss(start_model(b[0]), lambda: batch(512))
    return abs(gf / gb / 2 ** 16 - 1) < 1e-3 and db < df / 50 and lf < before - 0.3 and lb > before - 0.05, \
        f"largest gradient entry the inner optimizer stepped with at step 0: buggy {gb:.3g}, fixed {gf:.3g} " \
        f"(ratio {gf / gb:.3g}, scale 65536); weights moved {db:.3g} / {df:.3g}; held-aside loss {before:.3f} -> " \
        f"{lb:.3f} / {lf:.3f}"


# -- averaging, schedules, GANs ----------------------------------------------------------------------------------------
@check_of("ema_decay_attribute_overwritten")
def _ema(b, f):
    eb, ef = c7.SIDE["ema_decay_overwritten", True], c7.SIDE["ema_decay_overwritten", False]
    wb, wf = eb.one_minus[-1], ef.one_minus[-1]

    def gap(ema, e):
        return max(float((s - p.detach()).abs().max()) for s, p in zip(ema.shadow, e.model.parameters()))
    gb, gf = gap(eb, b[0]), gap(ef, f[0])
    return wb == 0.5 and abs(wf - 9 / 50) < 1e-12 and gf > 2 * gb, \
        f"weight of the newest weights in the EMA at step 40: buggy {wb:.3f} (stuck since step " \
        f"{c7.ema_divergence_step()}), fixed {wf:.3f} and falling; EMA's largest gap to the live weights " \
        f"{gb:.3g} / {gf:.3g}"


@check_of("warmup_factor_compounds")
def _warmup(b, f):
    lb, lf = c7.SIDE["warmup_on_chainable_lr", True], c7.SIDE["warmup_on_chainable_lr", False]
    first = next(i for i, (u, v) in enumerate(zip(lb, lf)) if u != v)
    return lf[20] == 0.1 and lb[20] < 1e-3 * lf[20] and first == 1, \
        f"lr at step 20 (end of the warm-up): buggy {lb[20]:.2g}, fixed {lf[20]:.2g}; steps 0-2 buggy " \
        f"{[float(f'{v:.3g}') for v in lb[:3]]}, fixed {[float(f'{v:.3g}') for v in lf[:3]]}; first differing " \
        f"step {first}"


@check_of("gan_discriminator_gets_generator_grads")
def _gan(b, f):
    key = "discriminator_step_includes_generator_loss"
    (ob, ub), (of, uf) = ((c7.SIDE[key, x], c7.SIDE[key, x, "used"]) for x in (True, False))
    extra = float((ub - ob).norm() / ob.norm())
    cb = cosine(ub, ob)
    return extra > 0.1 and torch.equal(uf, of), \
        f"first discriminator step: gradient used vs its own loss's gradient: buggy cosine {cb:.3f} (extra term " \
        f"{extra:.2f} of its norm), fixed identical {torch.equal(uf, of)}"


# -- healthy loops ----------------------------------------------------------------------------------------------------
CLASSIFIERS = {"eager_qat_prepared_before_optimizer", "checkpoint_roundtrip_midrun", "distributed_sampler_rank_shard",
               "optimizer_step_in_backward", "rprop_full_batch"}


def _before_after(e, make, loss_fn=F.cross_entropy):
    return eval_loss(start_model(e), make, loss_fn), eval_loss(e.model, make, loss_fn)


def trained(name, entries):
    e = entries[0]
    if name == "token_budget_accumulation":
        def lm_loss(logits, y):
            return F.cross_entropy(logits.reshape(-1, 12), y.reshape(-1))
        before, after = _before_after(e, lambda: h7._sequences(64, 16), lm_loss)
        return after < before, f" held-aside loss {before:.3f} -> {after:.3f}"
    if name == "uncertainty_weighted_multitask":
        torch.manual_seed(8)
        x, y = batch(512)
        with torch.no_grad():
            total = float(e.model.loss(x, 0.1 * x[:, 3:5], y))
            ce0, ce1 = (float(F.cross_entropy(m(x)[1], y)) for m in (start_model(e), e.model))
        lv = e.model.log_var.detach().tolist()
        return ce1 < ce0 and total < 0, f" class loss {ce0:.3f} -> {ce1:.3f}, log-variances " \
            f"{[round(v, 2) for v in lv]}, total loss {total:.3f}"
    if name == "dqn_hard_target_sync":
        synced = all(torch.equal(p, q) for p, q in zip(e.model.online.parameters(), e.model.target.parameters()))
        s, a, r, s2, done = h7._chain()

        def td(model):
            with torch.no_grad():
                return float(F.smooth_l1_loss(model(s).gather(1, a[:, None]).squeeze(1),
                                              r + 0.9 * model(s2).max(1).values * (1 - done)))
        before, after = td(start_model(e)), td(e.model)
        return synced and after < before, f" TD error {before:.4f} -> {after:.4f}, target synced {synced}"
    if name == "packed_sequences_unsorted":
        before, after = _before_after(e, lambda: h7._var_len(512))
        return after < before, f" held-aside loss {before:.3f} -> {after:.3f}"
    if name == "frozen_batchnorm_buffers":
        before, after = _before_after(e, lambda: images(256))
        bufs = all(torch.equal(b, e.buffers0[n]) for n, b in e.model.named_buffers())
        return after < before and bufs, f" held-aside loss {before:.3f} -> {after:.3f}, buffers unchanged {bufs}"
    if name == "maml_functional_call":
        def adapted_loss(model, seed=9):
            torch.manual_seed(seed)
            total = 0.0
            for _ in range(20):
                xs, ys, xq, yq = h7._task()
                params = dict(model.named_parameters())
                inner = F.mse_loss(torch.func.functional_call(model, params, (xs,)).squeeze(1), ys)
                grads = torch.autograd.grad(inner, list(params.values()))
                adapted = {n: p - 0.05 * g for (n, p), g in zip(params.items(), grads)}
                with torch.no_grad():
                    total += float(F.mse_loss(torch.func.functional_call(model, adapted, (xq,)).squeeze(1), yq))
            return total / 20
        before, after = adapted_loss(start_model(e)), adapted_loss(e.model)
        return after < before, f" query loss after one inner step {before:.3f} -> {after:.3f}"
    if name == "embedding_bag_per_sample_weights":
        before, after = _before_after(e, lambda: h7._weighted_bags(512))
        return after < before, f" held-aside loss {before:.3f} -> {after:.3f}"
    return trained_on_held_aside(dict.fromkeys(CLASSIFIERS))(name, entries)


def main():
    return check_all(CASES, HEALTHY, CHECKS, trained)


if __name__ == "__main__":
    sys.exit(main())

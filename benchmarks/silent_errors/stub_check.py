"""The stand-in recorder the held-out sets' checks run their cases with (``check_heldout2.py``,
``check_heldout3.py``, ``check_heldout4.py``): it keeps references to the model and optimizers and, through a step
pre-hook, each step's largest gradient entry, whether it is finite and the lrs; it records
nothing and checks nothing of gradrepro's. ``check_all`` runs every case in both forms and every
healthy loop once and prints a line each; exit status 1 if any check fails."""

import copy
import time

import torch


class Entry:
    def __init__(self, model, opts, options):
        self.model, self.opts, self.options, self.steps = model, opts, options, []
        self.init = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.buffers0 = {n: b.detach().clone() for n, b in model.named_buffers()}


def _stats(opt):
    gmax, finite = 0.0, True
    for g in opt.param_groups:
        for p in g["params"]:
            if p.grad is None:
                continue
            v = p.grad.coalesce().values() if p.grad.is_sparse else p.grad
            finite &= bool(torch.isfinite(v).all())
            gmax = max(gmax, float(v.abs().max()) if v.numel() else 0.0)
    return {"gmax": gmax, "finite": finite, "lrs": [g["lr"] for g in opt.param_groups]}


class Stub:
    def __init__(self):
        self.entries = []

    def __call__(self, model, optimizer, **options):
        opts = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        e = Entry(model, opts, options)
        for o in opts:
            o.register_step_pre_hook(lambda opt, a, k, e=e: e.steps.append(_stats(opt)))
        self.entries.append(e)
        return None


def run(fn, buggy):
    torch.manual_seed(0)
    stub = Stub()
    t = time.perf_counter()
    out = fn(buggy, stub)
    return out, stub.entries, time.perf_counter() - t


def moved(e, name):
    return float((dict(e.model.named_parameters())[name].detach().float() - e.init[name].float()).abs().max())


def dist(e):
    return sum(float((p.detach() - e.init[n]).pow(2).sum()) for n, p in e.model.named_parameters()) ** 0.5


def finite_params(e):
    return all(bool(torch.isfinite(p).all()) for p in e.model.parameters())


def same_params(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))


CHECKS = {}  # case name -> check(buggy entries, fixed entries) -> (ok, text)


def check_of(name):
    def register(fn):
        CHECKS[name] = fn
        return fn
    return register




def held_aside_loss(e, transform=None) -> tuple:
    """A classifier's cross-entropy on a fixed held-aside batch (512 examples of ``harness.batch``'s
    rule; ``transform``: what the loop does to its inputs) at its first weights and at its last."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(512, 10, generator=gen)
    y = x[:, :3].argmax(1)
    x = transform(x) if transform is not None else x
    start = copy.deepcopy(e.model)
    with torch.no_grad():
        for n, p in start.named_parameters():
            p.copy_(e.init[n])
        start.eval()
        e.model.eval()
        ce = torch.nn.functional.cross_entropy
        return float(ce(start(x), y)), float(ce(e.model(x), y))


def trained_on_held_aside(classifiers: dict):
    """``check_all``'s ``trained``: for the loops named in ``classifiers`` (name -> input transform or
    None), the held-aside loss must fall from the first weights to the last."""
    def trained(name, entries):
        if name not in classifiers:
            return None
        before, after = held_aside_loss(entries[0], classifiers[name])
        return after < before, f" held-aside loss {before:.3f} -> {after:.3f}"
    return trained


def check_all(cases, healthy, checks, trained=None) -> int:
    """Each case's check on its buggy and fixed runs; each healthy loop must run, stay finite and
    move (``trained(name, entries)``: a further (ok, text) for some loops, or None)."""
    torch.set_num_threads(1)
    ok_all = True
    for name, case in cases.items():
        (sb, b, tb), (sf, f, tf) = run(case.run, True), run(case.run, False)
        ok, text = checks[name](b, f) if name in checks else (False, "no check written")
        ok_all &= ok and sb == sf
        print(f"{'OK  ' if ok else 'FAIL'} {name:45s} bug@{sb} ({tb:.2f}s/{tf:.2f}s) {text}")
    for name, fn in healthy.items():
        r, entries, t = run(fn, True)
        ok = r == -1 and all(finite_params(e) and dist(e) > 0 for e in entries) and \
            all(s["finite"] for e in entries for s in e.steps)
        extra = trained(name, entries) if trained is not None else None
        if extra is not None:
            ok &= extra[0]
        ok_all &= ok
        print(f"{'OK  ' if ok else 'FAIL'} healthy {name:37s} ({t:.2f}s) steps={[len(e.steps) for e in entries]} "
              f"moved={[round(dist(e), 3) for e in entries]}{extra[1] if extra is not None else ''}")
    print("ALL OK" if ok_all else "SOME FAILED")
    return 0 if ok_all else 1

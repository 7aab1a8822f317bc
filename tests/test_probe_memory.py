"""What the probe holds in memory: nothing of its buffers between logged steps (their storage is
handed back at the end of each logged step), and gradients reduced a fixed-size window at a
time giving the same per-block rows as one whole-layout buffer, and the pre-step copy of the
parameters in host memory (probe.before_on=host) giving the same records as beside them."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import composed
from torch import nn

from gradrepro.probe import Probe
from gradrepro.probe.blocks import (
    BLOCK,
    LEVEL_ROWS,
    MOMENT_ROWS,
    SQUARE_ROWS,
    Layout,
    level_sums_,
    moments_,
    squares,
)
from gradrepro.probe.config import ProbeConfig
from gradrepro.probe.probe import PARAM_ROWS


def held_bytes(obj, exclude: set) -> int:
    """Bytes of the distinct tensor storages reachable from ``obj`` through attributes,
    dicts, lists and tuples, but those in ``exclude`` (the model's own parameters and
    gradients, which the probe refers to but does not own)."""
    seen_obj, storages = set(), {}
    stack = [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen_obj:
            continue
        seen_obj.add(id(o))
        if torch.is_tensor(o):
            s = o.untyped_storage()
            if s.data_ptr() not in exclude:
                storages[(s.data_ptr(), id(s) if s.data_ptr() == 0 else 0)] = s.nbytes()
            continue
        if isinstance(o, dict):
            stack += list(o.keys()) + list(o.values())
        elif isinstance(o, (list, tuple, set)):
            stack += list(o)
        elif hasattr(o, "__dict__") and type(o).__module__.startswith("gradrepro"):
            stack += list(vars(o).values())
    return sum(storages.values())


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def test_probe_holds_no_buffer_between_logged_steps():
    net = _net()
    n_params = sum(p.numel() for p in net.parameters())  # 560 K entries: 2.2 MB in float32
    probe = Probe(net, ProbeConfig(every=4, act_sample=8), total_steps=100)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    blocks = sum(-(-p.numel() // BLOCK) for p in net.parameters())
    # What may stay: the layouts' constants, a few bytes per block and per tensor, and one
    # row of BLOCK entries per layout (blocks.pad_index): far below one copy of the parameters.
    allowed = 3 * 4 * BLOCK + 16 * blocks + 64 * len(list(net.parameters())) + 4096
    assert allowed < 4 * n_params / 20
    for step in range(6):
        opt.zero_grad(set_to_none=True)
        with probe.step(step, lr=0.1) as p:
            nn.functional.cross_entropy(net(x), y).backward()
            p.collect()
            opt.step()
        own = {t.untyped_storage().data_ptr() for q in net.parameters() for t in (q, q.grad) if t is not None}
        held = held_bytes(probe, own)
        assert held <= allowed, (step, p.logged, held, allowed)
        if step == 0:
            assert p.columns is not None and np.isfinite(p.columns["update_to_param"]).all()
    # The next logged step regrows what it needs and records the same kind of row.
    with probe.step(8, lr=0.1) as p:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(net(x), y).backward()
        p.collect()
        opt.step()
    assert p.columns is not None and np.isfinite(p.columns["grad_norm"]).all()


def test_window_rows_equal_the_whole_buffer_rows():
    g = torch.Generator().manual_seed(3)
    sizes = [5000, 3, 2048, 7000, 1, 4097, 0, 300]
    xs = [torch.randn(n, generator=g) * 10.0 ** torch.randint(-30, 3, (n,), generator=g) for n in sizes]
    xs[3][:50] = 0.0
    shapes = [x.shape for x in xs]
    layout = Layout([x.numel() for x in xs], "cpu")
    rows = tuple("g_" + r for r in MOMENT_ROWS + LEVEL_ROWS) + tuple("p_" + r for r in SQUARE_ROWS)

    whole = layout.stats(rows)
    buf = layout.buffer(shapes)
    for v, x in zip(buf.views, xs):
        v.copy_(x)
    level_sums_(buf.flat.abs_().view_as(buf.grid), whole, "g_", nan=False)
    for v, x in zip(buf.views, xs):
        v.copy_(x)
    squares(buf.grid, whole, "p_", work=torch.empty_like(buf.grid))
    moments_(buf, layout, whole, "g_")

    windowed = layout.stats(rows)
    windows = layout.windows(shapes, torch.float32, blocks=2)  # tensors split across windows
    assert len(windows.parts) > 3
    of = dict(enumerate(xs))
    for part, r in zip(windows.parts, windows.rows(windowed)):
        targets, sources = windows.pieces(part, of)
        work = part.work
        work.flat.zero_()
        torch._foreach_copy_(targets, sources)
        work.flat.abs_()
        level_sums_(work.grid, r, "g_", nan=False)
        torch._foreach_copy_(targets, sources)
        squares(work.grid, r, "p_", work=torch.empty_like(work.grid))
        moments_(work, part, r, "g_")
    assert torch.equal(windowed.data, whole.data)


def test_pads_of_memory_just_grown_are_zeroed_even_from_nan():
    layout = Layout([5, 3000], "cpu")
    buf = layout.buffer([(5,), (3000,)], zeros=False)
    buf.flat.fill_(float("nan"))  # what a regrown storage may hold
    for v in buf.views:
        v.fill_(1.0)
    from gradrepro.probe.blocks import zero_pads_

    zero_pads_(buf, layout)
    assert torch.isfinite(buf.flat).all() and float(buf.flat.sum()) == 3005.0


def _columns_of_a_run(before_on: str, bf16: bool, device: str = "cpu", window_blocks: int = 2) -> list:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(37, 3000), nn.Tanh(), nn.Linear(3000, 3), nn.Linear(3, 10)).to(device)
    net[2].weight.requires_grad_(False)  # a tensor without a gradient: its update is zero
    probe = Probe(net, ProbeConfig(every=2, act_sample=8, before_on=before_on), total_steps=6)
    probe.window_blocks = window_blocks  # windows of 2 blocks: tensors split across windows
    probe.bf16 = bf16
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 37, generator=g).to(device), torch.randint(0, 10, (16,), generator=g).to(device)
    out = []
    for step in range(6):
        opt.zero_grad(set_to_none=True)
        with probe.step(step, lr=1e-3) as p:
            nn.functional.cross_entropy(net(x), y).backward()
            p.collect()
            opt.step()
        assert probe.buffers.host_before is (before_on == "host")
        if p.columns is not None:
            out.append(p.columns)
    return out


def assert_same_columns(a: list, b: list) -> None:
    assert len(a) == len(b) == 4  # steps 0, 2, 4 and the last
    for ca, cb in zip(a, b):
        assert ca.keys() == cb.keys()
        for key in ca:
            np.testing.assert_array_equal(np.asarray(ca[key]), np.asarray(cb[key]), err_msg=key)


def test_the_pre_step_copy_on_the_host_gives_the_same_records():
    """probe.before_on=host takes the copy a window at a time through the work buffer and
    brings it back a window at a time after the step: every column equal to the copy kept
    beside the parameters, bf16's rounded-away count included."""
    for bf16 in (False, True):
        host = _columns_of_a_run("host", bf16)
        ratio = np.asarray(host[0]["update_to_param"])
        assert np.isfinite(ratio).all() and list(ratio > 0) == [True, True, False, True, True, True]
        if bf16:  # the last layers' small AdamW steps fall under half a bf16 ulp of their weights
            assert np.nanmax(host[-1]["frac_bf16_update_lost"]) > 0
        assert_same_columns(host, _columns_of_a_run("device", bf16))


@pytest.mark.parametrize("before_on", ["device", "host"])
def test_the_hosts_shortcuts_give_the_device_passes_records(monkeypatch, before_on):
    """The CPU's own passes (sums of squares whose plain norms the host reads, fresh buffers
    zeroed only where nothing is copied: probe.blocks.HOST_SHORTCUTS) record what the passes a
    GPU runs record, on the CPU: the same columns, bit for bit, with a frozen tensor, tensors
    split across windows, bf16's count and the update, on both places of the pre-step copy."""
    from gradrepro.probe import blocks

    ours = _columns_of_a_run(before_on, True)
    monkeypatch.setattr(blocks, "HOST_SHORTCUTS", False)
    assert_same_columns(ours, _columns_of_a_run(before_on, True))


def test_the_running_sum_check_keeps_the_copy_beside_the_parameters():
    probe = Probe(_net(), ProbeConfig(every=1, running_sum_steps=3, before_on="host"), total_steps=4)
    probe.buffers.ensure_layout()
    assert probe.buffers.host_before is False


@pytest.mark.parametrize("experiment", ["bf16_master", "bn_speedup"])
def test_a_run_with_the_copy_on_the_host_records_what_it_records_beside_the_parameters(cli, experiment):
    # Experiments without the running-sum check (which keeps the copy beside the parameters);
    # bf16_master's bf16 weights take the rounded-away count through the host path too.
    assert composed(experiment, "probe.before_on=host").probe.running_sum_steps == 0
    runs = [cli(f"experiment={experiment}", "scale=tiny", "device=cpu", f"probe.before_on={where}")
            for where in ("device", "host")]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    assert runs[1].summary["reproduced"] == runs[0].summary["reproduced"]
    pd.testing.assert_frame_equal(runs[1].modules, runs[0].modules)
    pd.testing.assert_frame_equal(runs[1].scalars, runs[0].scalars)


def test_the_recorder_takes_the_place_of_the_copy_and_refuses_one_it_does_not_know(tmp_path):
    import gradrepro
    from gradrepro.errors import UserError

    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(UserError, match="before_on='gpu' is not valid; choose one of: device, host"):
        gradrepro.record(net, opt, tmp_path / "refused", before_on="gpu")
    rec = gradrepro.record(net, opt, tmp_path / "run", every=1, before_on="host", live=False)
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    for _ in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    rec.close()
    assert rec.probe.buffers.host_before
    assert np.isfinite(pd.read_parquet(tmp_path / "run" / "modules.parquet")["update_to_param"]).all()


def _activation_columns_of_a_run(window_blocks, batches=(16, 16, 12, 16), skip_at=None):
    """Columns of logged steps of a net whose hooked outputs span several windows of
    ``window_blocks`` blocks; ``batches``: the batch of each step (a change relays the samples
    out); ``skip_at``: a step in which one module is not called (a later module takes its place
    in the arrival order)."""
    torch.manual_seed(0)
    net = nn.ModuleDict({"a": nn.Linear(37, 3000), "b": nn.Linear(3000, 700), "c": nn.Linear(700, 10),
                         "skip": nn.Linear(10, 10)})
    probe = Probe(net, ProbeConfig(every=1, act_sample=8), total_steps=len(batches))
    probe.window_blocks = window_blocks
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    out = []
    for step, batch in enumerate(batches):
        x, y = torch.randn(batch, 37, generator=g), torch.randint(0, 10, (batch,), generator=g)
        opt.zero_grad(set_to_none=True)
        with probe.step(step, lr=1e-2) as p:
            h = net["c"](torch.tanh(net["b"](torch.tanh(net["a"](x)))))
            if step != skip_at:
                h = net["skip"](h)
            nn.functional.cross_entropy(h, y).backward()
            p.collect()
            opt.step()
        out.append({k: v for k, v in p.columns.items() if k.startswith("act")})
    return out, probe


def test_the_hooks_samples_reduced_a_window_at_a_time_give_the_rows_of_one_window():
    """Windows of 2 blocks (4,096 entries): every module's 8-example output and its gradient
    spans several, and a batch change and a skipped module relay the samples out mid-run.
    Every activation column equals the run whose window holds all samples at once."""
    small, probe = _activation_columns_of_a_run(2, skip_at=2)
    whole, _ = _activation_columns_of_a_run(1024, skip_at=2)
    assert len(small) == 4
    for a, b in zip(small, whole):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    assert np.isfinite(small[0]["act_std"]).all() and np.isnan(small[2]["act_std"][-2:]).all()
    # What the stashes keep: a window of 2 blocks each, not the 8 x 3,000 + 8 x 700 + ... samples.
    assert probe.acts._buffer.numel() == probe.act_grads._buffer.numel() == 2 * 2048


def test_the_samples_windows_hold_what_the_hooks_saw():
    """The stash's moments of each module against float64 moments of the samples themselves."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(37, 3000), nn.Tanh(), nn.Linear(3000, 5))
    probe = Probe(net, ProbeConfig(every=1, act_sample=8), total_steps=1)
    probe.window_blocks = 3
    seen = {}

    def keep(name):
        def hook(module, inputs, output) -> None:
            seen[name] = output[:8].detach().double()
        return hook

    net[0].register_forward_hook(keep("0"))
    net[2].register_forward_hook(keep("2"))
    x, y = torch.randn(16, 37), torch.randint(0, 5, (16,))
    with probe.step(0) as p:
        nn.functional.cross_entropy(net(x), y).backward()
        p.collect()
    for module, rows in (("0", p.columns["module"] == "0"), ("2", p.columns["module"] == "2")):
        np.testing.assert_allclose(p.columns["act_mean"][rows], float(seen[module].mean()), rtol=1e-5)
        # std with n - 1, as the probe's
        np.testing.assert_allclose(p.columns["act_std"][rows], float(seen[module].std()), rtol=1e-5)


def test_a_logged_step_holds_one_samples_buffer_and_across_the_optimizer_step_the_copy_alone():
    """Two moments of a first logged step, whose samples grow the stash's buffer from one block
    by doubling: when backward ends, each stash holds one buffer (the grown one; the smaller
    ones it outgrew are freed as it grows, not kept until the step's layout is settled); while
    the optimizer steps, the probe holds the copy of the parameters and its per-block rows,
    not the gradients' windows or the samples' buffers (none is read across the step)."""
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(2048, 2048), nn.Tanh())])
    probe = Probe(net, ProbeConfig(every=16, act_sample=8), total_steps=2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(16, 2048), torch.randint(0, 2048, (16,))
    own = lambda: {t.untyped_storage().data_ptr() for q in net.parameters()  # noqa: E731
                   for t in (q, q.grad) if t is not None}
    params = list(net.parameters())
    copy = 4 * sum(-(-q.numel() // BLOCK) * BLOCK for q in params)
    stats = 4 * len(PARAM_ROWS) * sum(-(-q.numel() // BLOCK) for q in params)
    small = 3 * 4 * BLOCK + 16 * (copy // (4 * BLOCK)) + 64 * len(params) + 4096  # as above
    at_step = []
    opt.register_step_pre_hook(lambda *_: at_step.append(held_bytes(probe, own())))
    with probe.step(0, lr=0.1) as p:
        nn.functional.cross_entropy(net(x), y).backward()
        samples = probe.act_grads._buffer.untyped_storage().nbytes()
        assert samples >= 4 * BLOCK * 48  # the 6 Linear outputs' 8 x 2,048 samples: 48 blocks
        for stash in (probe.acts, probe.act_grads):
            rows = stash.stats.data.untyped_storage().nbytes()
            assert held_bytes(stash, own()) <= samples + rows + small, stash
        p.collect()
        opt.step()
    assert p.columns is not None and np.isfinite(p.columns["update_to_param"]).all()
    rows_held = sum(s.stats.data.untyped_storage().nbytes() for s in (probe.acts, probe.act_grads))
    assert copy + stats <= at_step[0] <= copy + stats + rows_held + small, (at_step, copy)


def test_output_gradient_counts_from_masks_are_the_exact_counts():
    """The output gradients' zero and fp16-flush counts, taken as 0/1 masks of the window
    summed per block (float16's rounding to nearest even takes exactly |x| <= 2^-25 to zero;
    pads count as flushed and are taken off on the host), against counts on the samples
    themselves: the flush line and its neighbours, subnormals, signed zeros, NaN, inf and
    values past float16's range, in windows of 2 blocks."""
    from gradrepro.probe.blocks import COUNT_ROWS, segment_nonzero_counts
    from gradrepro.probe.stash import Stash
    from gradrepro.probe.states import FP16_FLUSH

    flush = np.float32(FP16_FLUSH)
    special = torch.tensor([0.0, -0.0, flush, -flush, np.nextafter(flush, np.float32(1)),
                            -np.nextafter(flush, np.float32(1)), np.nextafter(flush, np.float32(0)), 1e-45,
                            2.0**-24, 3e-8, 65504.0, 7e4, 1e38, -1e38, float("inf"), float("-inf"), float("nan")],
                           dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    samples = []
    for n in (5000, 3, 2048, 4097, 17):
        x = torch.randn(n, generator=g) * 2.0 ** torch.randint(-40, 20, (n,), generator=g).float()
        where = torch.randint(0, n, (min(n, 40),), generator=g)
        x[where] = special[torch.randint(0, len(special), (len(where),), generator=g)]
        samples.append(x)
    probe = Probe(_net(), ProbeConfig(every=1, act_sample=8), total_steps=1)
    stash = Stash(MOMENT_ROWS + COUNT_ROWS, probe.reducer.act_grad_window, lambda: 2)
    for _ in range(2):  # a first step lays the samples out, a second reuses the layout
        stash.begin()
        for i, x in enumerate(samples):
            stash.put(str(i), x)
        assert stash.settle()
        rows = dict(zip(stash.stats.names, stash.result().numpy().astype(np.float64)))
        zeros, small = segment_nonzero_counts(stash.layout, rows, "")
        np.testing.assert_array_equal(zeros, [float((x == 0).sum()) for x in samples])
        np.testing.assert_array_equal(small, [float((x.abs() <= FP16_FLUSH).sum()) for x in samples])


def test_the_output_gradients_window_holds_what_has_arrived():
    """On a logged step after the first, each output gradient's hook grows the samples' storage
    to hold what has arrived (doubling): at the start of backward, where the training's memory
    peaks, the stash holds the first few gradients' samples, not the size of all of them (the
    previous probe made its buffer the last step's samples' size at the first hook)."""
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(2048, 2048), nn.Tanh())], nn.Linear(2048, 10))
    probe = Probe(net, ProbeConfig(every=1, act_sample=8), total_steps=3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(16, 2048), torch.randint(0, 10, (16,))
    stash, seen = probe.act_grads, []
    put = stash.put

    def watched(name, sample, value=float("nan"), **kwargs):
        put(name, sample, value, **kwargs)
        arrived = sum(-(-math.prod(s.shape) // BLOCK) for s in stash._segments[: stash._cursor])
        seen.append((arrived, stash._buffer.untyped_storage().nbytes()))

    stash.put = watched
    for step in range(3):
        seen.clear()
        opt.zero_grad(set_to_none=True)
        with probe.step(step, lr=0.1) as p:
            nn.functional.cross_entropy(net(x), y).backward()
            p.collect()
            opt.step()
    total = seen[-1][0]  # 6 x 8 blocks and the last layer's 1
    assert total == 49 and seen[0][0] == 1
    for arrived, held in seen:
        assert held <= 2 * 4 * BLOCK * arrived, (arrived, held)


def test_no_gradient_window_is_held_beside_the_copy():
    """The copy of the parameters is the largest buffer of a logged step: the gradients' passes
    run in it before the parameters are copied there (its norms' scaled pass runs in place on it
    and a second copy puts its values back), so no window of gradients is held beside it; the
    records are those of the windows' passes (the other tests of this file)."""
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(2048, 2048), nn.Tanh())])
    probe = Probe(net, ProbeConfig(every=1, act_sample=8), total_steps=2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(16, 2048), torch.randint(0, 2048, (16,))
    at_copy = []
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        with probe.step(step, lr=0.1) as p:
            nn.functional.cross_entropy(net(x), y).backward()
            if probe.buffers.before is not None and not at_copy:
                def watched(regrow=probe.buffers.before.regrow):
                    at_copy.append(probe.buffers.windows.buffer.untyped_storage().nbytes())
                    regrow()

                probe.buffers.before.regrow = watched
            p.collect()
            opt.step()
        assert np.isfinite(p.columns["param_norm"]).all() and (p.columns["param_norm"] > 0).all()
    assert at_copy and set(at_copy) == {0}

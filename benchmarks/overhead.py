"""Per-step overhead of gradrepro's probe against the bare training loop, Cockpit and
``torch.autograd.detect_anomaly``, on the same models, in one interleaved run.

    python benchmarks/overhead.py [--quick] [--json OUT.json] [--models ...] [--every ...]

Method (benchmarks/README.md has the measured tables):
- Every tool trains its own copy of the model (same seed, same synthetic batch, SGD). The
  tools run in blocks of ``--block`` steps, interleaved A B C ... with the order rotated
  each round, after one warm-up block each; every step is timed on its own (wall clock).
- A tool that works only on some steps (probe or Cockpit at ``every`` = k) is measured
  per phase of its schedule: the logged step (phase 0), the step after it (phase 1:
  Cockpit's two-step quantities finish there) and the others. Each block starts at a
  logged step of the real schedule, so phases beyond the block are sampled by the same
  code path; the per-step time is the schedule's average of the phase medians,
  ``(m0 + m1 + (k - 2) m_rest) / k``. ``ratio`` = that / the bare loop's median step.
- ``mem_ratio``: peak resident memory (Linux VmHWM) added by training, measured in a
  fresh process per row: the high-water mark is reset after the model, optimizer and
  batch exist, a few steps run (including a logged step), and (peak - baseline) is
  divided by the bare loop's. RSS, not torch's allocator: on CPU torch has no allocator
  statistics, and tracemalloc does not see tensor memory.
- ``--growth``: the probe's added time per logged step against the number of parameter
  tensors (deep MLPs) and against batch size (cifar10_3c3d), interleaved the same way.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gradrepro.config.schema import ProbeConfig  # noqa: E402
from gradrepro.probe import Probe  # noqa: E402

# ----------------------------------------------------------------------------------------
# Models


def cifar10_3c3d(num_classes: int = 10) -> nn.Module:
    """DeepOBS/Cockpit's cifar10_3c3d: 3 conv + 3 dense, 3x32x32 input (Schneider et al.
    2019, DeepOBS App. A). TF "same" max-pooling is a one-sided zero pad (inputs are
    post-ReLU, so zero padding equals -inf padding)."""

    def pool() -> List[nn.Module]:
        return [nn.ZeroPad2d((0, 1, 0, 1)), nn.MaxPool2d(3, stride=2)]

    return nn.Sequential(
        nn.Conv2d(3, 64, 5), nn.ReLU(), *pool(),  # Nx64x28x28 -> 14x14
        nn.Conv2d(64, 96, 3), nn.ReLU(), *pool(),  # Nx96x12x12 -> 6x6
        nn.Conv2d(96, 128, 3, padding=1), nn.ReLU(), *pool(),  # Nx128x6x6 -> 3x3
        nn.Flatten(),
        nn.Linear(3 * 3 * 128, 512), nn.ReLU(),
        nn.Linear(512, 256), nn.ReLU(),
        nn.Linear(256, num_classes),
    )


def resnet18_32(num_classes: int = 10) -> nn.Module:
    """torchvision's resnet18 with gradrepro's CIFAR stem (3x3 conv, no max-pool)."""
    from gradrepro.models.resnet import ResNet18Cifar, ResNet18CifarConfig

    return ResNet18Cifar(ResNet18CifarConfig(in_channels=3, num_classes=num_classes)).net


def plain30(num_classes: int = 10, width: int = 32) -> nn.Module:
    """A 30-layer plain net: 27 conv 3x3 + 3 fc, ReLU, no normalisation, 8x8 input.
    Defined here (same shape as gradrepro's depth experiments' plain net, which lives on
    another branch) so the benchmark does not depend on it."""
    layers: List[nn.Module] = [nn.Conv2d(3, width, 3, padding=1), nn.ReLU()]
    for _ in range(26):
        layers += [nn.Conv2d(width, width, 3, padding=1), nn.ReLU()]
    layers += [nn.Flatten(), nn.Linear(width * 8 * 8, 128), nn.ReLU(),
               nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, num_classes)]
    return nn.Sequential(*layers)


def deep_mlp(tensors: int, width: int = 32, in_dim: int = 32) -> nn.Module:
    """``tensors // 2`` Linear layers with bias: the growth study's tensor-count knob."""
    layers: List[nn.Module] = []
    for i in range(max(tensors // 2, 1)):
        layers += [nn.Linear(in_dim if i == 0 else width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


# name -> (builder, input shape without batch, default batch, quick batch)
MODELS: Dict[str, Tuple[Callable[[], nn.Module], Tuple[int, ...], int, int]] = {
    "cifar10_3c3d": (cifar10_3c3d, (3, 32, 32), 128, 32),
    "resnet18": (resnet18_32, (3, 32, 32), 32, 8),
    "plain30": (plain30, (3, 8, 8), 128, 32),
}

# ----------------------------------------------------------------------------------------
# Tools: one training step each, on the tool's own copy of the model


class Bare:
    """The bare loop: zero_grad, forward, loss (read on the host, as the runner does),
    backward, SGD step."""

    name = "bare"
    every = 1

    def __init__(self, net: nn.Module, batch: Tuple[torch.Tensor, torch.Tensor]) -> None:
        self.net = net
        self.x, self.y = batch
        self.loss_fn = nn.CrossEntropyLoss()
        self.opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

    def logs(self, step: int) -> bool:
        return step % self.every == 0

    def forward_backward(self, step: int) -> None:
        loss = self.loss_fn(self.net(self.x), self.y)
        float(loss.detach())
        loss.backward()

    def step(self, step: int) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.forward_backward(step)
        self.opt.step()


class Anomaly(Bare):
    name = "detect_anomaly"

    def forward_backward(self, step: int) -> None:
        with torch.autograd.detect_anomaly():
            super().forward_backward(step)


class ProbeTool(Bare):
    """The runner's sequence: zero_grad, then inside ``probe.step(...)``: forward -> backward
    -> collect -> optimizer step; the columns come out when the block ends."""

    name = "gradrepro"

    def __init__(self, net, batch, every: int, act_sample: Optional[int] = None) -> None:
        super().__init__(net, batch)
        self.every = every
        cfg = ProbeConfig(every=every, activations=True, task_contribution=True)
        if act_sample is not None:
            cfg.act_sample = act_sample
        self.probe = Probe(net, cfg, total_steps=10**12)

    def logs(self, step: int) -> bool:
        return self.probe.logs(step)

    def step(self, step: int) -> None:
        self.opt.zero_grad(set_to_none=True)
        with self.probe.step(step, lr=self.opt.param_groups[0]["lr"]) as p:
            loss = self.loss_fn(self.net(self.x), self.y)
            float(loss.detach())
            loss.backward()
            p.collect()
            self.opt.step()
        if p.logged:
            self.columns = p.columns


class CockpitTool(Bare):
    """Cockpit "economy" (Schneider et al. 2021), the documented usage: extended model and
    loss, individual losses passed in, backward inside the cockpit context."""

    name = "cockpit_economy"

    def __init__(self, net, batch, every: int) -> None:
        from backpack import extend
        from cockpit import Cockpit, quantities  # noqa: F401
        from cockpit.utils.configuration import configuration
        from cockpit.utils.schedules import linear

        has_skip = any(type(m).__name__ == "BasicBlock" for m in net.modules())
        net = extend(net, use_converter=has_skip)
        super().__init__(net, batch)
        self.every = every
        self.loss_fn = extend(nn.CrossEntropyLoss())
        self.individual = nn.CrossEntropyLoss(reduction="none")
        self.cockpit = Cockpit(net.parameters(),
                               quantities=configuration("economy", track_schedule=linear(every)))

    def forward_backward(self, step: int) -> None:
        out = self.net(self.x)
        loss = self.loss_fn(out, self.y)
        losses = self.individual(out, self.y)
        float(loss.detach())
        info = {"batch_size": self.x.shape[0], "individual_losses": losses, "loss": loss,
                "optimizer": self.opt}
        with self.cockpit(step, info=info):
            loss.backward(create_graph=self.cockpit.create_graph(step))


def make_tool(tool: str, every: int, net: nn.Module, batch) -> Bare:
    if tool == "bare":
        return Bare(net, batch)
    if tool == "gradrepro":
        return ProbeTool(net, batch, every)
    if tool == "cockpit_economy":
        return CockpitTool(net, batch, every)
    if tool == "detect_anomaly":
        return Anomaly(net, batch)
    raise ValueError(tool)


def make_batch(shape: Sequence[int], batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, *shape, generator=g), torch.randint(0, 10, (batch,), generator=g)


# ----------------------------------------------------------------------------------------
# Interleaved timing


def block_start(block: int, every: int, length: int) -> int:
    """First step of the ``block``-th block: a logged step of the real schedule, far enough
    from the previous block that a block covers whole periods when ``every <= length``."""
    return block * every * math.ceil(length / every)


def phase(step: int, every: int) -> str:
    p = step % every
    return "log" if p == 0 else "next" if p == 1 else "rest"


def per_step(times: Dict[str, List[float]], every: int) -> float:
    """The schedule's average step time from the phase medians."""
    med = {k: statistics.median(v) for k, v in times.items() if v}
    if every == 1:
        return med["log"]
    rest = med.get("rest", med["next"])
    return (med["log"] + med["next"] + (every - 2) * rest) / every


def interleaved(tools: List[Bare], rounds: int, length: int,
                on_block: Optional[Callable[[], None]] = None) -> List[Dict[str, List[float]]]:
    """Per tool, step times by phase. Block 0 is the warm-up (discarded)."""
    times: List[Dict[str, List[float]]] = [{"log": [], "next": [], "rest": []} for _ in tools]
    order = list(range(len(tools)))
    for r in range(rounds + 1):
        rot = order[r % len(order):] + order[: r % len(order)]
        for i in rot:
            tool = tools[i]
            start = block_start(r, tool.every, length)
            for s in range(start, start + length):
                t0 = time.perf_counter()
                tool.step(s)
                dt = time.perf_counter() - t0
                if r > 0:
                    times[i][phase(s, tool.every)].append(dt)
        if on_block is not None:
            on_block()
    return times


def tool_grid(tool_names: Sequence[str], intervals: Sequence[int]) -> List[Tuple[str, int]]:
    grid = []
    for tool in tool_names:
        if tool in ("bare", "detect_anomaly"):
            grid.append((tool, 1))
        else:
            grid += [(tool, k) for k in intervals]
    return grid


def build_tools(model: str, grid, batch_size: int, seed: int = 0):
    builder, shape, _, _ = MODELS[model]
    torch.manual_seed(seed)
    base = builder()
    batch = make_batch(shape, batch_size, seed)
    tools, errors = [], {}
    for tool, every in grid:
        try:
            tools.append(make_tool(tool, every, copy.deepcopy(base), batch))
        except Exception as exc:  # a tool that cannot run this model is reported, not fatal
            errors[(tool, every)] = f"{type(exc).__name__}: {exc}"
    return tools, errors


def time_model(model: str, grid, batch_size: int, rounds: int, length: int, log) -> List[dict]:
    tools, errors = build_tools(model, grid, batch_size)
    for tool in list(tools):  # one trial step: drop a tool that fails on this model
        try:
            tool.step(0)
        except Exception as exc:
            errors[(tool.name, tool.every)] = f"{type(exc).__name__}: {str(exc)[:200]}"
            tools.remove(tool)
    t0 = time.perf_counter()
    done = iter(range(1, rounds + 2))
    times = interleaved(tools, rounds, length, on_block=lambda: log(
        f"  {model}: round {next(done)}/{rounds + 1} at {time.perf_counter() - t0:.0f} s"))
    log(f"  {model}: {len(tools)} tools x {rounds} rounds x {length} steps "
        f"in {time.perf_counter() - t0:.0f} s")
    rows = []
    for tool, t in zip(tools, times):
        rows.append({"model": model, "tool": tool.name, "every": tool.every,
                     "step_s": per_step(t, tool.every),
                     "log_s": statistics.median(t["log"]),
                     "unlogged_s": statistics.median(t["next"] + t["rest"])
                     if t["next"] or t["rest"] else None,
                     "n_steps": sum(len(v) for v in t.values())})
    for (tool, every), err in errors.items():
        rows.append({"model": model, "tool": tool, "every": every, "step_s": None,
                     "error": err})
    bare = next(r["step_s"] for r in rows if r["tool"] == "bare")
    for r in rows:
        r["ratio"] = r["step_s"] / bare if r["step_s"] is not None else None
        if r.get("unlogged_s") is not None:
            r["unlogged_ratio"] = r["unlogged_s"] / bare
            # Paired within the tool's own copy of the model: its schedule against its own
            # steps that run no tool code. Free of the copy-to-copy differences (memory
            # placement, allocator state) that unlogged_ratio shows as a few percent.
            if r["step_s"] is not None:
                r["own_ratio"] = r["step_s"] / r["unlogged_s"]
    return rows


# ----------------------------------------------------------------------------------------
# Peak memory, one fresh process per row


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def memory_child(model: str, tool: str, every: int, batch_size: int, steps: int,
                 threads: int) -> dict:
    torch.set_num_threads(threads)
    builder, shape, _, _ = MODELS[model]
    torch.manual_seed(0)
    t = make_tool(tool, every, builder(), make_batch(shape, batch_size))
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
        reset = True
    except OSError:
        reset = False
    base = _status_kb("VmRSS")
    rss = []
    for s in range(steps):
        t.step(s)
        rss.append(_status_kb("VmRSS"))
    peak = _status_kb("VmHWM")
    return {"base_kb": base, "peak_kb": peak, "hwm_reset": reset,
            "rss_kb_after_steps": rss}


def memory_rows(rows: List[dict], batch_sizes: Dict[str, int], steps: int, threads: int,
                log) -> None:
    peaks: Dict[Tuple[str, str, int], dict] = {}
    for r in rows:
        if r.get("step_s") is None:
            continue
        key = (r["model"], r["tool"], r["every"])
        cmd = [sys.executable, __file__, "--_memory", r["model"], r["tool"], str(r["every"]),
               str(batch_sizes[r["model"]]), str(steps), str(threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if out.returncode != 0:
            log(f"  memory {key} failed: {out.stderr.strip().splitlines()[-1:]}")
            continue
        peaks[key] = json.loads(out.stdout.strip().splitlines()[-1])
    for r in rows:
        key = (r["model"], r["tool"], r["every"])
        bare = peaks.get((r["model"], "bare", 1))
        mine = peaks.get(key)
        if bare is None or mine is None:
            r["mem_ratio"] = None
            continue
        added = mine["peak_kb"] - mine["base_kb"]
        r["mem_added_mb"] = added / 1024
        r["mem_ratio"] = added / max(bare["peak_kb"] - bare["base_kb"], 1)
        rss = mine["rss_kb_after_steps"]
        r["rss_growth_mb"] = (rss[-1] - rss[1]) / 1024 if len(rss) > 2 else None


# ----------------------------------------------------------------------------------------
# Cost growth


def growth(tensor_counts: Sequence[int], batch_sizes: Sequence[int], rounds: int,
           length: int, log) -> dict:
    """Added time per logged step (probe at every step minus bare), interleaved pairs."""
    out: Dict[str, list] = {"tensors": [], "batch": []}
    for n in tensor_counts:
        torch.manual_seed(0)
        base = deep_mlp(n)
        batch = make_batch((32,), 32)
        tools = [Bare(copy.deepcopy(base), batch), ProbeTool(copy.deepcopy(base), batch, 1)]
        times = interleaved(tools, rounds, length)
        bare, probe = (statistics.median(t["log"]) for t in times)
        out["tensors"].append({"tensors": len(tools[1].probe.params), "bare_s": bare,
                               "probe_s": probe, "added_s": probe - bare})
        log(f"  growth tensors={len(tools[1].probe.params)}: added {1e3 * (probe - bare):.2f} ms")
    builder, shape, _, _ = MODELS["cifar10_3c3d"]
    for b in batch_sizes:
        torch.manual_seed(0)
        base = builder()
        batch = make_batch(shape, b)
        tools = [Bare(copy.deepcopy(base), batch), ProbeTool(copy.deepcopy(base), batch, 1)]
        times = interleaved(tools, rounds, length)
        bare, probe = (statistics.median(t["log"]) for t in times)
        out["batch"].append({"batch": b, "bare_s": bare, "probe_s": probe,
                             "added_s": probe - bare, "ratio": probe / bare})
        log(f"  growth batch={b}: added {1e3 * (probe - bare):.2f} ms, ratio {probe / bare:.3f}")
    return out


# ----------------------------------------------------------------------------------------
# Report


def fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: List[dict]) -> str:
    lines = ["| model | tool | every | step (ms) | ratio | unlogged ratio | own ratio | mem ratio |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        step = None if r.get("step_s") is None else 1e3 * r["step_s"]
        lines.append(f"| {r['model']} | {r['tool']} | {r['every']} | {fmt(step, '.1f')} | "
                     f"{fmt(r.get('ratio'), '.3f')} | {fmt(r.get('unlogged_ratio'), '.3f')} | "
                     f"{fmt(r.get('own_ratio'), '.3f')} | {fmt(r.get('mem_ratio'), '.2f')} |"
                     + (f" {r['error'][:60]}" if r.get("error") else ""))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="small batches, 3 rounds of 3 steps, intervals 1 4 16, no growth study")
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--models", nargs="+", choices=list(MODELS))
    p.add_argument("--tools", nargs="+",
                   default=["bare", "gradrepro", "cockpit_economy", "detect_anomaly"])
    p.add_argument("--every", nargs="+", type=int, help="intervals (default 1 4 16 64 256)")
    p.add_argument("--batch", type=int, help="batch size for every model (default per model)")
    p.add_argument("--rounds", type=int, help="measured rounds (default 7; quick 3)")
    p.add_argument("--block", type=int, help="steps per block (default 4; quick 3)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    p.add_argument("--mem-steps", type=int, default=4)
    p.add_argument("--growth", action="store_true", help="run the cost-growth study")
    p.add_argument("--growth-only", action="store_true", help="only the cost-growth study")
    p.add_argument("--growth-tensors", nargs="+", type=int, default=[10, 32, 100, 320, 1000])
    p.add_argument("--growth-batch", nargs="+", type=int, default=[16, 32, 64, 128, 256])
    p.add_argument("--_memory", nargs=6, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")

    if args._memory:
        model, tool, every, batch, steps, threads = args._memory
        print(json.dumps(memory_child(model, tool, int(every), int(batch), int(steps),
                                      int(threads))))
        return 0

    torch.set_num_threads(args.threads)
    models = args.models or list(MODELS)
    intervals = args.every or ([1, 4, 16] if args.quick else [1, 4, 16, 64, 256])
    rounds = args.rounds or (3 if args.quick else 7)
    length = args.block or (3 if args.quick else 4)
    if "bare" not in args.tools:
        args.tools = ["bare", *args.tools]

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": platform.machine(), "cpus": os.cpu_count(), "threads": args.threads,
            "torch": torch.__version__, "cuda": None, "load_before": os.getloadavg(),
            "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
            "rounds": rounds, "block": length}
    batch_sizes = {m: args.batch or (MODELS[m][3] if args.quick else MODELS[m][2])
                   for m in models}
    meta["batch"] = batch_sizes
    rows: List[dict] = []
    if args.growth_only:
        args.growth, models, args.no_memory = True, [], True
    for model in models:
        rows += time_model(model, tool_grid(args.tools, intervals), batch_sizes[model],
                           rounds, length, log)
    meta["load_after_timing"] = os.getloadavg()
    if args.no_memory:
        for r in rows:
            r["mem_ratio"] = None
    else:
        memory_rows(rows, batch_sizes, args.mem_steps, args.threads, log)
    result = {"meta": meta, "rows": rows}
    if args.growth:
        result["growth"] = growth(args.growth_tensors, args.growth_batch, rounds, length, log)
    meta["load_after"] = os.getloadavg()
    print(table(rows))
    if args.growth:
        print("\n| parameter tensors | bare (ms) | probe (ms) | added per logged step (ms) |")
        print("|---:|---:|---:|---:|")
        for g in result["growth"]["tensors"]:
            print(f"| {g['tensors']} | {1e3 * g['bare_s']:.2f} | {1e3 * g['probe_s']:.2f} | "
                  f"{1e3 * g['added_s']:.2f} |")
        print("\n| batch (cifar10_3c3d) | bare (ms) | probe (ms) | added (ms) | ratio |")
        print("|---:|---:|---:|---:|---:|")
        for g in result["growth"]["batch"]:
            print(f"| {g['batch']} | {1e3 * g['bare_s']:.1f} | {1e3 * g['probe_s']:.1f} | "
                  f"{1e3 * g['added_s']:.2f} | {g['ratio']:.3f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-step overhead of gradrepro's probe against the bare training loop, Cockpit and
``torch.autograd.detect_anomaly``, on the same models, in one interleaved run.

    python benchmarks/overhead.py [--quick] [--json OUT.json] [--models ...] [--every ...]
        [--device cpu|cuda] [--clock wall|cpu] [--ops | --ops-only]

Method (benchmarks/README.md has the measured tables):
- Every tool trains its own copy of the model (same seed, same synthetic batch, SGD). The
  tools run in blocks of ``--block`` steps, interleaved A B C ... with the order rotated
  each round, after one warm-up block each; every step is timed on its own (wall clock;
  ``--clock cpu``: the process's CPU time, for CPU runs on a machine others are using).
- A tool that works only on some steps (probe or Cockpit at ``every`` = k) is measured
  per phase of its schedule: the logged step (phase 0), the step after it (phase 1:
  Cockpit's two-step quantities finish there) and the others. Each block starts at a
  logged step of the real schedule, so phases beyond the block are sampled by the same
  code path; the per-step time is the schedule's average of the phase medians,
  ``(m0 + m1 + (k - 2) m_rest) / k``. ``ratio`` = that / the bare loop's median step.
- ``--device cuda``: models and batches on the GPU; each timed step is bracketed by
  ``torch.cuda.synchronize`` (CUDA runs asynchronously), memory from the allocator.
- ``mem_ratio``: the peak memory training adds, against the bare loop's (memory.py): RSS on
  CPU; ``tensor_mem_ratio`` the same for tensor bytes alone (the allocator's count on CUDA).
- ``--ops``: the operations the probe dispatches on one logged step and the bare step's own
  count, and the host waits among them (op_count.py): ``probe_ops``, ``bare_ops``,
  ``probe_syncs`` in every row of the model. ``--ops-only``: only those, one row per model.
  ``--device-path``: the operations a GPU runs, counted on the CPU (the CPU's own sums of
  squares read the plain norms on the host and scale only the blocks that need it, and its
  fresh buffers are zeroed only where nothing is copied).
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
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from memory import memory_rows
from op_count import ops_rows
from tools import MODELS, Bare, ProbeTool, deep_mlp, make_batch, make_tool, synchronize

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


# wall: perf_counter (the default; what a user waits). cpu: the process's CPU time on CPU runs,
# all threads together: the work done, robust to other processes on a shared machine (a busy
# machine stretches wall time many-fold and unevenly between neighbouring blocks).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = "wall"


def interleaved(tools: List[Bare], rounds: int, length: int, device="cpu",
                on_block: Optional[Callable[[], None]] = None) -> List[Dict[str, List[float]]]:
    """Per tool, step times by phase (each step bracketed by a device synchronisation).
    Block 0 is the warm-up (discarded)."""
    times: List[Dict[str, List[float]]] = [{"log": [], "next": [], "rest": []} for _ in tools]
    order = list(range(len(tools)))
    for r in range(rounds + 1):
        rot = order[r % len(order):] + order[: r % len(order)]
        for i in rot:
            tool = tools[i]
            start = block_start(r, tool.every, length)
            for s in range(start, start + length):
                synchronize(device)
                t0 = CLOCKS[_clock]()
                tool.step(s)
                synchronize(device)
                dt = CLOCKS[_clock]() - t0
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


def build_tools(model: str, grid, batch_size: int, device="cpu", seed: int = 0):
    builder, shape, _, _ = MODELS[model]
    torch.manual_seed(seed)
    base = builder().to(device)
    batch = make_batch(shape, batch_size, seed, device)
    tools, errors = [], {}
    for tool, every in grid:
        try:
            tools.append(make_tool(tool, every, copy.deepcopy(base), batch))
        except Exception as exc:  # a tool that cannot run this model is reported, not fatal
            errors[(tool, every)] = f"{type(exc).__name__}: {exc}"
    return tools, errors


def time_model(model: str, grid, batch_size: int, rounds: int, length: int, device, log) -> List[dict]:
    tools, errors = build_tools(model, grid, batch_size, device)
    for tool in list(tools):  # one trial step: drop a tool that fails on this model
        try:
            tool.step(0)
        except Exception as exc:
            errors[(tool.name, tool.every)] = f"{type(exc).__name__}: {str(exc)[:200]}"
            tools.remove(tool)
    t0 = time.perf_counter()
    done = iter(range(1, rounds + 2))
    times = interleaved(tools, rounds, length, device, on_block=lambda: log(
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
# Cost growth


def growth(tensor_counts: Sequence[int], batch_sizes: Sequence[int], rounds: int,
           length: int, device, log) -> dict:
    """Added time per logged step (probe at every step minus bare), interleaved pairs."""
    out: Dict[str, list] = {"tensors": [], "batch": []}
    for n in tensor_counts:
        torch.manual_seed(0)
        base = deep_mlp(n).to(device)
        batch = make_batch((32,), 32, device=device)
        tools = [Bare(copy.deepcopy(base), batch), ProbeTool(copy.deepcopy(base), batch, 1)]
        times = interleaved(tools, rounds, length, device)
        bare, probe = (statistics.median(t["log"]) for t in times)
        out["tensors"].append({"tensors": len(tools[1].probe.params), "bare_s": bare,
                               "probe_s": probe, "added_s": probe - bare})
        log(f"  growth tensors={len(tools[1].probe.params)}: added {1e3 * (probe - bare):.2f} ms")
    builder, shape, _, _ = MODELS["cifar10_3c3d"]
    for b in batch_sizes:
        torch.manual_seed(0)
        base = builder().to(device)
        batch = make_batch(shape, b, device=device)
        tools = [Bare(copy.deepcopy(base), batch), ProbeTool(copy.deepcopy(base), batch, 1)]
        times = interleaved(tools, rounds, length, device)
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
    lines = ["| model | tool | every | step (ms) | ratio | unlogged ratio | own ratio | mem ratio | tensor mem ratio |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        step = None if r.get("step_s") is None else 1e3 * r["step_s"]
        lines.append(f"| {r['model']} | {r['tool']} | {r['every']} | {fmt(step, '.1f')} | "
                     f"{fmt(r.get('ratio'), '.3f')} | {fmt(r.get('unlogged_ratio'), '.3f')} | "
                     f"{fmt(r.get('own_ratio'), '.3f')} | {fmt(r.get('mem_ratio'), '.2f')} | "
                     f"{fmt(r.get('tensor_mem_ratio'), '.2f')} |"
                     + (f" {r['error'][:60]}" if r.get("error") else ""))
    return "\n".join(lines)


def ops_table(rows: List[dict]) -> str:
    lines = ["| model | tensors | hooked modules | bare step ops | probe ops per logged step | "
             "probe host waits |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['tensors']} | {r['hooked_modules']} | {r['bare_ops']} | "
                     f"{r['probe_ops']} | {r['probe_syncs']} |")
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
    p.add_argument("--mem-steps", type=int, default=4,
                   help="steps per memory process, at least through the second logged step")
    p.add_argument("--growth", action="store_true", help="run the cost-growth study")
    p.add_argument("--growth-only", action="store_true", help="only the cost-growth study")
    p.add_argument("--growth-tensors", nargs="+", type=int, default=[10, 32, 100, 320, 1000])
    p.add_argument("--growth-batch", nargs="+", type=int, default=[16, 32, 64, 128, 256])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--clock", default="wall", choices=list(CLOCKS),
                   help="wall clock, or the process's CPU time (CPU runs on a busy machine)")
    p.add_argument("--ops", action="store_true",
                   help="also count the probe's operations per logged step (on CPU)")
    p.add_argument("--ops-only", action="store_true", help="only the operation counts")
    p.add_argument("--device-path", action="store_true",
                   help="count the operations a GPU runs: the CPU's own shortcuts off "
                        "(probe.blocks.HOST_SHORTCUTS)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("overhead.py: --device cuda, but torch sees no CUDA device (choices: cpu, cuda)",
              file=sys.stderr)
        return 2
    if args.clock == "cpu" and args.device != "cpu":
        print("overhead.py: --clock cpu times CPU runs only (a GPU's work is not CPU time); "
              "choices for --device cuda: wall", file=sys.stderr)
        return 2
    global _clock
    _clock = args.clock
    device = torch.device(args.device)

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
            "torch": torch.__version__, "load_before": os.getloadavg(), "device": args.device,
            "cuda": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
            "rounds": rounds, "block": length, "clock": args.clock}
    batch_sizes = {m: args.batch or (MODELS[m][3] if args.quick else MODELS[m][2])
                   for m in models}
    meta["batch"] = batch_sizes
    rows: List[dict] = []
    counts: Dict[str, dict] = {}
    if args.device_path:
        from gradrepro.probe import blocks
        blocks.HOST_SHORTCUTS = False
    meta["device_path"] = args.device_path
    # On CPU: the probe's passes are the GPU's but for two host shortcuts (the sums of squares
    # read on the host, fresh buffers zeroed only where nothing is copied; --device-path: off).
    if args.ops or args.ops_only:
        counts = {r["model"]: r for r in ops_rows(models, batch_sizes)}
    if args.ops_only:
        rows, models, args.no_memory = list(counts.values()), [], True
    if args.growth_only:
        args.growth, models, args.no_memory = True, [], True
    for model in models:
        rows += time_model(model, tool_grid(args.tools, intervals), batch_sizes[model],
                           rounds, length, device, log)
    meta["load_after_timing"] = os.getloadavg()
    if args.no_memory:
        for r in rows:
            r["mem_ratio"] = None
    else:
        memory_rows(rows, batch_sizes, args.mem_steps, args.threads, device, log)
    for r in rows:
        if r["model"] in counts:
            r.update({k: counts[r["model"]][k] for k in ("bare_ops", "probe_ops", "probe_syncs")})
    result = {"meta": meta, "rows": rows}
    if args.growth:
        result["growth"] = growth(args.growth_tensors, args.growth_batch, rounds, length, device, log)
    meta["load_after"] = os.getloadavg()
    if not args.ops_only:
        print(table(rows))
    if counts:
        print("\n" + ops_table(list(counts.values())))
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

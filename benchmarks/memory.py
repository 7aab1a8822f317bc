"""Peak memory each tool adds to training (``mem_ratio`` of ``overhead.py``).

- CPU: peak resident memory (Linux VmHWM), one fresh process per row: the high-water mark
  is reset after the model, optimizer and batch exist, a few steps run (including a logged
  step), and (peak - baseline) is divided by the bare loop's. RSS, not torch's allocator:
  on CPU torch has no allocator statistics, and tracemalloc does not see tensor memory.
- CUDA: ``torch.cuda.max_memory_allocated`` over the same steps, in this process (the
  allocator's counters see only tensors, and the peak is reset per row).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Dict, List, Tuple

import torch
from tools import MODELS, ROOT, make_batch, make_tool


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _built(model: str, tool: str, every: int, batch_size: int, threads: int):
    torch.set_num_threads(threads)
    builder, shape, _, _ = MODELS[model]
    torch.manual_seed(0)
    return make_tool(tool, every, builder(), make_batch(shape, batch_size))


def tensor_peak_bytes(run) -> int:
    """The peak of CPU tensor bytes allocated while ``run()`` runs and not yet freed (blocks
    allocated before it and freed during it count nothing: the profiler does not know their
    size)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    sizes = []

    def walk(nodes) -> None:
        for node in nodes:
            if node.tag == _EventType.Allocation:
                sizes.append((node.start_time_ns, node.extra_fields.alloc_size))
            walk(node.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    live = peak = 0
    for _, size in sorted(sizes, key=lambda e: e[0]):  # a free is a negative size
        live += size
        peak = max(peak, live)
    return peak


def tensor_child(model: str, tool: str, every: int, batch_size: int, steps: int,
                 threads: int) -> dict:
    """One row's CPU tensor-bytes measurement (a fresh process, as ``memory_child``)."""
    t = _built(model, tool, every, batch_size, threads)
    peak = tensor_peak_bytes(lambda: [t.step(s) for s in range(steps)])
    return {"tensor_peak_kb": peak // 1024}


def memory_child(model: str, tool: str, every: int, batch_size: int, steps: int,
                 threads: int) -> dict:
    """One row's CPU measurement (run in a fresh process by ``memory_rows``)."""
    t = _built(model, tool, every, batch_size, threads)
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


def cuda_memory(model: str, tool: str, every: int, batch_size: int, steps: int, device) -> dict:
    """One row's CUDA measurement, in KiB as the CPU one."""
    builder, shape, _, _ = MODELS[model]
    torch.manual_seed(0)
    t = make_tool(tool, every, builder().to(device), make_batch(shape, batch_size, device=device))
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    after = []
    for s in range(steps):
        t.step(s)
        torch.cuda.synchronize(device)
        after.append(torch.cuda.memory_allocated(device) // 1024)
    peak = torch.cuda.max_memory_allocated(device)
    del t
    torch.cuda.empty_cache()
    return {"base_kb": base // 1024, "peak_kb": peak // 1024, "hwm_reset": True,
            "rss_kb_after_steps": after, "tensor_peak_kb": (peak - base) // 1024}


def memory_rows(rows: List[dict], batch_sizes: Dict[str, int], steps: int, threads: int,
                device, log) -> None:
    """Adds ``mem_ratio``, ``mem_added_mb`` and ``rss_growth_mb`` to the timing rows."""
    peaks: Dict[Tuple[str, str, int], dict] = {}
    for r in rows:
        if r.get("step_s") is None:
            continue
        key = (r["model"], r["tool"], r["every"])
        # Through the second logged step (step ``every``): the first (step 0) runs before the
        # optimizer has any state, so its peak is below that of every later logged step.
        n = max(steps, r["every"] + 2)
        r["mem_steps"] = n
        if torch.device(device).type == "cuda":
            peaks[key] = cuda_memory(r["model"], r["tool"], r["every"], batch_sizes[r["model"]],
                                     n, device)
            continue
        peaks[key] = {}
        for kind in ("rss", "tensors"):
            cmd = [sys.executable, __file__, r["model"], r["tool"], str(r["every"]),
                   str(batch_sizes[r["model"]]), str(n), str(threads), kind]
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if out.returncode != 0:
                log(f"  memory {key} ({kind}) failed: {out.stderr.strip().splitlines()[-1:]}")
                continue
            peaks[key].update(json.loads(out.stdout.strip().splitlines()[-1]))
    for r in rows:
        key = (r["model"], r["tool"], r["every"])
        bare = peaks.get((r["model"], "bare", 1))
        mine = peaks.get(key)
        if bare and mine and "tensor_peak_kb" in mine and "tensor_peak_kb" in bare:
            r["tensor_mem_added_mb"] = mine["tensor_peak_kb"] / 1024
            r["tensor_mem_ratio"] = mine["tensor_peak_kb"] / max(bare["tensor_peak_kb"], 1)
        if not bare or not mine or "peak_kb" not in bare or "peak_kb" not in mine:
            r["mem_ratio"] = None
            continue
        added = mine["peak_kb"] - mine["base_kb"]
        r["mem_added_mb"] = added / 1024
        r["mem_ratio"] = added / max(bare["peak_kb"] - bare["base_kb"], 1)
        rss = mine["rss_kb_after_steps"]
        r["rss_growth_mb"] = (rss[-1] - rss[1]) / 1024 if len(rss) > 2 else None


if __name__ == "__main__":  # the child process of memory_rows
    model, tool, every, batch, steps, threads = sys.argv[1:7]
    child = tensor_child if sys.argv[7:8] == ["tensors"] else memory_child
    print(json.dumps(child(model, tool, int(every), int(batch), int(steps), int(threads))))

"""benchmarks/overhead.py runs end to end at a tiny size and writes the documented JSON.
No timing assertions: timings belong to the benchmark, not to tests."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_overhead_benchmark_quick_run_writes_rows(tmp_path):
    out = tmp_path / "overhead.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--quick",
           "--models", "plain30", "--every", "1", "4", "--batch", "4", "--rounds", "1",
           "--threads", "1", "--mem-steps", "2", "--tools", "bare", "gradrepro",
           "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    keys = {"model", "tool", "every", "step_s", "ratio", "mem_ratio"}
    assert all(keys <= set(r) for r in rows)
    got = {(r["tool"], r["every"]) for r in rows}
    assert got == {("bare", 1), ("gradrepro", 1), ("gradrepro", 4)}
    for r in rows:
        assert r["model"] == "plain30"
        assert r["step_s"] > 0 and math.isfinite(r["ratio"])
    bare = next(r for r in rows if r["tool"] == "bare")
    assert bare["ratio"] == 1.0 and bare["mem_ratio"] == 1.0
    # every 4 has steps without probe code: its schedule is also paired with those
    every4 = next(r for r in rows if r["every"] == 4)
    assert every4["own_ratio"] == pytest.approx(every4["step_s"] / every4["unlogged_s"])
    assert "own_ratio" not in next(r for r in rows if r["tool"] == "gradrepro" and r["every"] == 1)
    assert "| plain30 | gradrepro | 4 |" in proc.stdout  # the printed table

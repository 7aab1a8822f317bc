"""A run of several processes, started by the run itself: ``distributed.processes=N``.

``python -m gradrepro experiment=X`` stays one command. The run (this process, which holds the
run folder's claim) starts N processes of ``train/rank_process.py`` on this machine, each the
whole pipeline (``pipeline.run_claimed``) on torch.distributed: gloo on CPU, NCCL on GPUs, over
a key-value store this process serves on a port the system chose (127.0.0.1, port 0: never a
port another program could hold, and loopback only). Process 0 writes the run folder; the others
write to a scratch folder that is removed afterwards, and print nothing.

This process watches them and ends the run whatever happens to them:

- Ctrl-C, SIGTERM or SIGHUP here is passed on to process 0 alone (the others are in their own
  session, so a terminal's Ctrl-C reaches only this process): it finishes its step, writes the
  records and a summary that says ``interrupted``, as a single-process run does.
- A process that dies or fails (``lost``): process 0 fails at its next collective and writes its
  records; one that does not within ``LOST_GRACE_S`` is stopped. The summary then says
  ``failed`` and which process was lost, how, and at what step; the command prints that line.
- When process 0 has ended, every other process still running is killed: none is left behind.

summary.json gains ``distributed``: the processes, the backend, and how each ended.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from gradrepro.errors import UserError, stop_signals
from gradrepro.records.files import SUMMARY
from gradrepro.records.untrusted import load_json, one_line
from gradrepro.train.finish import RecordsIncomplete, stub_summary, write_summary

log = logging.getLogger(__name__)

HOST = "127.0.0.1"  # the processes meet on loopback only
POLL_S = 0.1
LOST_GRACE_S = 60.0  # how long process 0 may take to notice a lost process (its next collective) and write
END_GRACE_S = 60.0  # how long the others may take to finish after process 0 completed
STOP_GRACE_S = 10.0  # between SIGTERM and SIGKILL when a process must be stopped
RESULT = "rank{}.json"  # what each process says of its end, in the scratch folder


def starts_processes(cfg: Any) -> bool:
    """Whether this run starts its processes: ``distributed.processes`` > 1 and this process is
    not one of them already (it has no process group)."""
    if int(OmegaConf.select(cfg, "distributed.processes", default=1) or 1) <= 1:
        return False
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


def backend_and_device(cfg: Any) -> tuple:
    """gloo on CPU, NCCL on GPUs (one per process); ``device=auto`` takes the GPUs where there
    are enough of them. A device that cannot hold the processes is one line."""
    world = int(cfg.distributed.processes)
    if not torch.distributed.is_available():
        raise UserError(f"distributed.processes={world} needs torch.distributed, which this torch build lacks")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.device == "cuda" and gpus < world:
        raise UserError(f"distributed.processes={world} with device=cuda needs {world} GPUs (one per process); "
                        f"this machine has {gpus}: use device=cpu (gloo) or fewer processes")
    if cfg.device == "cuda" or (cfg.device == "auto" and gpus >= world):
        return "nccl", "cuda"
    return "gloo", "cpu"


@dataclass
class Process:
    """One started process and what is known of its end."""

    rank: int
    popen: subprocess.Popen
    ended_at: Optional[float] = None
    result: Dict[str, Any] = field(default_factory=dict)
    stopped: bool = False  # ended by this process (after process 0 ended, or when it hung)

    @property
    def running(self) -> bool:
        return self.popen.poll() is None

    def how(self) -> str:
        """How it ended, in words: its own status, or the signal or exit code that ended it."""
        code = self.popen.returncode
        if code is None:
            return "still running"
        if code < 0:
            return f"ended by {signal.Signals(-code).name}" + (" (stopped by the run)" if self.stopped else "")
        status = self.result.get("status")
        if status in ("completed", "diverged", "interrupted", "device_mismatch"):
            return status
        if status == "failed":
            return f"failed: {self.result.get('error') or 'no error recorded'}"
        return f"exited with code {code} before saying how it ended"

    def lost(self, forwarded: Sequence[int]) -> bool:
        """Ended by itself other than by finishing its run (completed, diverged, interrupted):
        not stopped by this process, and not process 0 ended by a signal passed on to it."""
        code = self.popen.returncode
        if code is None or self.stopped or (self.rank == 0 and code < 0 and -code in forwarded):
            return False
        return self.result.get("status") not in ("completed", "diverged", "interrupted", "device_mismatch")


def run_processes(cfg: DictConfig, run_dir: Path, overrides: Sequence[str], start: float) -> Dict[str, Any]:
    """Run ``cfg`` as ``distributed.processes`` processes into ``run_dir`` (claimed by this
    process); returns the summary process 0 wrote, completed with how every process ended."""
    backend, device = backend_and_device(cfg)
    world = int(cfg.distributed.processes)
    scratch = Path(tempfile.mkdtemp(prefix="gradrepro-ranks-"))
    store = torch.distributed.TCPStore(HOST, 0, None, True, timeout=datetime.timedelta(seconds=60),
                                       wait_for_workers=False)
    processes: List[Process] = []
    forwarded: List[int] = []
    try:
        spec = _write_spec(cfg, device, backend, store.port, run_dir, overrides, scratch)
        with _forward_signals(processes, forwarded):
            try:
                for rank in range(world):
                    processes.append(_start(rank, spec, scratch))
                if forwarded:  # a signal while they were being started: process 0 gets it now
                    processes[0].popen.send_signal(forwarded[0])
                _watch(processes, forwarded)
            finally:
                _stop_all(processes)
        for p in processes:
            p.result = _read_result(scratch, p.rank)
    finally:
        del store
        shutil.rmtree(scratch, ignore_errors=True)
    return _finish(cfg, run_dir, overrides, start, processes, backend, forwarded)


def _write_spec(cfg: DictConfig, device: str, backend: str, port: int, run_dir: Path,
                overrides: Sequence[str], scratch: Path) -> Path:
    """What every process needs, in one file: the resolved config (with the device chosen here),
    where the store is, and the folders to write."""
    resolved = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    resolved.device = device
    OmegaConf.save(resolved, scratch / "config.yaml")
    spec = {"config": str(scratch / "config.yaml"), "backend": backend, "host": HOST, "port": port,
            "world": int(cfg.distributed.processes), "timeout_s": float(cfg.distributed.timeout_s),
            "run_dir": str(Path(run_dir).resolve()), "scratch": str(scratch), "overrides": list(overrides),
            "parent": os.getpid()}
    OmegaConf.save(OmegaConf.create(spec), scratch / "spec.yaml")
    return scratch / "spec.yaml"


def _start(rank: int, spec: Path, scratch: Path) -> Process:
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])  # the folder gradrepro is imported from
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    quiet = rank > 0
    err = open(scratch / f"rank{rank}.log", "wb") if quiet else None
    try:
        popen = subprocess.Popen([sys.executable, "-m", "gradrepro.train.rank_process", str(spec), str(rank)],
                                 env=env, start_new_session=True,  # a terminal's Ctrl-C reaches only this process
                                 stdout=subprocess.DEVNULL if quiet else None, stderr=err)
    finally:
        if err is not None:
            err.close()
    return Process(rank, popen)


def _watch(processes: List[Process], forwarded: List[int]) -> None:
    """Until process 0 has ended and the others have ended or been stopped."""
    first = processes[0]
    deadline: Optional[float] = None
    while True:
        now = time.monotonic()
        for p in processes:
            if p.ended_at is None and not p.running:
                p.ended_at = now
        if all(p.ended_at is not None for p in processes):
            return
        others_lost = any(p.ended_at is not None and p.popen.returncode != 0 for p in processes[1:])
        if first.ended_at is not None:
            # Process 0 is done: the others finish a completed run, and are stopped otherwise.
            if deadline is None:
                deadline = now + (END_GRACE_S if first.popen.returncode == 0 and not forwarded else 0.0)
        elif others_lost and deadline is None:
            deadline = now + LOST_GRACE_S  # process 0 fails at its next collective, and writes
        if deadline is not None and now >= deadline:
            return
        time.sleep(POLL_S)


def _stop_all(processes: Sequence[Process]) -> None:
    """Every process still running: SIGTERM to process 0 (its records), SIGKILL to the others
    (they ignore SIGTERM: they write nothing that matters), then SIGKILL to all; each waited for."""
    for p in processes:
        if p.running:
            p.stopped = True
            with contextlib.suppress(ProcessLookupError):
                p.popen.send_signal(signal.SIGTERM if p.rank == 0 else signal.SIGKILL)
    deadline = time.monotonic() + STOP_GRACE_S
    while any(p.running for p in processes) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    for p in processes:
        if p.running:
            with contextlib.suppress(ProcessLookupError):
                p.popen.kill()
        p.popen.wait()


@contextlib.contextmanager
def _forward_signals(processes: List[Process], forwarded: List[int]):
    """While the processes run (and are ended), a stop signal here is passed on to process 0 and
    noted in ``forwarded``; outside the main thread (some launchers) signals are left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum, frame) -> None:
        forwarded.append(signum)
        if processes and processes[0].running:
            with contextlib.suppress(ProcessLookupError):
                processes[0].popen.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in stop_signals()}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _read_result(scratch: Path, rank: int) -> Dict[str, Any]:
    try:
        result = load_json(scratch / RESULT.format(rank))
    except (OSError, ValueError):
        return {}
    return result if isinstance(result, dict) else {}


def _finish(cfg: DictConfig, run_dir: Path, overrides: Sequence[str], start: float, processes: List[Process],
            backend: str, forwarded: List[int]) -> Dict[str, Any]:
    """The run's summary: process 0's, with how each process ended; where a process was lost,
    ``failed`` and which one, how and when; where process 0 wrote none, one written here."""
    first = processes[0]
    if first.result.get("kind") == "user":  # bad input only a process could find: one line, as in one process
        raise UserError(first.result.get("error") or "a process refused the config")
    summary = _read_summary(run_dir)
    ended = {str(p.rank): p.how() for p in processes}
    # The first to end is the cause; processes noticed ending at the same poll are told apart by
    # how: one killed by a signal came first, the others then failed at their next collective.
    lost = [p for p in sorted(processes, key=_cause_first) if p.lost(forwarded)]
    if summary is None:
        status = "interrupted" if forwarded and not lost else "failed"
        summary = stub_summary(cfg, overrides, status, start, signum=forwarded[0] if forwarded else None)
    summary["wall_s"] = round(time.perf_counter() - start, 3)  # with starting the processes
    summary["distributed"] = {"processes": len(processes), "backend": backend, "ranks": ended}
    if lost and summary.get("status") != "interrupted":
        summary["status"], summary["reproduced"] = "failed", None
        summary["error"] = lost_message(lost[0], len(processes), summary, first)
    written = write_summary(run_dir, summary)
    if first.result.get("kind") == "records":
        raise RecordsIncomplete(run_dir, first.result.get("error") or "summary.json could not be written")
    return written


def _cause_first(process: Process) -> tuple:
    """Sort key: ended earlier first; at the same poll, ended by a signal before exiting."""
    code = process.popen.returncode
    return (process.ended_at or float("inf"), 0 if code is not None and code < 0 else 1, process.rank)


def lost_message(lost: Process, world: int, summary: Dict[str, Any], first: Process) -> str:
    """One line: which process was lost, how, at what step, and what process 0 then did."""
    stopped = summary.get("stopped_at")  # the step at which process 0 failed
    at = f" at step {stopped}" if isinstance(stopped, int) else ""
    then = "" if lost is first else f"; process 0 then {one_line(first.how(), 300)}"
    return one_line(f"process {lost.rank} of {world} was lost{at} ({lost.how()}){then}", 2000)


def _read_summary(run_dir: Path) -> Optional[Dict[str, Any]]:
    try:
        summary = load_json(Path(run_dir) / SUMMARY)
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None

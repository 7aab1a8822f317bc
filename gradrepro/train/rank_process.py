"""One process of a distributed run (``python -m gradrepro.train.rank_process SPEC RANK``),
started by ``train/distributed.py``, never by hand.

It joins the process group over the run's key-value store, runs the whole pipeline
(``pipeline.run_claimed``: process 0 into the run folder, the others into the scratch folder),
and says how it ended in ``rank<R>.json`` in the scratch folder: its status and, where it
failed, the error in one line (no traceback: the run's one line comes from the process that
started it). Process 0 takes stop signals as a run does (finish the step, write, stop; one
during its start-up ends it, which the starting process reads as the interruption it passed
on); the others ignore them and are ended by the starting process. A process whose starting process is
gone stops as well (process 0 as if interrupted).
"""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from gradrepro.errors import UserError, first_line, interrupt_on_stop_signals, stop_signals
from gradrepro.records.files import write_json
from gradrepro.train.finish import RecordsIncomplete
from gradrepro.train.pipeline import run_claimed

ORPHAN_POLL_S = 1.0
ORPHAN_GRACE_S = 60.0  # process 0 stopping by itself once its starting process is gone, before it is ended


def _take_signals(rank: int) -> None:
    """Process 0: SIGTERM and SIGHUP stop it like Ctrl-C until the run installs its own handlers;
    the others leave stopping to the process that started them."""
    if rank == 0:
        interrupt_on_stop_signals()
    else:
        for sig in stop_signals():
            signal.signal(sig, signal.SIG_IGN)


_orphaned = threading.Event()


def _watch_parent(parent: int, rank: int) -> None:
    """Stop when the starting process is gone (killed): nothing would end this one otherwise.
    Process 0 stops as if interrupted (the others keep answering its collectives until it has
    finished its step, then fail at their next one); any process still there after the grace
    period ends."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(ORPHAN_POLL_S)
        _orphaned.set()
        if rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # write the records, as when interrupted
        time.sleep(ORPHAN_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="gradrepro-parent-watch", daemon=True).start()


def _join(spec: Any, rank: int) -> None:
    timeout = datetime.timedelta(seconds=float(spec.timeout_s))
    store = dist.TCPStore(spec.host, int(spec.port), None, False, timeout=timeout)
    if spec.backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(spec.backend, store=store, rank=rank, world_size=int(spec.world), timeout=timeout)


def run_rank(spec_path: str, rank: int) -> Dict[str, Any]:
    """Join, run, and say how it ended (the result written to ``rank<R>.json``)."""
    start = time.perf_counter()
    spec = OmegaConf.load(spec_path)
    _take_signals(rank)
    _watch_parent(int(spec.parent), rank)
    result: Dict[str, Any] = {"rank": rank, "status": None}
    try:
        try:
            _join(spec, rank)
            run_dir = Path(spec.run_dir) if rank == 0 else Path(spec.scratch) / f"rank{rank}"
            run_dir.mkdir(parents=True, exist_ok=True)
            summary = run_claimed(OmegaConf.load(spec.config), run_dir, list(spec.overrides), start)
            result.update(status=summary.get("status"), error=summary.get("error"))
        except UserError as exc:
            result.update(status="failed", error=str(exc), kind="user")
        except RecordsIncomplete as exc:
            result.update(status="failed", error=str(exc), kind="records")
        except KeyboardInterrupt:
            result.update(status="interrupted")
        except Exception as exc:  # noqa: BLE001 - said in one line by the starting process
            result.update(status="failed", error=first_line(f"{type(exc).__name__}: {exc}"))
    finally:
        _leave()
        _write_result(Path(spec.scratch) / f"rank{rank}.json", result)
        if _orphaned.is_set() and rank == 0:  # nobody else will remove the scratch folder
            shutil.rmtree(spec.scratch, ignore_errors=True)
    return result


def _leave() -> None:
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a group whose peer is gone may not close cleanly
        pass


def _write_result(path: Path, result: Dict[str, Any]) -> None:
    try:
        write_json(path, result)
    except OSError:
        pass  # the starting process then reads the exit code alone


def main(argv: list) -> int:
    result = run_rank(argv[1], int(argv[2]))
    return 0 if result.get("status") in ("completed", "diverged", "interrupted", "device_mismatch") else 1


if __name__ == "__main__":
    sys.stdout.flush()
    code = main(sys.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: a thread blocked on a lost peer must not hold the exit

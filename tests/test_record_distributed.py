"""gradrepro.record under torch.distributed, two processes on CPU (gloo): DDP, FSDP2's
fully_shard and a plain all-reduce loop record the same per-module statistics as one process
training on the same global batch; a local shard's norm does not; bad setups are one line.

One pair of processes runs every scenario (starting processes is the cost); the tests read
what they wrote. Every process is joined or killed in the fixture's finally."""

from __future__ import annotations

import datetime
import json
import os
import socket
import traceback

import numpy as np
import pandas as pd
import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import gradrepro

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")

WORLD, STEPS, BATCH = 2, 4, 16
SCENARIOS = ("ddp", "fsdp", "plain")
COMPARED = ("grad_norm", "fresh_grad_norm", "param_norm", "update_to_param", "grad_std", "frac_zero",
            "frac_nonfinite", "frac_fp16_underflow", "act_mean", "act_std")


def mlp() -> nn.Module:
    """A small MLP with two dead ReLU units: their rows of fc1 and columns of fc2 get exact
    zero gradients, so the zero counts are not trivially 0."""
    torch.manual_seed(0)
    net = nn.Sequential()
    net.add_module("fc1", nn.Linear(6, 8))
    net.add_module("act", nn.ReLU())
    net.add_module("fc2", nn.Linear(8, 5))
    with torch.no_grad():
        net.fc1.weight[:2] = 0.0
        net.fc1.bias[:2] = -1.0
    return net


def global_batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 6, generator=g), torch.randint(0, 5, (BATCH,), generator=g)) for _ in range(STEPS)]


def adam(params):
    return torch.optim.Adam(params, lr=0.01, weight_decay=0.01)


def train(model, opt, data, after_backward=None):
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if after_backward is not None:
            after_backward()
        opt.step()


def read(run_dir):
    return json.loads((run_dir / "summary.json").read_text()), pd.read_parquet(run_dir / "modules.parquet")


# -- the two processes ----------------------------------------------------------------------


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.makedirs(out, exist_ok=True)
    notes = {}
    try:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                             world_size=WORLD, timeout=datetime.timedelta(seconds=60))
        half = BATCH // WORLD
        data = [(x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]) for x, y in global_batches()]
        _ddp(data, out)
        notes["naive_fc1_norm"], sharded = _fsdp(data, out)
        _plain(data, out)
        _plain(data, out, "diverged", rank_1_stops_averaging_at=2)
        notes["sharded_after"] = _error(lambda: _sharded_after_attach(data, out))
        notes["missing_rank"] = _error(lambda: _recorder_on_rank0_only(rank, data, out))
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        notes["no_group"] = _error(lambda: gradrepro.record(sharded, adam(sharded.parameters()),
                                                            os.path.join(out, f"no_group{rank}")))
    except Exception:  # noqa: BLE001 - the test reads what went wrong
        notes["crash"] = traceback.format_exc()
    finally:
        with open(os.path.join(out, f"notes{rank}.json"), "w") as f:
            json.dump(notes, f)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _error(fn):
    try:
        fn()
    except gradrepro.errors.UserError as exc:
        return str(exc)
    return None


def _ddp(data, out):
    ddp = nn.parallel.DistributedDataParallel(mlp())
    opt = adam(ddp.parameters())
    with gradrepro.record(ddp, opt, os.path.join(out, "ddp"), every=1):
        train(ddp, opt, data)


def _fsdp(data, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    mesh = init_device_mesh("cpu", (WORLD,))
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model.fc2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = adam(model.parameters())
    naive = []  # what logging this process's shard would report (pytorch/pytorch#170862)
    with gradrepro.record(model, opt, os.path.join(out, "fsdp"), every=1):
        train(model, opt, data, lambda: naive.append(float(model.fc1.weight.grad.to_local().norm())))
    return naive, model


def _plain(data, out, name="plain", rank_1_stops_averaging_at=None):
    model = mlp()
    opt = adam(model.parameters())
    rank, steps = torch.distributed.get_rank(), []

    def average_grads():
        steps.append(None)
        for p in model.parameters():
            torch.distributed.all_reduce(p.grad)
            if rank == 1 and rank_1_stops_averaging_at is not None and len(steps) > rank_1_stops_averaging_at:
                p.grad.zero_()  # a bug on one process: its replicas go their own way
            p.grad /= WORLD

    with gradrepro.record(model, opt, os.path.join(out, name), every=1, every_rank=name == "plain"):
        train(model, opt, data, average_grads)


def _sharded_after_attach(data, out):
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    opt = adam(model.parameters())
    rec = gradrepro.record(model, opt, os.path.join(out, "late"), every=1)
    fully_shard(model)
    try:
        train(model, adam(model.parameters()), data[:1])
        rec.optimizer.step()  # the recorder's optimizer: its hook reads the replaced parameters
    finally:
        rec.close()


def _recorder_on_rank0_only(rank, data, out):
    if rank != 0:
        return
    model = mlp()
    opt = adam(model.parameters())
    with gradrepro.record(model, opt, os.path.join(out, "alone"), every=1, timeout=2):
        train(model, opt, data[:1])


# -- the parent ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"  # fork: no second torch import
    ctx = mp.start_processes(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=False,
                             start_method=method)
    try:
        deadline = 300  # seconds: a hang guard (the run itself needs about 25 s of CPU)
        while not ctx.join(timeout=1):
            deadline -= 1
            assert deadline > 0, "the two processes did not finish"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    notes = [json.loads((out / f"notes{r}.json").read_text()) for r in range(WORLD)]
    for note in notes:
        assert "crash" not in note, note["crash"]
    return out, notes


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The same model and optimizer in one process on the whole global batch."""
    out = tmp_path_factory.mktemp("single") / "single"
    model = mlp()
    opt = adam(model.parameters())
    with gradrepro.record(model, opt, out, every=1):
        train(model, opt, global_batches())
    return read(out)[1]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_distributed_record_equals_one_process_on_the_global_batch(two_processes, one_process, scenario):
    out, _ = two_processes
    summary, modules = read(out / scenario)
    assert summary["status"] == "completed" and summary["ranks"] == WORLD and summary["steps"] == STEPS
    assert "ranks_disagree" not in summary and "ranks_nonfinite" not in summary
    key = ["step", "module", "param"]
    assert list(modules[key].itertuples(index=False)) == list(one_process[key].itertuples(index=False))
    assert list(modules["grad_state"]) == list(one_process["grad_state"])
    assert (one_process["frac_zero"] > 0).any()  # the dead units: the zero counts are compared, not 0 = 0
    for column in COMPARED:  # float rounding: the collective and the shards sum in another order
        np.testing.assert_allclose(modules[column], one_process[column], rtol=1e-5, atol=1e-7, err_msg=column)


def test_the_local_shard_norm_differs_and_the_record_does_not(two_processes, one_process):
    out, notes = two_processes
    full = one_process.query("module == 'fc1' and param == 'weight'")["grad_norm"].to_numpy()
    _, fsdp = read(out / "fsdp")
    recorded = fsdp.query("module == 'fc1' and param == 'weight'")["grad_norm"].to_numpy()
    np.testing.assert_allclose(recorded, full, rtol=1e-5)
    for note in notes:  # each shard holds half the rows: its norm is a part, not the whole
        naive = np.asarray(note["naive_fc1_norm"])
        assert np.all(np.abs(naive - full) > 0.05 * full), (naive, full)
    # The shards' squares add up to the whole: the parts are right, only their norm is not the norm.
    both = np.asarray(notes[0]["naive_fc1_norm"]) ** 2 + np.asarray(notes[1]["naive_fc1_norm"]) ** 2
    np.testing.assert_allclose(np.sqrt(both), full, rtol=1e-5)


def test_rank_zero_writes_and_other_ranks_only_when_asked(two_processes):
    out, _ = two_processes
    assert not (out / "ddp-rank1").exists() and not (out / "fsdp-rank1").exists()
    summary, modules = read(out / "plain-rank1")  # every_rank=True: its own folder, the same statistics
    assert summary["rank"] == 1
    zero = read(out / "plain")[1]
    own = [c for c in zero.columns if not c.startswith("act_")]  # activations: each process's own sample
    pd.testing.assert_frame_equal(modules[own], zero[own])


def test_a_process_whose_replicas_diverge_is_named_in_the_summary(two_processes):
    out, _ = two_processes
    summary, _ = read(out / "diverged")
    assert summary["ranks_disagree"] == {"1": 2}  # the first logged step its gradients differed


def test_bad_distributed_setups_are_one_line(two_processes):
    _, notes = two_processes
    for note in notes:
        assert "DTensors but no process group is initialised" in note["no_group"]
    for note in notes:
        assert "replaced after gradrepro.record was attached" in note["sharded_after"]
    assert "not created on rank(s) [1] of 2" in notes[0]["missing_rank"]
    assert notes[1]["missing_rank"] is None


def test_shard_summaries_combine_to_the_full_tensors_statistics():
    """Uneven shards (one empty) of one tensor and a replica held by every process: the
    combined sums, counts, mean and spread are the full tensor's, the replica counted once."""
    from gradrepro.probe.shards import FIELDS, combine_rows

    rng = np.random.default_rng(0)
    full = rng.normal(3.0, 0.01, size=101)  # a large mean over a small spread
    full[:7] = 0.0
    parts = np.split(full, [60, 60])  # 60, 0 and 41 entries
    replica = rng.normal(size=9)
    every = np.zeros((3, len(FIELDS), 2))
    f = {name: i for i, name in enumerate(FIELDS)}
    for rank, part in enumerate(parts):
        for t, (values, counted) in enumerate(((part, 1.0), (replica, float(rank == 0)))):
            row = every[rank, :, t]
            row[f["n"]], row[f["have"]], row[f["counted"]] = len(values), 1.0, counted
            row[f["g_mean"]] = values.mean() if len(values) else np.nan
            row[f["g_ssd"]] = ((values - values.mean()) ** 2).sum() if len(values) else 0.0
            row[f["g_sumsq"]] = row[f["p_sumsq"]] = (values ** 2).sum()
            row[f["zeros"]] = (values == 0).sum()
    out = combine_rows(every)
    for t, values in enumerate((full, replica)):
        assert out["n"][t] == len(values) and out["zeros"][t] == (values == 0).sum()
        np.testing.assert_allclose(out["g_sumsq"][t], (values ** 2).sum(), rtol=1e-12)
        np.testing.assert_allclose(out["g_mean"][t], values.mean(), rtol=1e-12)
        np.testing.assert_allclose(out["g_ssd"][t], ((values - values.mean()) ** 2).sum(), rtol=1e-9)

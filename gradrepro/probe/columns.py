"""The host side of a logged step: ``modules.parquet``'s columns from the per-block rows of the
one transfer (float64 sums by tensor and by module, probe/blocks.py). ``reducer`` is the
``reducer.Reducer`` of the step (not imported here: it imports this module), ``buffers`` the
``buffers.StepBuffers`` whose blocks were reduced, ``tensors`` the ``tensors.ProbedTensors``."""

from __future__ import annotations

from typing import Any, Dict

import numpy as np
import torch

from gradrepro.probe.blocks import segment_counts, segment_moments, segment_nonzero_counts, segment_squares
from gradrepro.probe.kernels import HIST_COLUMNS, robust_norms, std_from_ssd
from gradrepro.probe.stash import Stash
from gradrepro.probe.states import FP16_FLUSH, grad_states


def gradient_columns(reducer: Any, buffers: Any, step: int, host: Dict[str, np.ndarray],
                     pending: dict) -> Dict[str, np.ndarray]:
    stats = local_gradient_stats(buffers, reducer.bf16, host, pending)
    if reducer.combiner is not None:  # the full tensors' statistics, from every process's part
        stats = reducer.combiner.combine(step, stats, reducer.counted, reducer.plain, reducer.collective_device)
    return _columns(reducer, step, stats, host)


def local_gradient_stats(buffers: Any, bf16: bool, host: Dict[str, np.ndarray], pending: dict) -> Dict[str, np.ndarray]:
    """Per tensor, what this process holds of it (``shards.FIELDS``): its entries, the
    gradient's mean, spread and sums of squares, its counts; zeros where it has no gradient."""
    n, layout = len(buffers.tensors), buffers.layout
    rows = dict(zip(buffers.stats.names, host["params"]))
    have_idx = np.asarray(pending["have"], dtype=np.int64)
    have = np.zeros(n, dtype=bool)
    have[have_idx] = True
    numel = layout.numel.astype(np.float64)
    mean, ssd, sumsq = segment_moments(layout, rows, "g_")
    zeros, small = segment_counts(layout, rows, "g_")
    fresh = segment_squares(layout, rows, "f_") if pending["carried"] else sumsq
    nonzero = np.where(have, numel - zeros, 0.0)
    small = np.where(have, small, 0.0)
    nonfinite = np.zeros(n)
    _recount_nonfinite(have_idx, np.sqrt(sumsq), pending["grads"], nonfinite, nonzero, small)
    lost = layout.segment_sum(rows["b_lost"]) if "b_lost" in rows and bf16 else np.full(n, np.nan)
    keep = lambda v: np.where(have, v, 0.0)  # noqa: E731 - a stale buffer's values never count
    return {"n": numel, "have": have.astype(np.float64), "g_mean": keep(mean), "g_ssd": keep(ssd),
            "g_sumsq": keep(sumsq), "f_sumsq": keep(fresh), "p_sumsq": segment_squares(layout, rows, "p_"),
            "u_sumsq": segment_squares(layout, rows, "u_"), "zeros": numel - nonzero, "small": small,
            "nonfinite": nonfinite, "bf16_lost": keep(lost)}


def _columns(reducer: Any, step: int, stats: Dict[str, np.ndarray],
             host: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    tensors = reducer.tensors
    n, numel = len(tensors), stats["n"]
    have = stats["have"] > 0
    g_norm = np.where(have, np.sqrt(stats["g_sumsq"]), np.nan)
    g_std = np.where(have & np.isfinite(g_norm), std_from_ssd(stats["g_ssd"], numel), np.nan)
    fresh_norm = np.where(have, np.sqrt(stats["f_sumsq"]), np.nan)
    p_norm, u_norm = np.sqrt(stats["p_sumsq"]), np.sqrt(stats["u_sumsq"])
    nonzero = np.where(have, numel - stats["zeros"], 0.0)
    small, nonfinite = stats["small"], stats["nonfinite"]
    safe_numel = np.maximum(numel, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        # A zero-initialised tensor (a bias, BN's beta) has no meaningful ratio: NaN.
        safe_p = np.where(p_norm > 0, p_norm, np.nan)
        g_to_p = g_norm / safe_p
        u_to_p = u_norm / safe_p
        g_to_decay = g_to_p / reducer.weight_decay if reducer.weight_decay > 0 else np.full(n, np.nan)
        flush = np.where(nonzero > 0, (small - (numel - nonzero)) / nonzero, np.nan)
        # Of the entries the gradient reached, those whose update bf16 weights round away.
        bf16 = np.where(have & (nonzero > 0), stats["bf16_lost"] / nonzero, np.nan)
    resid = host.get("residuals", np.full((2, n), np.nan))
    return {
        "step": np.full(n, step, dtype=np.int64),
        "module": np.array(tensors.module_of, dtype=object),
        "param": np.array(tensors.param_of, dtype=object),
        "param_type": np.array(tensors.kind_of, dtype=object),
        "numel": numel.astype(np.int64),
        "grad_state": grad_states(have, nonfinite, nonzero, g_to_p, p_norm, reducer.cfg.tiny_factor),
        "grad_norm": g_norm,
        # This step's backward alone; equals grad_norm unless .grad carried a sum in.
        "fresh_grad_norm": fresh_norm,
        # Over the first probe.running_sum_steps steps (NaN after): the step taken, read as
        # a gradient (update / lr), against the fresh gradient and against the probe's own
        # running sum of fresh gradients; ||a - b|| / ||b||. Plain SGD (no momentum or weight
        # decay) steps with the fresh gradient when zero_grad runs, with the sum when it does not.
        "step_vs_fresh": resid[0],
        "step_vs_running_sum": resid[1],
        "grad_std": g_std,
        "param_norm": p_norm,
        "grad_to_param": g_to_p,
        "update_to_param": u_to_p,
        "grad_to_decay": g_to_decay,
        "frac_none": (~have).astype(np.float64),
        "frac_zero": np.where(have, (numel - nonzero) / safe_numel, np.nan),
        "frac_nonfinite": np.where(have, nonfinite / safe_numel, np.nan),
        "frac_fp16_underflow": flush,
        "frac_bf16_update_lost": bf16,
    }


def _recount_nonfinite(have_idx, g_norm, grads, nonfinite, nonzero, small) -> None:
    """Where a gradient's norm is not finite (NaN or inf entries: the level sums skipped
    their NaN pass), count exactly from the gradient itself, all such tensors in one more
    transfer. Rare: a step that diverged, or fp16 overflow that the scaler will skip."""
    bad = np.flatnonzero(~np.isfinite(g_norm[have_idx]))
    if not len(bad):
        return
    counts = torch.stack([torch.stack([(~torch.isfinite(g)).sum(), torch.count_nonzero(g),
                                       (g.float().abs() <= FP16_FLUSH).sum()])
                          for g in (grads[j] for j in bad)])
    counts = counts.to("cpu", copy=True).numpy().astype(np.float64)
    idx = have_idx[bad]
    nonfinite[idx], nonzero[idx], small[idx] = counts[:, 0], counts[:, 1], counts[:, 2]


def _per_module(stash: Stash, modules, host_rows: np.ndarray):
    """Per row of ``modules``, the segment of its module in ``stash`` (or -1: not recorded
    this step), and the stash's rows by name."""
    seg = np.array([stash.index[m] if m in stash.seen else -1 for m in modules], dtype=np.int64)
    return seg, dict(zip(stash.stats.names, host_rows))


def _pick(values: np.ndarray, seg: np.ndarray) -> np.ndarray:
    return np.append(values, np.nan)[seg]  # -1 picks the appended NaN


def activation_columns(tensors: Any, cfg: Any, buffers: Any, contributions: Dict[str, tuple],
                       host: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    mods = tensors.module_of
    nan = np.full(len(mods), np.nan)
    columns = {"act_mean": nan, "act_std": nan, "act_grad_std": nan,
               "act_grad_frac_zero": nan, "act_grad_frac_fp16_underflow": nan}
    if "acts" in host:
        seg, rows = _per_module(buffers.acts, mods, host["acts"])
        layout = buffers.acts.layout
        mean, ssd, _ = segment_moments(layout, rows, "")
        columns["act_mean"] = _pick(mean, seg)
        columns["act_std"] = _pick(std_from_ssd(ssd, layout.numel), seg)
    if "act_grads" in host:
        ag = buffers.act_grads
        seg, rows = _per_module(ag, mods, host["act_grads"])
        layout = ag.layout
        _, ssd, _ = segment_moments(layout, rows, "")
        zeros, small = segment_nonzero_counts(layout, rows, "")
        numel = layout.numel.astype(np.float64)
        scale = np.array([ag.seen.get(name, np.nan) for name in ag.index], dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            nonzero = numel - zeros
            columns["act_grad_std"] = _pick(std_from_ssd(ssd, numel) / scale, seg)
            columns["act_grad_frac_zero"] = _pick(zeros / numel, seg)
            columns["act_grad_frac_fp16_underflow"] = _pick(
                np.where(nonzero > 0, (small - zeros) / nonzero, np.nan), seg)
    if "hist" in host:
        columns.update({col: host["hist"][:, j] for j, col in enumerate(HIST_COLUMNS)})
    if cfg.per_example:
        per_example = host.get("per_example", np.full((len(mods), 2), np.nan))
        columns["pe_act_grad_var"] = per_example[:, 0]
        columns["pe_grad_var"] = per_example[:, 1]
    for name, (reached, _) in contributions.items():
        norms = np.full(len(mods), np.nan)  # NaN: the term sends nothing to the tensor
        if reached:
            norms[reached] = robust_norms(host[f"contrib_{name}"], tensors.numel[reached])
        columns[f"contrib_{name}"] = norms
    return columns

"""gradrepro.lightning.Record with Lightning's ``gradient_clip_val``: ``grad_norm`` is the norm of
the gradient the optimizer used, after the clip, as the README defines it."""

from __future__ import annotations

import pandas as pd
import pytest

pl = pytest.importorskip("lightning.pytorch")

from test_lightning import Tiny, loader  # noqa: E402 - after the skip

from gradrepro.lightning import Record  # noqa: E402


def fit_clipped(run_dir, clip, accumulate: int = 1) -> pd.DataFrame:
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=clip,
                         accumulate_grad_batches=accumulate, callbacks=[Record(run_dir, every=1)])
    trainer.fit(Tiny(), loader())
    return pd.read_parquet(run_dir / "scalars.parquet")


@pytest.mark.parametrize("accumulate", [1, 2])
def test_grad_norm_is_recorded_after_lightnings_clip(tmp_path, accumulate):
    clip = 1e-3
    clipped = fit_clipped(tmp_path / "clipped", clip, accumulate)
    free = fit_clipped(tmp_path / "free", None, accumulate)
    assert len(clipped) == len(free) == 4
    assert (free["grad_norm"] > 10 * clip).all(), free["grad_norm"]  # the clip binds at every step
    assert clipped["grad_norm"].to_numpy() == pytest.approx([clip] * 4, rel=1e-3)

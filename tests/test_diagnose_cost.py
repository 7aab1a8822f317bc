"""diagnose's memory: the transition keeps one copy of the parameters as they were before the
call, and takes a second copy only of a tensor the forward pass itself changed
(``nn.Embedding(max_norm=...)`` renormalises rows), so that a large model is not held twice."""

from __future__ import annotations

import torch
from torch import nn

from gradrepro.diagnose.registration import parameter_rows
from gradrepro.diagnose.transition import run_transition


class MaxNormEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, max_norm=1.0)
        self.head = nn.Linear(4, 3)

    def forward(self, idx):
        return self.head(self.emb(idx))


def test_the_step_starts_from_the_copy_before_the_call_unless_the_forward_pass_moved_the_tensor():
    torch.manual_seed(0)
    model = MaxNormEmbedding()
    with torch.no_grad():
        model.emb.weight.mul_(3.0)  # rows above max_norm: the forward pass renormalises those it reads
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    idx, y = torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2])
    rows, _, nonleaf = parameter_rows(model, opt)
    tr = run_transition(model, opt, lambda: nn.functional.cross_entropy(model(idx), y), rows, nonleaf,
                        step=True, tiny_factor=1e4, rtol=1e-3, probe_paths=False)
    moved = {r.name: bool(m) for r, m in zip(rows, tr.forward_changed)}
    assert moved == {"emb.weight": True, "head.weight": False, "head.bias": False}
    for r, start, before, m in zip(rows, tr.at_step, tr.before, tr.forward_changed):
        assert (start.untyped_storage().data_ptr() == before.untyped_storage().data_ptr()) is not bool(m), r.name
    assert tr.matches.all()  # the update check still predicts every change from where the step began

"""The first forward pass names what actually went wrong: a device mismatch (a tensor the
model holds but never registered is not moved by ``.to(device)``), a dtype mismatch, a shape
mismatch, with the devices, dtypes and shapes involved; never a guess about num_classes. The
check changes nothing: buffers, modes and random state are as before."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradrepro.data.base import ImageData
from gradrepro.errors import UserError
from gradrepro.objectives.base import LossOutput
from gradrepro.recipe.forward_check import check_forward


class Classify:
    def __call__(self, net, batch):
        return LossOutput(F.cross_entropy(net(batch.x), batch.y))


class Net(nn.Module):
    def __init__(self, extra: torch.Tensor | None = None, width: int = 16) -> None:
        super().__init__()
        self.flat = nn.Flatten()
        self.body = nn.Linear(width, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)
        self.extra = extra  # a plain attribute: not a parameter, not a buffer

    def forward(self, x):
        h = self.bn(self.body(self.flat(x)))
        if self.extra is not None:
            h = h * self.extra
        return self.head(h)


def data(n: int = 8, batch: int = 4) -> ImageData:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 1, 4, 4, generator=g), torch.randint(0, 3, (n,), generator=g)
    return ImageData(x, y, x, y, batch, views=False)


def refused(net, d=None) -> str:
    with pytest.raises(UserError) as error:
        check_forward(Classify(), net, d or data(), seed=0)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_a_device_mismatch_is_named_with_the_devices():
    # On a CPU-only machine the meta device stands in for a GPU: a plain tensor attribute
    # stays where it was made while the model's parameters are elsewhere.
    # (missing_grad/tensor_attribute's defect: a requires-grad tensor that is no Parameter).
    message = refused(Net(extra=torch.ones(8, device="meta", requires_grad=True)))
    assert "a device mismatch" in message and "cpu" in message
    assert "not registered (not moved by .to(device)): extra (meta float32)" in message
    assert "num_classes" not in message


def test_a_dtype_mismatch_is_named_with_the_dtypes():
    message = refused(Net().double())
    assert "a dtype mismatch" in message and "float64" in message and "float32" in message
    assert "num_classes" not in message


def test_a_shape_mismatch_is_named_with_the_shapes():
    message = refused(Net(width=20))
    assert "a shape mismatch" in message and "(4, 1, 4, 4)" in message


def test_a_batch_of_one_with_batchnorm_is_named():
    message = refused(Net(), data(n=1, batch=1))
    assert "batch of one example" in message and "BatchNorm" in message


def test_labels_beyond_the_outputs_are_named():
    d = data()
    d.y_train = d.y_train + 5
    message = refused(Net(), d)  # here the classes are the problem, and the line says so
    assert "labels beyond the model's outputs" in message and "model.num_classes" in message


def test_the_check_changes_nothing():
    net, d = Net(), data()
    net.train()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    rng = torch.get_rng_state()
    check_forward(Classify(), net, d, seed=0)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state()) and net.training and net.bn.training

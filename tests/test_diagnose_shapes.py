"""diagnose on minimal reconstructions of real-world code: the failure classes of public "my
parameters don't learn" reports, each found on the tensor it concerns (and gone once
repaired), and healthy models from real code, each clean with every update matching its
rule."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.nn.utils import parametrizations

from gradrepro.diagnose import DiagnoseError, diagnose

torch.set_num_threads(1)
G = torch.Generator().manual_seed(0)
X, Y = torch.randn(16, 6, generator=G), torch.randint(0, 3, (16,), generator=G)
IDX = torch.randint(0, 10, (16,), generator=G)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def ce(model, x=X, y=Y):
    return lambda: F.cross_entropy(model(x), y)


def flagged(report):
    return {(f.kind, f.name) for f in report.flagged()}


def kinds(report):
    return {(f.kind, f.name) for f in report.findings}


def assert_clean(report):
    """No error or warning, and every tensor the optimizer stepped moved as its rule predicts."""
    assert report.ok and not report.flagged(), str(report)
    stepped = report.table[report.table["in_optimizer"] & report.table["requires_grad"]]
    assert (stepped["update_ok"] == 1).all(), str(report)


# --- an orphaned leaf: a Parameter converted as it is assigned ---------------------------------

class Scaled(nn.Module):
    def __init__(self, make_scale):
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.head = nn.Linear(6, 8), nn.Linear(8, 3)
        self.scale = make_scale()

    def forward(self, x):
        return self.head(torch.tanh(self.enc(x)) * self.scale.to(x.dtype))


ORPHANS = {
    "double": lambda: nn.Parameter(torch.ones(8)).double(),
    "to_dtype": lambda: nn.Parameter(torch.ones(8)).to(torch.float64),
    "half": lambda: nn.Parameter(torch.ones(8)).half(),
    "plain_leaf_converted": lambda: torch.ones(8, requires_grad=True).double(),
}


@pytest.mark.parametrize("how", sorted(ORPHANS))
def test_orphaned_leaf_is_an_error_on_the_attribute(how):
    model = Scaled(ORPHANS[how])
    report = diagnose(model, torch.optim.SGD(model.parameters(), lr=0.1), ce(model))
    assert flagged(report) == {("orphaned_leaf", "scale")}, str(report)
    assert ("nonleaf_grad", "scale") not in kinds(report)  # not called "not a disconnection"
    detail = next(f.detail for f in report.findings if f.kind == "orphaned_leaf")
    assert "never trains" in detail and ".double()" in detail
    repaired = Scaled(lambda: nn.Parameter(torch.ones(8, dtype=torch.float64)))
    assert_clean(diagnose(repaired, torch.optim.SGD(repaired.parameters(), lr=0.1), ce(repaired)))


def test_orphaned_leaf_that_the_optimizer_holds_is_still_an_error():
    leaf = nn.Parameter(torch.ones(8))
    model = Scaled(lambda: leaf.double())
    report = diagnose(model, torch.optim.SGD([*model.parameters(), leaf], lr=0.1), ce(model))
    assert flagged(report) == {("orphaned_leaf", "scale")}
    assert "the forward pass uses the copy" in str(report)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_orphaned_leaf_moved_with_cuda():
    model = Scaled(lambda: nn.Parameter(torch.ones(8)).cuda())
    model.enc.cuda(), model.head.cuda()
    x, y = X.cuda(), Y.cuda()
    report = diagnose(model, torch.optim.SGD(model.parameters(), lr=0.1), ce(model, x, y))
    assert ("orphaned_leaf", "scale") in flagged(report)


def test_cached_intermediate_is_not_an_orphan():
    model = mlp()
    model.cached = torch.tanh(model[0](X))  # computed from registered weights: information only
    report = diagnose(model, torch.optim.SGD(model.parameters(), lr=0.1), ce(model))
    assert_clean(report)
    assert ("nonleaf_grad", "cached") in kinds(report)


# --- the gradient changed between backward and the step ----------------------------------------

def _pre_hook(model, edit):
    def hook(optimizer, args, kwargs):
        with torch.no_grad():
            for p in model.parameters():
                edit(p)
    return hook


GRAD_EDITS = {
    # name: (edit of every .grad before the step, words the finding uses)
    "sign_flipped": (lambda p: p.grad.neg_(), "uphill"),
    "zeroed": (lambda p: p.grad.zero_(), "set to zero"),
    "nonfinite": (lambda p: p.grad.fill_(float("nan")), "non-finite"),
    "rotated": (lambda p: p.grad.copy_(-p.grad.flip(-1) - p.grad), "no longer descends"),
}


@pytest.mark.parametrize("edit", sorted(GRAD_EDITS))
def test_a_gradient_rewritten_before_the_step_is_an_error_and_says_how(edit):
    change, words = GRAD_EDITS[edit]
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.register_step_pre_hook(_pre_hook(model, change))
    report = diagnose(model, opt, ce(model))
    names = {n for n, _ in model.named_parameters()}
    assert {n for k, n in flagged(report) if k == "grad_modified"} == names, str(report)
    assert not report.ok and words in str(report)
    assert "update_mismatch" not in {k for k, _ in flagged(report)}  # judged against the gradient used


def test_clipping_is_information_and_the_update_is_judged_against_the_clipped_gradient():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def clip(optimizer, args, kwargs):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)

    opt.register_step_pre_hook(clip)
    report = diagnose(model, opt, ce(model))
    assert_clean(report)
    (note,) = [f for f in report.findings if f.kind == "grad_scaled"]
    assert note.name == "<model>" and "scaled by" in note.detail


def test_a_hook_on_the_tensor_during_backward_is_found():
    model = mlp()
    model[2].weight.register_hook(lambda g: -g)
    report = diagnose(model, torch.optim.SGD(model.parameters(), lr=0.1), ce(model))
    assert flagged(report) == {("grad_modified", "2.weight")}, str(report)
    assert "during backward" in str(report)
    assert report.table.set_index("name").loc["2.weight", "grad_state"] == "finite"  # the loss's own gradient


def test_a_post_accumulate_hook_that_zeroes_is_found():
    model = mlp()

    def zero(p):
        p.grad.zero_()

    model[0].bias.register_post_accumulate_grad_hook(zero)
    report = diagnose(model, torch.optim.SGD(model.parameters(), lr=0.1), ce(model))
    assert flagged(report) == {("grad_modified", "0.bias")}, str(report)


def test_a_custom_optimizer_that_rescales_inside_its_step_is_judged_on_what_it_used():
    class HalvingSGD(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad.mul_(0.5)
            return super().step(closure)

    model = mlp()
    report = diagnose(model, HalvingSGD(model.parameters(), lr=0.1), ce(model))
    assert_clean(report)
    assert "0.5" in next(f.detail for f in report.findings if f.kind == "grad_scaled")


# --- a module that rewrites its own weight in forward ----------------------------------------

class MaxNormEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 4, max_norm=1.0)
        self.head = nn.Linear(4, 3)

    def forward(self, idx):
        return self.head(self.emb(idx))


@pytest.mark.parametrize("make_opt", [lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=1e-2),
                                      lambda p: torch.optim.AdamW(p, lr=1e-2)])
def test_embedding_max_norm_trains_normally_and_is_noted(make_opt):
    model = MaxNormEmbedding()
    report = diagnose(model, make_opt(model.parameters()), ce(model, IDX))
    assert_clean(report)
    assert ("changed_in_forward", "emb.weight") in kinds(report)


# --- lazy modules ----------------------------------------------------------------------------

def test_lazy_module_is_initialised_by_one_dry_run_and_diagnosed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(8), nn.Tanh(), nn.LazyLinear(3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # built before the first forward
    report = diagnose(model, opt, ce(model))
    assert_clean(report)
    assert tuple(model[0].weight.shape) == (8, 6) and report.table["changed"].all()
    assert any("lazy" in n for n in report.notes)


def test_lazy_module_that_the_closure_cannot_initialise_is_one_error():
    model = nn.Sequential(nn.LazyLinear(8), nn.Tanh(), nn.Linear(7, 3))  # 8 outputs into 7 inputs: fails
    with pytest.raises(DiagnoseError) as info:
        diagnose(model, torch.optim.SGD(model.parameters(), lr=0.1), ce(model))
    assert "model(example_batch)" in str(info.value) and "\n" not in str(info.value)
    class Spare(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.spare = nn.Linear(6, 3), nn.LazyLinear(3)  # spare: never called

        def forward(self, x):
            return self.used(x)

    unused = Spare()
    with pytest.raises(DiagnoseError, match="still not initialised"):
        diagnose(unused, torch.optim.SGD(unused.parameters(), lr=0.1), ce(unused))


# --- sparse gradients ------------------------------------------------------------------------

class Factorisation(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.users, self.items = nn.Embedding(10, 4, sparse=True), nn.Embedding(12, 4, sparse=True)

    def forward(self, u, i):
        return (self.users(u) * self.items(i)).sum(-1)


def test_sparse_embeddings_with_sparse_adam():
    model = Factorisation()
    u, i = IDX, torch.randint(0, 12, (16,), generator=torch.Generator().manual_seed(1))
    target = torch.randn(16, generator=torch.Generator().manual_seed(2))
    opt = torch.optim.SparseAdam(model.parameters(), lr=1e-2)
    for _ in range(2):  # the moments are not empty
        opt.zero_grad()
        F.mse_loss(model(u, i), target).backward()
        opt.step()
    report = diagnose(model, opt, lambda: F.mse_loss(model(u, i), target))
    assert_clean(report)
    assert (report.table["update_rel_err"] < 1e-3).all()


def test_sparse_embedding_with_sgd_and_unused_rows():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 4, sparse=True), nn.Linear(4, 3))  # most rows are not looked up
    assert_clean(diagnose(model, torch.optim.SGD(model.parameters(), lr=0.1), ce(model, IDX)))


# --- zero gradients with a known cause: a zero-initialised weight downstream --------------------

def test_zero_initialised_head_is_named_once_instead_of_errors_upstream():
    model = mlp()
    nn.init.zeros_(model[2].weight)
    report = diagnose(model, torch.optim.SGD(model.parameters(), lr=0.1), ce(model))
    assert_clean(report)
    (note,) = [f for f in report.findings if f.kind == "zero_init"]
    assert note.name == "2.weight" and "0.weight" in note.detail
    assert set(report.table.loc[report.table["grad_state"] == "zero", "zero_because"]) == {"2.weight"}


def test_a_zero_weight_that_cannot_move_explains_nothing():
    model = mlp()
    nn.init.zeros_(model[2].weight)
    model[2].weight.requires_grad_(False)  # frozen at zero: the encoder will never learn
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    report = diagnose(model, opt, ce(model))
    assert {("zero_gradient", "0.weight"), ("zero_gradient", "0.bias")} <= flagged(report)


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update B A, B initialised to zero."""

    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x):
        return self.base(x) + x @ self.lora_A.t() @ self.lora_B.t()


def test_lora_adapters_are_healthy_before_and_after_their_first_step():
    torch.manual_seed(0)
    model = nn.Sequential(LoRALinear(nn.Linear(6, 8)), nn.Tanh(), LoRALinear(nn.Linear(8, 3)))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    first = diagnose(model, opt, ce(model))
    assert_clean(first)
    (note,) = [f for f in first.findings if f.kind == "zero_init"]
    assert note.name == "0.lora_B, 2.lora_B" and "0.lora_A" in note.detail
    second = diagnose(model, opt, ce(model))  # B moved: the A's receive gradient now
    assert_clean(second)
    assert "zero_init" not in {f.kind for f in second.findings}


def test_zero_init_residual_resnet_names_the_zero_gains_not_the_biases():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10, zero_init_residual=True)
    x, y = torch.randn(4, 3, 32, 32, generator=G), torch.randint(0, 10, (4,), generator=G)
    report = diagnose(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), ce(model, x, y))
    assert report.ok and not {k for k, _ in flagged(report)} - {"fp16_underflow"}, str(report)
    (note,) = [f for f in report.findings if f.kind == "zero_init"]
    assert note.name.split(", ") == [f"layer{i}.{j}.bn2.weight" for i in range(1, 5) for j in range(2)]


# --- wording: a path cut by a non-differentiable operation; torch's in-place error --------------

class Cut(nn.Module):
    def __init__(self, how):
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.enc, self.emb, self.head = nn.Linear(6, 8), nn.Embedding(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.enc(x)
        if self.how == "argmax":
            h = self.emb(h.argmax(-1))
        elif self.how == "comparison":
            h = (h > 0).float()
        elif self.how == "round":
            h = torch.round(h)
        return self.head(h)


@pytest.mark.parametrize("how, kind, words", [
    ("argmax", "no_gradient", ["argmax at test_diagnose_shapes.py", "non-differentiable"]),
    ("comparison", "no_gradient", ["gt at test_diagnose_shapes.py", "a comparison", "non-differentiable"]),
    ("round", "zero_gradient", ["round at test_diagnose_shapes.py", "derivative as zero", "non-differentiable"]),
])
def test_a_non_differentiable_operation_is_named_where_it_cuts(how, kind, words):
    model = Cut(how)
    report = diagnose(model, torch.optim.SGD(model.parameters(), lr=0.1), ce(model))
    found = {f.name: f.detail for f in report.flagged() if f.kind == kind and f.name.startswith("enc")}
    assert set(found) == {"enc.weight", "enc.bias"}, str(report)
    for w in words:
        assert w in found["enc.weight"], found["enc.weight"]


def test_detach_is_named_with_its_line():
    class Detached(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.enc(x).detach())

    model = Detached()
    report = diagnose(model, torch.optim.SGD(model.parameters(), lr=0.1), ce(model))
    assert "detach at test_diagnose_shapes.py" in next(f.detail for f in report.findings if f.name == "enc.weight")


def test_inplace_autograd_error_speaks_of_inplace_operations():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

        def forward(self, x):
            h = torch.sigmoid(self.enc(x))
            h += 1  # sigmoid's backward needs its output
            return self.head(h)

    model = InPlace()
    with pytest.raises(DiagnoseError) as info:
        diagnose(model, torch.optim.SGD(model.parameters(), lr=0.1), ce(model))
    message = str(info.value)
    assert "in-place operation" in message and "fresh loss" not in message and "\n" not in message


# --- healthy real-world shapes ---------------------------------------------------------------

class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens):
        return self.head(self.encoder(self.emb(tokens)).mean(1))


class TiedLSTM(nn.Module):
    def __init__(self, vocab=30, width=12):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Embedding(vocab, width)
        self.rnn = nn.LSTM(width, width, 2, batch_first=True, dropout=0.1)
        self.decoder = nn.Linear(width, vocab)
        self.decoder.weight = self.encoder.weight  # weight tying (Press & Wolf 2017)

    def forward(self, tokens):
        return self.decoder(self.rnn(self.encoder(tokens))[0])


def _old_style_norms():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.nn.utils.weight_norm is deprecated, still common
        torch.manual_seed(0)
        return nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(6, 8)), nn.Tanh(),
                             torch.nn.utils.spectral_norm(nn.Linear(8, 3)))


TOKENS = torch.randint(0, 20, (4, 7), generator=G)
TEXT = torch.randint(0, 30, (3, 9), generator=G)
HEALTHY = {
    "resnet18": lambda: (torchvision.models.resnet18(weights=None, num_classes=10),
                         lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4),
                         (torch.randn(4, 3, 32, 32, generator=G), torch.randint(0, 10, (4,), generator=G))),
    "transformer_encoder": lambda: (Encoder(), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), (TOKENS, Y[:4])),
    "parametrized_norms": lambda: (nn.Sequential(parametrizations.weight_norm(nn.Linear(6, 8)), nn.Tanh(),
                                                 parametrizations.spectral_norm(nn.Linear(8, 3))),
                                   lambda m: torch.optim.SGD(m.parameters(), lr=0.1), (X, Y)),
    "old_style_norms": lambda: (_old_style_norms(), lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), (X, Y)),
    "data_parallel_cpu": lambda: (nn.DataParallel(mlp()), lambda m: torch.optim.SGD(m.parameters(), lr=0.1), (X, Y)),
    "complex_weights": lambda: (nn.Sequential(nn.Linear(6, 4, dtype=torch.cfloat)),
                                lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), None),
}


@pytest.mark.parametrize("shape", sorted(HEALTHY))
def test_healthy_shape_is_clean(shape):
    model, make_opt, data = HEALTHY[shape]()
    if data is None:  # complex: a real loss of complex outputs
        xc = torch.randn(16, 6, dtype=torch.cfloat, generator=G)
        target = torch.randn(16, 4, dtype=torch.cfloat, generator=G)
        closure = lambda: (model(xc) - target).abs().pow(2).mean()  # noqa: E731
    else:
        closure = ce(model, *data)
    opt = make_opt(model)
    for _ in range(2):  # optimizer state is not empty
        closure().backward()
        opt.step()
        opt.zero_grad()
    assert_clean(diagnose(model, opt, closure))


def test_weight_tied_lstm_language_model_is_clean():
    model = TiedLSTM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    report = diagnose(model, opt, lambda: F.cross_entropy(model(TEXT[:, :-1]).reshape(-1, 30),
                                                          TEXT[:, 1:].reshape(-1)))
    assert_clean(report)
    assert report.table.set_index("name").loc["encoder.weight", "aliases"] == "decoder.weight"


def test_complex_weights_report_the_complex_norm():
    model = nn.Linear(6, 4, dtype=torch.cfloat)
    xc = torch.randn(16, 6, dtype=torch.cfloat, generator=G)
    closure = lambda: model(xc).abs().pow(2).mean()  # noqa: E731
    report = diagnose(model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9), closure, step=False)
    closure().backward()
    expected = float(torch.linalg.vector_norm(model.weight.grad))
    assert report.table.set_index("name").loc["weight", "grad_norm"] == pytest.approx(expected, rel=1e-6)


def test_torch_compile_is_clean():
    model = mlp()
    compiled = torch.compile(model, backend="aot_eager")  # dynamo and AOTAutograd; no C compiler needed
    try:
        compiled(X)
    except Exception as exc:  # noqa: BLE001 - an environment where dynamo cannot run
        pytest.skip(f"torch.compile cannot compile here: {type(exc).__name__}")
    assert_clean(diagnose(compiled, torch.optim.Adam(compiled.parameters(), lr=1e-2), ce(compiled)))

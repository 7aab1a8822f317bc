"""Config schemas. Registered in Hydra's ConfigStore so a misspelt key fails at compose time.

Groups whose choices share one shape (optim, init, precision, probe, train, eval) have one
dataclass each. Groups whose choices differ in shape (model, data, objective) are typed
per choice: each choice's YAML lists its schema (``defaults: [mlp_schema]``), and the
schema lives beside the code that builds it.
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


@dataclass
class TrainConfig:
    steps: int = 300
    # A forgotten optimizer.zero_grad() turns training into a running sum (issue 6).
    zero_grad: bool = True
    grad_clip: Optional[float] = None
    # Modules (name prefixes) whose parameters are frozen: requires_grad=False and left out
    # of the optimizer (SimSiam Table 1b freezes the predictor at its random init).
    freeze: List[str] = field(default_factory=list)


@dataclass
class EvalConfig:
    every: int = 100  # steps between evaluations; evaluation also runs before step 0 and at the end
    knn_k: int = 20


@dataclass
class OptimConfig:
    name: str = "sgd"  # sgd | adam | adamw
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    schedule: str = "constant"  # constant | cosine


@dataclass
class InitConfig:
    # default: PyTorch's own init. kaiming: N(0, 2/fan_in) (He et al. 2015, Eq. 10).
    # xavier: N(0, 1/fan_in) ("Xavier" as He et al. compare it). normal: N(0, std^2).
    # glorot_standard: U[-1/sqrt(fan_in), +]; glorot_normalized: U[-sqrt(6/(fan_in+fan_out)), +]
    # (Glorot & Bengio 2010, Eqs. 1 and 16).
    scheme: str = "default"
    std: float = 0.01
    # n of kaiming/xavier: fan_in (He et al. Eq. 10, forward) or fan_out (Eq. 14, backward).
    mode: str = "fan_in"
    # Also measure, at init and on the same first batch, the network this scheme gives (the
    # weights the control's run draws for this seed); its per-layer statistics become the
    # run's constants ``reference/<param>/<column>`` (gradrepro/reference.py).
    reference: Optional[str] = None


@dataclass
class PrecisionConfig:
    mode: str = "fp32"  # fp32 | fp16 (torch.autocast + GradScaler)
    # A number for a static loss scale, or "dynamic" for GradScaler's defaults.
    loss_scale: Any = 1.0


@dataclass
class ProbeConfig:
    every: int = 10  # log every N steps (and the last step)
    activations: bool = True  # forward/backward hook statistics per module
    act_sample: int = 32  # examples of each batch used for activation statistics
    # "tiny": grad/param ratio at least this many times below the model's median ratio.
    tiny_factor: float = 1e4
    # Per loss term, the gradient norm each term alone sends to each parameter.
    task_contribution: bool = True
    # Per-example statistics of linear layers (Glorot & Bengio's histograms are per example):
    # pe_act_grad_var, the variance of dloss_i/d(output), and pe_grad_var, of dloss_i/dW.
    per_example: bool = False


@dataclass
class CheckConfig:
    metric: str = MISSING
    op: str = MISSING  # <=, <, >=, >
    threshold: float = MISSING
    params: Dict[str, Any] = field(default_factory=dict)
    paper: Optional[str] = None  # the published reference shown beside this check


@dataclass
class SignatureConfig:
    window: int = 3  # checks on scalars use the mean over the last `window` logged points
    checks: List[CheckConfig] = field(default_factory=list)


@dataclass
class Config:
    name: str = "unnamed"  # the experiment's name, set by each experiment file
    control: Optional[str] = None  # the experiment this one is compared to
    claim: str = ""  # one line: what the run should show
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    # Torch CPU threads. Tiny models run far faster on 1 thread (PAPERS.md, performance
    # notes: 64 s vs 0.4 s for 300 MLP steps); conv experiments set their own measured value.
    threads: int = 1
    key_scalar: Optional[str] = None  # shown in the progress bar and the figure
    model: Any = MISSING
    data: Any = MISSING
    objective: Any = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    init: InitConfig = field(default_factory=InitConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    signature: SignatureConfig = field(default_factory=SignatureConfig)
    paper: Dict[str, Any] = field(default_factory=dict)


# --- ${calc:...}: thresholds written as the paper states them, e.g. "0.2 / sqrt(d)" -------

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
}
_FUNCS = {"sqrt": math.sqrt, "log": math.log, "log2": math.log2, "exp": math.exp}


def calc(expression: str) -> float:
    """Evaluate a small arithmetic expression (numbers, + - * / **, sqrt, log, log2, exp)."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _FUNCS
            and len(node.args) == 1
        ):
            return _FUNCS[node.func.id](ev(node.args[0]))
        raise ValueError(f"unsupported expression in calc: {expression!r}")

    value = float(ev(ast.parse(str(expression), mode="eval")))
    # Integral results stay ints so they can fill int fields (layer widths, dimensions).
    return int(value) if value.is_integer() and abs(value) < 2**53 else value


def run_subdir(override_dirname: str, seed: Any) -> str:
    """A sweep job's folder: what changed (Hydra's override_dirname, seed excluded), then the seed."""
    return f"{override_dirname}/seed={seed}" if override_dirname else f"seed={seed}"


_registered = False


def register_configs() -> None:
    """Register every schema with Hydra's ConfigStore (idempotent)."""
    global _registered
    if _registered:
        return
    if not OmegaConf.has_resolver("calc"):
        OmegaConf.register_new_resolver("calc", calc)
    if not OmegaConf.has_resolver("run_subdir"):
        OmegaConf.register_new_resolver("run_subdir", run_subdir)
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    # Per-choice schemas of the model, data and objective groups.
    from gradrepro.data import DATA_SCHEMAS
    from gradrepro.models import MODEL_SCHEMAS
    from gradrepro.objectives import OBJECTIVE_SCHEMAS

    for group, schemas in (
        ("model", MODEL_SCHEMAS),
        ("data", DATA_SCHEMAS),
        ("objective", OBJECTIVE_SCHEMAS),
    ):
        for name, node in schemas.items():
            cs.store(group=group, name=f"{name}_schema", node=node)
    _registered = True


def validate(cfg: Any) -> None:
    """Range and availability checks the schema's types cannot express. Raises UserError."""
    from gradrepro.errors import UserError
    from gradrepro.init import INIT_MODES, INIT_SCHEMES
    from gradrepro.optim import OPTIMIZERS, SCHEDULES
    from gradrepro.precision import PRECISION_MODES
    from gradrepro.signature import OPS

    def choice(key: str, value: Any, valid: Any) -> None:
        if value not in valid:
            raise UserError(f"{key}={value!r} is not valid; choose one of: {', '.join(map(str, valid))}")

    def positive(key: str, value: Any, allow_zero: bool = False) -> None:
        if value < 0 or (value == 0 and not allow_zero):
            raise UserError(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")

    positive("train.steps", cfg.train.steps, allow_zero=True)
    if cfg.train.steps > 0:
        positive("optim.lr", cfg.optim.lr)
    positive("probe.every", cfg.probe.every)
    positive("probe.act_sample", cfg.probe.act_sample)
    positive("probe.tiny_factor", cfg.probe.tiny_factor)
    positive("eval.every", cfg.eval.every, allow_zero=True)
    positive("eval.knn_k", cfg.eval.knn_k)
    positive("threads", cfg.threads)
    positive("data.batch_size", cfg.data.batch_size)
    positive("data.n_train", cfg.data.n_train)
    positive("data.n_test", cfg.data.n_test)
    positive("signature.window", cfg.signature.window)
    choice("optim.name", cfg.optim.name, OPTIMIZERS)
    choice("optim.schedule", cfg.optim.schedule, SCHEDULES)
    choice("init.scheme", cfg.init.scheme, INIT_SCHEMES)
    choice("init.mode", cfg.init.mode, INIT_MODES)
    if cfg.init.reference is not None:
        choice("init.reference", cfg.init.reference, INIT_SCHEMES)
    choice("precision.mode", cfg.precision.mode, PRECISION_MODES)
    if str(cfg.precision.loss_scale) != "dynamic":
        try:
            scale = float(cfg.precision.loss_scale)
        except ValueError:
            raise UserError(
                f"precision.loss_scale={cfg.precision.loss_scale!r} must be a number > 0 or 'dynamic'"
            ) from None
        positive("precision.loss_scale", scale)
    choice("device", cfg.device, ("auto", "cpu", "cuda"))
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UserError("device=cuda but no CUDA GPU is available here; use device=cpu or device=auto")
    for i, check in enumerate(cfg.signature.checks):
        choice(f"signature.checks[{i}].op", check.op, tuple(OPS))
    if cfg.data.name == "cifar10":
        import os

        from gradrepro.data.cifar10 import check_cifar10_root

        check_cifar10_root(os.path.expanduser(cfg.data.root))

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
    # Mode policy: modules (name prefixes) held in eval mode while the rest trains, e.g. the
    # BatchNorm layers of a frozen backbone, so their running statistics stop moving (issue 6).
    eval_modules: List[str] = field(default_factory=list)


@dataclass
class DiagnoseConfig:
    """A diagnostic pass (loss, gradients, per-module statistics) on the held-out set after
    training, taken with the network in ``mode`` and compared with the eval-mode function
    the model deploys (gradrepro/modes.py; BatchNorm's two functions, issue 6)."""

    mode: Optional[str] = None  # null: no diagnostic pass | eval | train
    batch_size: int = 128
    # Extra passes at these batch sizes; batch statistics over 1 or 2 examples are the worst
    # case in train mode (a batch of 1 raises ValueError there, recorded as a result).
    small_batches: List[int] = field(default_factory=lambda: [2, 1])


@dataclass
class EvalConfig:
    every: int = 100  # steps between evaluations; evaluation also runs before step 0 and at the end
    knn_k: int = 20
    diagnose: DiagnoseConfig = field(default_factory=DiagnoseConfig)


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
    # fp32 | fp16 (torch.autocast, fp32 master weights) | fp16_emulated (fp32 arithmetic,
    # every activation and weight gradient rounded to fp16): see precision.py.
    mode: str = "fp32"
    # A number for a static loss scale, or "dynamic" for GradScaler's defaults.
    loss_scale: Any = 1.0
    # c: loss x c before backward, weight gradients / c in fp32 after it. A power of two,
    # so fp32 training is bit-identical; it moves the gradient histogram by log2(c) octaves.
    loss_shift: float = 1.0


@dataclass
class ProbeConfig:
    every: int = 10  # log every N steps (and the last step)
    activations: bool = True  # forward/backward hook statistics per module
    # Examples of each batch whose activations and activation gradients the hooks summarise.
    # Their passes are the probe's largest cost (on resnet18 at batch 32, 8 instead of 32
    # took its every-step ratio from 1.09 to 1.06, benchmarks/README.md); 8 examples still
    # give >= 80 values a module (a 10-way output) and 131 K at resnet18's first conv.
    # Experiments whose verdict reads these columns set their own (precision 128, glorot 64).
    act_sample: int = 8
    # "tiny": grad/param ratio at least this many times below the model's median ratio.
    tiny_factor: float = 1e4
    # Per loss term, the gradient norm each term alone sends to each parameter.
    task_contribution: bool = True
    # Per module, counts of log2|activation gradient| from 2^-40 to 2^0 plus an exact-zero
    # bin (probe.HIST_COLUMNS), as columns of modules.parquet. Off by default (43 columns).
    act_grad_hist: bool = False
    # For the first N steps the probe logs every step and rebuilds the running sum of the
    # fresh gradients, to check what the optimizer stepped with (forgotten zero_grad, issue 6).
    running_sum_steps: int = 0
    # Per-example statistics of linear layers (Glorot & Bengio's histograms are per example):
    # pe_act_grad_var, the variance of dloss_i/d(output), and pe_grad_var, of dloss_i/dW.
    per_example: bool = False


@dataclass
class LoggerConfig:
    # none | tensorboard: also write scalars and per-module gradient norms and magnitude
    # histograms to a TensorBoard event folder inside the run directory (gradrepro/loggers.py).
    name: str = "none"
    folder: str = "tensorboard"
    histograms: bool = True



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
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    signature: SignatureConfig = field(default_factory=SignatureConfig)
    # Reference runs, name -> experiment: run after this one with the same seed, scale,
    # device and step budget, into run_dir/references/NAME, for checks ``relative_to`` NAME.
    references: Dict[str, str] = field(default_factory=dict)
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


def undeclared_keys(cfg: Any, prefix: str = "") -> list[tuple]:
    """(key, valid keys) for every key that its schema does not declare.

    Hydra's ``+key=value`` adds a key even to a typed (structured) node; such a key would be
    silently ignored by the code, so a misspelt ``+optim.lrr=0.1`` is caught here instead.
    Free-form nodes (``paper``, a check's ``params``) accept any key.
    """
    import dataclasses

    from omegaconf import DictConfig, ListConfig

    found = []
    if isinstance(cfg, DictConfig):
        schema = OmegaConf.get_type(cfg)
        if dataclasses.is_dataclass(schema):
            declared = {f.name for f in dataclasses.fields(schema)}
            found += [(f"{prefix}{k}", sorted(declared)) for k in cfg if k not in declared]
        for k in cfg:
            if not OmegaConf.is_missing(cfg, k) and not OmegaConf.is_interpolation(cfg, k):
                found += undeclared_keys(cfg[k], f"{prefix}{k}.")
    elif isinstance(cfg, ListConfig):
        for i in range(len(cfg)):
            if not OmegaConf.is_missing(cfg, i) and not OmegaConf.is_interpolation(cfg, i):
                found += undeclared_keys(cfg[i], f"{prefix[:-1]}[{i}].")
    return found


def validate(cfg: Any) -> None:
    """Range and availability checks the schema's types cannot express. Raises UserError."""
    from gradrepro.errors import UserError
    from gradrepro.init import INIT_MODES, INIT_SCHEMES
    from gradrepro.optim import OPTIMIZERS, SCHEDULES
    from gradrepro.precision import PRECISION_MODES
    from gradrepro.signature import OPS

    for key, valid in undeclared_keys(cfg)[:1]:
        from gradrepro.cli import unknown_key_message

        raise UserError(unknown_key_message(key, valid, note="added with '+'"))

    def choice(key: str, value: Any, valid: Any) -> None:
        if value not in valid:
            raise UserError(f"{key}={value!r} is not valid; choose one of: {', '.join(map(str, valid))}")

    def positive(key: str, value: Any, allow_zero: bool = False) -> None:
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise UserError(f"{key}={value} must be a finite number {'>= 0' if allow_zero else '> 0'}")

    def unit(key: str, value: float) -> None:  # torch's optimizers reject values outside [0, 1)
        if not (math.isfinite(value) and 0 <= value < 1):
            raise UserError(f"{key}={value} must be >= 0 and < 1")

    positive("train.steps", cfg.train.steps, allow_zero=True)
    if cfg.train.steps > 0:
        positive("optim.lr", cfg.optim.lr)
    else:
        positive("optim.lr", cfg.optim.lr, allow_zero=True)
    if not 0 <= cfg.seed < 2**32:  # numpy's seed range
        raise UserError(f"seed={cfg.seed} must be >= 0 and < 2**32")
    positive("optim.momentum", cfg.optim.momentum, allow_zero=True)
    positive("optim.weight_decay", cfg.optim.weight_decay, allow_zero=True)
    if len(cfg.optim.betas) != 2:
        raise UserError(f"optim.betas={list(cfg.optim.betas)} must be two numbers, e.g. [0.9,0.999]")
    for i, beta in enumerate(cfg.optim.betas):
        unit(f"optim.betas[{i}]", beta)
    if cfg.train.grad_clip is not None:
        positive("train.grad_clip", cfg.train.grad_clip)
    positive("init.std", cfg.init.std, allow_zero=True)
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
    positive("probe.running_sum_steps", cfg.probe.running_sum_steps, allow_zero=True)
    if cfg.eval.diagnose.mode is not None:
        choice("eval.diagnose.mode", cfg.eval.diagnose.mode, ("eval", "train"))
        positive("eval.diagnose.batch_size", cfg.eval.diagnose.batch_size)
        for size in cfg.eval.diagnose.small_batches:
            positive("eval.diagnose.small_batches[]", size)
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
        except (TypeError, ValueError):
            raise UserError(
                f"precision.loss_scale={cfg.precision.loss_scale!r} must be a number > 0 or 'dynamic'"
            ) from None
        positive("precision.loss_scale", scale)
    from gradrepro.precision import is_power_of_two

    if not is_power_of_two(cfg.precision.loss_shift):
        raise UserError(
            f"precision.loss_shift={cfg.precision.loss_shift} must be a power of two (e.g. 2^-16 = "
            "1.52587890625e-05) so that it leaves fp32 training bit-identical"
        )
    choice("device", cfg.device, ("auto", "cpu", "cuda"))
    from gradrepro.loggers import LOGGERS, tensorboard_available

    choice("logger.name", cfg.logger.name, LOGGERS)
    if cfg.logger.name == "tensorboard" and not tensorboard_available():
        raise UserError("logger=tensorboard needs the tensorboard package: pip install -e '.[tensorboard]'")
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

"""Config schemas, registered in Hydra's ConfigStore so that a misspelt key fails at compose time
(Hydra docs, "Structured Configs" tutorial 5.1: a schema listed first in the defaults list).

Groups whose choices share one shape (optim, init, precision, probe, train, eval) have one
dataclass each. Groups whose choices differ in shape (model, data, objective) are typed
per choice: each choice's YAML lists its schema (``defaults: [mlp_schema]``), and the
schema lives beside the code that builds it (``MODELS``, ``DATA``, ``OBJECTIVES``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from gradrepro.config.help_groups import SCHEMA_SUFFIX
from gradrepro.config.resolvers import register_resolvers
from gradrepro.data import DATA
from gradrepro.models import MODELS
from gradrepro.objectives import OBJECTIVES
from gradrepro.probe.config import ProbeConfig


@dataclass
class TrainConfig:
    steps: int = 300
    # False: the loop never calls optimizer.zero_grad(), so .grad becomes a running sum of
    # every backward (torch.Tensor.backward docs: gradients accumulate in the leaves).
    zero_grad: bool = True
    # Clip the gradient norm to this (recipe/clipping.py): after the loss scale is taken out
    # (after_unscale, PyTorch's AMP examples) or, the mistake, before (before_unscale); by the
    # norm of the full gradient (full_tensor) or, under FSDP2, of each process's shard (local_shard).
    grad_clip: Optional[float] = None
    clip_order: str = "after_unscale"
    clip_norm_from: str = "full_tensor"
    # Gradient accumulation: the batch is split into this many equal micro-batches, each one
    # forward and backward (.grad sums them), then one optimizer step. 1: the whole batch at once.
    accumulate: int = 1
    # How each micro-batch's loss, a mean over its items (tokens, or examples), is weighted before
    # its backward: total_tokens (its items / the batch's: the full batch's gradient) or
    # per_micro_batch_mean (1 / accumulate: the mean of the micro-batch means, which differs from
    # it when micro-batches hold different numbers of tokens; gradrepro/objectives/base.py).
    accumulate_norm: str = "total_tokens"
    # Modules (name prefixes) whose parameters are frozen: requires_grad=False and left out
    # of the optimizer (SimSiam Table 1b freezes the predictor at its random init).
    freeze: List[str] = field(default_factory=list)
    # Mode policy: modules (name prefixes) held in eval mode while the rest trains, e.g. the
    # BatchNorm layers of a frozen backbone, so their running statistics stop moving.
    eval_modules: List[str] = field(default_factory=list)


@dataclass
class ModePassConfig:
    """A diagnostic pass (loss, gradients, per-module statistics) on the held-out set after
    training, taken with the network in ``mode`` and compared with the eval-mode function
    the model deploys (gradrepro/measure/mode_pass.py; BatchNorm's two functions)."""

    mode: Optional[str] = None  # null: no mode pass | eval | train
    batch_size: int = 128
    # Extra passes at these batch sizes; batch statistics over 1 or 2 examples are the worst
    # case in train mode (a batch of 1 raises ValueError there, recorded as a result).
    small_batches: List[int] = field(default_factory=lambda: [2, 1])


@dataclass
class EvalConfig:
    every: int = 100  # steps between evaluations; evaluation also runs before step 0 and at the end
    knn_k: int = 20
    mode_pass: ModePassConfig = field(default_factory=ModePassConfig)


@dataclass
class OptimConfig:
    name: str = "sgd"  # sgd | adam | adamw
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    schedule: str = "constant"  # constant | cosine
    # Modules (name prefixes, e.g. predictor) whose lr the schedule does not change: they keep
    # optim.lr (SimSiam Table 1c, the predictor's lr not decayed).
    fixed_lr: List[str] = field(default_factory=list)


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
    # run's constants ``reference/<param>/<column>`` (gradrepro/measure/init_reference.py).
    reference: Optional[str] = None


@dataclass
class PrecisionConfig:
    # fp32 | fp16 (torch.autocast, fp32 master weights) | fp16_emulated (fp32 arithmetic,
    # every activation and weight gradient rounded to fp16) | bf16 (bf16 weights, activations
    # and gradients): see gradrepro/recipe/precision.py.
    mode: str = "fp32"
    # A number for a static loss scale, or "dynamic" for torch.amp.GradScaler.
    loss_scale: Any = 1.0
    # c: loss x c before backward, weight gradients / c in fp32 after it. A power of two,
    # so fp32 training is bit-identical; it moves the gradient histogram by log2(c) octaves.
    # No experiment sets it (the precision regime comes from the loss: experiments/precision.md).
    loss_shift: float = 1.0
    # GradScaler's settings where loss_scale is "dynamic"; the defaults are PyTorch's
    # (init_scale 2^16, growth_interval 2000; growth 2 and backoff 0.5 are not knobs here),
    # and the precision experiments keep them (experiments/precision.md).
    scaler_init_scale: float = 65536.0
    scaler_growth_interval: int = 2000
    # mode bf16 only: how an update is written into the bf16 weights (gradrepro/recipe/bf16.py):
    # nearest (round to nearest: updates below half an ulp are lost), stochastic (unbiased random
    # rounding, Zamirai et al. 2020), master (an fp32 master copy takes the step).
    bf16_update: str = "nearest"


@dataclass
class DistributedConfig:
    """A run of several processes on torch.distributed, started by the run itself
    (train/distributed.py): gloo on CPU, NCCL on GPUs. With more than one, the model is sharded
    over them with FSDP2 (``fully_shard``: parameters and gradients are DTensors, each process
    holds a shard), each takes its slice of every batch, and the first writes the run folder."""

    processes: int = 1
    # How long a collective waits for a process that stopped answering before it fails.
    timeout_s: float = 300.0


@dataclass
class LoggerConfig:
    # none | tensorboard: also write scalars and per-module gradient norms and magnitude
    # histograms to a TensorBoard event folder inside the run folder (records/tensorboard.py).
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
    # evidence: decides the verdict (it must hold on the failure and fail on its control);
    # context: shown beside the evidence, never decisive.
    role: str = "evidence"


@dataclass
class SignatureConfig:
    window: int = 3  # checks on scalars use the mean over the last `window` logged points
    checks: List[CheckConfig] = field(default_factory=list)


@dataclass
class Config:
    name: str = "unnamed"  # the experiment's name, set by each experiment file
    control: Optional[str] = None  # the experiment this one is compared to
    claim: str = ""  # one line: what the run should show
    # What the verdict proves (records/summary_schema.py, CLAIM_KINDS): empirical (a paper's
    # measured result: REPRODUCED), mechanism (a documented behaviour: DEMONSTRATED) or
    # observation (our own measurement, with no published one behind it: OBSERVED).
    claim_kind: Optional[str] = None
    citation: str = ""  # where the claim comes from, short: "Chen & He 2021, Sec. 4.1, Fig. 2"
    page: Optional[str] = None  # the experiment's page: experiments/NAME.md
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    # Torch CPU threads. Tiny models run far faster on 1 thread (benchmarks/README.md); conv
    # experiments set their own measured value.
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
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    signature: SignatureConfig = field(default_factory=SignatureConfig)
    # Reference runs, name -> experiment: run after this one with the same seed, scale,
    # device and step budget, into run_dir/references/NAME, for checks ``relative_to`` NAME.
    # A reference to the run's own experiment is an independent replicate (another seed); null
    # drops a reference inherited from the control's config.
    references: Dict[str, Optional[str]] = field(default_factory=dict)
    paper: Dict[str, Any] = field(default_factory=dict)


# --- ${calc:...}: thresholds written as the paper states them, e.g. "0.2 / sqrt(d)" -------


_registered = False


def register_configs() -> None:
    """Register the resolvers and every schema with Hydra's ConfigStore (idempotent)."""
    global _registered
    if _registered:
        return
    register_resolvers()
    store = ConfigStore.instance()
    store.store(name="base_config", node=Config)
    for group, choices in (("model", MODELS), ("data", DATA), ("objective", OBJECTIVES)):
        for name, (schema, _) in choices.items():
            store.store(group=group, name=f"{name}{SCHEMA_SUFFIX}", node=schema)
    _registered = True

"""How sure a finding is, from its evidence: the severity policy of ``diagnose``, of the
recorder's live findings (``gradrepro.watch.watcher``) and of its summary over the logged steps
(``gradrepro.watch.over_steps``).

- **A contradiction of an invariant** (a tensor the optimizer does not hold, a gradient edited
  between backward and the step, a NaN, a backward that starts on the previous step's
  gradient, an update the optimizer's rule does not predict) is a warning or an error at once.
- **A pattern healthy training shows for a while** (no gradient on a step: routing that leaves
  an expert without tokens, a residual branch dropped by stochastic depth; a zero gradient
  behind a zero-initialised partner at the first step; a learning rate of 0 in one param
  group during a warm-up; a tiny gradient behind a layer small by design, such as LayerScale
  at 1e-5) is information until it has held at every one of ``PERSIST_STEPS`` logged steps
  in a row; then it is a warning.
- **A gradient zero by the architecture's algebra** (a bias in front of a train-mode batch
  normalisation, a key bias under a softmax) is information that names the structure and
  says the parameter is redundant.
- **Precision findings** exist only where the tensor is in that precision.
- **An unused branch** (a head the loss leaves out) is a warning at most: the user may ignore
  it on purpose; DistributedDataParallel then needs ``find_unused_parameters=True``.
"""

from __future__ import annotations

import math

import torch

# Logged steps in a row a healthy-looking pattern must hold before it is a warning. A pattern
# that healthy training shows on at most every other logged step by chance (an expert left
# without tokens, a dropped block) holds at 8 in a row with probability at most 2^-8 < 0.4%;
# the deterministic ones healthy training outgrows (a zero-initialised partner, a warm-up from
# lr 0, LayerScale's gain) are gone after the first step or grow geometrically with each step.
PERSIST_STEPS = 8

# float32's machine epsilon, 2^-23 (IEEE 754 binary32). A gradient below sqrt(eps) of its
# reference has lost at least half of its significant digits to cancellation: it is round-off,
# not signal (the balance point of truncation and rounding error in a finite difference,
# Nocedal & Wright, Numerical Optimization, 2nd ed., Sec. 8.1).
EPS32 = 2.0**-23
ROUNDOFF = math.sqrt(EPS32)


def below_resolution(step_norm: float, param_norm: float, dtype: torch.dtype) -> bool:
    """An update of norm ``step_norm`` under half an ulp of the tensor's norm rounds away: no
    change is then what the dtype allows, not a bug (IEEE 754 round-to-nearest)."""
    if not (dtype.is_floating_point or dtype.is_complex):
        return False
    eps = torch.finfo(dtype).eps
    return 0 < step_norm < 0.5 * eps * param_norm

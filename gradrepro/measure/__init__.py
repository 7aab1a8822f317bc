"""What an experiment measures besides the probe's columns, as plug-ins the loop asks at fixed
moments (``base``: the protocol and the registry). Importing this package registers every
measurement, in the order the loop asks them:

- ``init_reference``: the control's initialisation on the run's first batch (constants);
- ``mode_pass``: the train/eval mode pass after training (constants);
- ``frozen_audit``: frozen modules' parameters, buffers and mode after training (constants);
- ``shadow_fp32``: an fp32 shadow of each logged step, for what fp16 flushed (columns);
- ``task_contribution``: each loss term's gradient norm per parameter (columns);
- ``bf16_update``: what a bf16 update rule delivered of the updates below half an ulp (columns);
- ``full_batch_gradient``: an accumulated gradient against the full batch's (columns);
- ``reference_runs``: whole runs of other experiments, for relative checks (records), last:
  a verdict is never computed against a reference made before the run's own measurements.
"""

from gradrepro.measure import (  # noqa: F401 - each module registers its measurement
    bf16_update,
    frozen_audit,
    full_batch_gradient,
    init_reference,
    mode_pass,
    reference_runs,
    shadow_fp32,
    task_contribution,
)
from gradrepro.measure.base import MEASUREMENTS, Measurement, RunContext, measurement, produced_by, start_measurements

__all__ = ["MEASUREMENTS", "Measurement", "RunContext", "measurement", "produced_by", "start_measurements"]

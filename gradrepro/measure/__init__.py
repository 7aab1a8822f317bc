"""What an experiment measures besides the probe: the init reference (``init_reference``),
reference runs (``reference_runs``), the train/eval mode pass (``mode_pass``), the frozen
audit (``frozen_audit``) and the fp32 shadow of logged steps (``shadow_fp32``). Each declares
the names it records (``PRODUCES``: constants, or for the shadow modules.parquet columns), so
a signature that reads one is checked before training."""

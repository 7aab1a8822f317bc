"""What an experiment measures besides the probe: the init reference (``init_reference``),
reference runs (``reference_runs``), the train/eval mode pass (``mode_pass``) and the frozen
audit (``frozen_audit``). Each declares the constant names it records (``PRODUCES``), so a
signature that reads one is checked before training."""

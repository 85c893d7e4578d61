"""A training run around its loop: every flag (config.py), the checks and decisions before any process starts
(plan.py), what the run prints and writes (run_log.py, metrics.py, tensorboard.py), and the record a run leaves
beside its weights, read back (records.py)."""

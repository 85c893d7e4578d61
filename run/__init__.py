"""A training run around its loop: its flags (config.py), the checks before any process starts (plan.py), what it
prints and writes (run_log.py, metrics.py, tensorboard.py, tracking.py), and its record read back (records.py)."""

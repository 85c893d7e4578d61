"""A training run around its loop: the checks and decisions before any process starts (plan.py), what auto
measures and chooses (autotune.py), what the run prints and writes (run_log.py, metrics.py, tensorboard.py), and a
trained run read back for inference (trained.py)."""

"""The run's plumbing: what a training run needs besides its loop (configuration and checks, checkpoints, logs,
precision, the recipe, demo data, loading a trained run)."""

"""Shared by the launch scripts: distributed helpers (distributed_utils) and the epoch loops (train_eval_utils)."""

"""What a run computes and how, where a user changes it: every flag (config.py), the optimizer and its schedule
(optimizer.py), the loss (loss.py), the precision and memory layout (precision.py)."""

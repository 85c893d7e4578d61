"""What a run computes, where a user changes it: the optimizer and its schedule (optimizer.py), the loss (loss.py)."""

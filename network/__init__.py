"""The parts of model.py: the architectures, their weights files, gradient checkpointing and parameter groups."""

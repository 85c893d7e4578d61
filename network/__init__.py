"""The parts of model.py: which architectures there are and how they are built (architectures.py), their weights
files (weights.py), gradient checkpointing (checkpointing.py) and their parameter groups (groups.py). Import
them from model.py, as the scripts do."""

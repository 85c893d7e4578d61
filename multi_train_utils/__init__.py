"""What the training scripts share: DDP, the epoch's loops and books, checkpoints, stops, resumes (docs/code-map.md)."""

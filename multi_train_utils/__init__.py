"""What the training scripts share: the distributed helpers, the training and evaluation loops and their books, the
checkpoint, saving in the background, stopping at a step and resuming (docs/code-map.md)."""

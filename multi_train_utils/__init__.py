"""What the training scripts share: the distributed helpers (distributed_utils.py, sync_batchnorm.py, the spawn
script's spawn_utils.py), the training and evaluation loops (train_eval_utils.py) and their bookkeeping
(bookkeeping.py), the checkpoint (checkpoint.py), and stopping at a step and resuming (stop_and_resume.py)."""

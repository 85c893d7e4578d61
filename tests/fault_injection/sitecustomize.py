"""Test-only fault injection, loaded by Python at start-up in every process when this folder is on PYTHONPATH.

FAULT=raise:RANK:EPOCH   rank RANK raises at the start of epoch EPOCH
FAULT=nan:EPOCH          every rank's images of epoch EPOCH become NaN (a non-finite loss)
FAULT=slow               each training step sleeps 0.2 s (to kill a run in the middle of an epoch)
FAULT=kill:EPOCH         the process kills itself (SIGKILL, as the OOM killer would) at the start of epoch EPOCH,
                         only while its torchrun has not restarted (TORCHELASTIC_RESTART_COUNT 0): given to one
                         node's torchrun alone, it kills that node's process once
FAULT=pause:EPOCH:SECONDS  the process sleeps SECONDS at the start of epoch EPOCH, away from any collective, as one
                         busy in a long step would be: a peer that dies meanwhile reaches it through its torchrun
                         (which stops it), not through a broken connection
FAULT=fsize:EPOCH:BYTES  from the writing of epoch EPOCH's weights and checkpoint on (multi_train_utils/checkpoint.py's
                         save_epoch, in the background writer), no file may grow beyond BYTES (RLIMIT_FSIZE, the
                         kernel's own limit: writes fail with EFBIG, "File too large", as on a full disk they fail
                         with ENOSPC); needs no privileges
FAULT=delete:EPOCH:STEP  rank 0 deletes the files (and folders, with all they hold) listed in FAULT_FILES (os.pathsep
                         between them) after STEP steps of epoch EPOCH (0: before its first), as a cleaning job or a
                         re-sync would
FAULT=stop:EPOCH:STEP:SIGNAL  rank 0 sends SIGNAL (TERM, USR1) as it loads batch STEP of epoch EPOCH: to its
                         launcher (torchrun, or the spawn script's first process), which passes it on to every
                         rank, or to itself when it has none; then again to itself as it saves (a second signal
                         while the step is being saved). It prints "fault: stop signal sent" as it sends it
FAULT=slowsave:SECONDS   each file of an epoch written in the background (multi_train_utils/epoch_writer.py) waits
                         SECONDS before it is written, printing "fault: writing NAME" and "fault: wrote NAME"

Several faults: separated by commas (FAULT=delete:1:1,fsize:2:1000000).
DECODE_LOG=FOLDER        no fault: each image decoded or checked is logged, by rank (see the end of this file)
The scripts are untouched; this replaces multi_train_utils.train_eval_utils.train_one_epoch in the process before
they import it. The faults are the run's: auto's measuring steps (autotune/timing.py, which times train_one_epoch
itself) take none.
"""

import os
import sys

if os.environ.get("FAULT"):
    import multiprocessing
    import resource
    import shutil
    import signal
    import time
    from pathlib import Path

    import torch
    import torch.distributed as dist

    import multi_train_utils.checkpoint as checkpoint
    import multi_train_utils.stop_and_resume as stop_and_resume
    import multi_train_utils.train_eval_utils as training

    faults = [(kind, numbers) for kind, *numbers in (fault.split(":") for fault in os.environ["FAULT"].split(","))]
    real_train_one_epoch = training.train_one_epoch

    class Batches:
        """The loader's batches, each passed through `each(step, batch)`; as long as the loader."""

        def __init__(self, data_loader, each):
            self.data_loader, self.each = data_loader, each

        def __len__(self):
            return len(self.data_loader)

        def __iter__(self):
            return (self.each(step, batch) for step, batch in enumerate(self.data_loader))

    def delete_at(step: int):
        def each(done, batch):
            if done == step:
                for path in map(Path, os.environ["FAULT_FILES"].split(os.pathsep)):
                    shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
            return batch

        return each

    def stop_at(step: int, signum: int):
        def each(done, batch):
            if done == step:
                launched = "LOCAL_RANK" in os.environ or multiprocessing.parent_process() is not None
                print("fault: stop signal sent", flush=True)
                os.kill(os.getppid() if launched else os.getpid(), signum)
            return batch

        return each

    def signal_again_while_saving(signum: int) -> None:
        real_save = stop_and_resume.save_atomically

        def save(state, path):
            os.kill(os.getpid(), signum)
            real_save(state, path)

        stop_and_resume.save_atomically = save

    def slow_saves(seconds: float) -> None:
        real_save = checkpoint.save_atomically

        def save(state, path):
            print(f"fault: writing {Path(path).name}", flush=True)
            time.sleep(seconds)
            real_save(state, path)
            print(f"fault: wrote {Path(path).name}", flush=True)

        checkpoint.save_atomically = save

    def full_disk_from(first_epoch: int, most: int) -> None:
        real_save_epoch = checkpoint.save_epoch
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing

        def save_epoch(output_dir, epoch, *args, **kwargs):
            if epoch >= first_epoch:
                resource.setrlimit(resource.RLIMIT_FSIZE, (most, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
            real_save_epoch(output_dir, epoch, *args, **kwargs)

        checkpoint.save_epoch = save_epoch

    def faulty_train_one_epoch(steps, data_loader, device, epoch, *how, **options):
        if sys._getframe(1).f_globals.get("__name__") == "autotune.timing":  # auto's measuring steps, not an epoch
            return real_train_one_epoch(steps, data_loader, device, epoch, *how, **options)
        rank = dist.get_rank() if dist.is_initialized() else 0
        for kind, numbers in faults:
            data_loader = inject(kind, numbers, data_loader, rank, epoch)
        return real_train_one_epoch(steps, data_loader, device, epoch, *how, **options)

    def inject(kind, numbers, data_loader, rank, epoch):
        if kind == "raise" and [rank, epoch] == [int(n) for n in numbers]:
            raise RuntimeError(f"injected failure on rank {rank} at epoch {epoch}")
        if kind == "kill" and epoch == int(numbers[0]) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "pause" and epoch == int(numbers[0]):
            time.sleep(float(numbers[1]))
        if kind == "nan" and epoch == int(numbers[0]):
            data_loader = [(images * torch.nan, labels) for images, labels in data_loader]
        if kind == "slow":
            data_loader = Batches(data_loader, lambda step, batch: time.sleep(0.2) or batch)
        if kind == "delete" and epoch == int(numbers[0]) and rank == 0:
            data_loader = Batches(data_loader, delete_at(int(numbers[1])))
        if kind == "stop" and epoch == int(numbers[0]) and rank == 0:
            signum = signal.Signals[f"SIG{numbers[2]}"]
            signal_again_while_saving(signum)
            data_loader = Batches(data_loader, stop_at(int(numbers[1]), signum))
        return data_loader

    training.train_one_epoch = faulty_train_one_epoch
    for kind, numbers in faults:
        if kind == "slowsave":
            slow_saves(float(numbers[0]))
        if kind == "fsize":
            full_disk_from(int(numbers[0]), int(numbers[1]))

if os.environ.get("DECODE_LOG") and sys.argv[0].endswith(".py"):
    # DECODE_LOG=FOLDER: every script process (torchrun's workers, not torchrun itself) and the processes it starts
    # append to FOLDER/rank<RANK>.log the path of each image decoded for it (dataset/images.py's load_rgb: the image
    # store's build, the loader's reads) or checked (image_problem: the image check), one a line.
    from dataset import images

    def logged(function):
        def log_then_call(path, *args, **kwargs):
            name = f"rank{os.environ.get('RANK', '0')}.log"
            with open(os.path.join(os.environ["DECODE_LOG"], name), "a") as log:
                log.write(f"{path}\n")
            return function(path, *args, **kwargs)

        return log_then_call

    images.image_problem, images.load_rgb = logged(images.image_problem), logged(images.load_rgb)

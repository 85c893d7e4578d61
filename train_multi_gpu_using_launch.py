"""Train ResNet-34 (or any torchvision classifier) with DistributedDataParallel, one process per device, each
process started by a launcher.

    torchrun --nproc_per_node=2 train_multi_gpu_using_launch.py --demo
    CUDA_VISIBLE_DEVICES=0,3 torchrun --nproc_per_node=2 train_multi_gpu_using_launch.py --data-path flower_photos

torchrun (or `python -m torch.distributed.launch --use_env`, or SLURM's srun) starts the processes and tells each
one its RANK, WORLD_SIZE and LOCAL_RANK in environment variables; each reads them and joins the group. Started with
plain `python`, the script trains in one process.
"""

import time

import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

from autotune.choose import choose
from model import initial_model
from multi_train_utils.bookkeeping import unreadable_limits
from multi_train_utils.distributed_utils import (
    cleanup,
    init_distributed_mode,
    is_main_process,
    launcher_environment,
    on_main_process,
    shuffled_batches,
    val_shard,
)
from multi_train_utils.stop_and_resume import resume_from, saving_a_step_on_stop
from multi_train_utils.sync_batchnorm import convert_sync_batchnorm
from multi_train_utils.train_eval_utils import Training, train_one_epoch, validate
from my_dataset import datasets, loaders
from recipe.loss import build_objective
from recipe.optimizer import build_optimizer, model_ema
from run.config import parse_config
from run.metrics import best_so_far, epoch_metrics
from run.plan import announce, prepare
from run.run_log import RunLog
from utils import entry_point


@record  # DDP: a crash's traceback goes to torchrun's error file, and torchrun's summary names the process's rank
@entry_point
def main(argv=None):
    config = parse_config("train_multi_gpu_using_launch", __doc__.splitlines()[0], argv)
    launched = launcher_environment()  # DDP: torchrun set this process's RANK, WORLD_SIZE and LOCAL_RANK
    if launched is None:
        print("Not started by torchrun or SLURM: training in one process (see --help for the torchrun command).")
    config, plan = prepare(config, world_size=launched["world_size"] if launched else 1)
    # DDP: join the process group (every process waits here for all the others), on the local rank's GPU
    process = init_distributed_mode(config.device, config.dist_backend, config.dist_url, config.dist_timeout)
    try:
        train(config, plan, process)
    finally:
        cleanup()  # DDP: leave the process group


def train(config, plan, process) -> dict:
    """Train and validate in this process for config.epochs epochs; returns the last epoch's metrics."""
    device = process.device
    # The images, mapped from the image store (decoded once by the first run; --store-dir); DDP: one copy for all
    train_set, val_set = datasets(plan, config)
    # DDP: the processes on this machine share its cores; what the flags leave to auto, rank 0 measures for all
    choice = choose(config, plan, device, process.local_world_size, train_set)
    announce(config, plan, process, choice)

    # The data. DDP: each process trains on its own shard of every epoch's shuffle (a DistributedSampler)...
    batches = shuffled_batches(train_set, config.batch_size, config.seed, process.rank, process.world_size)
    # DDP: ... and validates images rank, rank + world size, ...: every image once over the processes, none padded
    val_sampler = val_shard(val_set, process.rank, process.world_size)
    # Made on the device from the images held there, or by loader processes, as auto chose (--batches)
    train_loader, val_loader = loaders(train_set, val_set, batches, val_sampler, config, choice, device)

    # The model: the same seeded initial weights in every process (DDP also broadcasts rank 0's when it wraps)
    model = initial_model(
        config.model, len(plan.split.classes), device, choice.memory_format, seed=config.seed, weights=plan.weights,
        freeze=config.freeze_layers, grad_checkpointing=config.grad_checkpointing,
    )  # fmt: skip
    if config.sync_bn and not config.freeze_layers:  # (frozen layers: synchronised statistics would buy nothing)
        model = convert_sync_batchnorm(model)  # DDP: BatchNorm statistics over the global batch
    # DDP: the wrapper all-reduces the gradients during backward, so every process takes the same step
    trained = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    trained = torch.compile(trained) if config.compile else trained

    # The recipe. DDP: a step averages world_size batches, so the learning rate is world_size times --lr
    optimizer, scheduler = build_optimizer(model, config, len(train_loader), world_size=process.world_size)
    training = Training(
        trained, optimizer, scheduler, choice, choice.grad_scaler(device),
        objective=build_objective(config, plan.split, device), accumulate=config.accumulate,
        clip_grad_norm=config.clip_grad_norm, ema=model_ema(model, config.ema_decay) if config.model_ema else None,
    )  # fmt: skip
    start_epoch, best_acc = resume_from(plan.resume, model, training, config.epochs)

    # DDP: rank 0 alone writes the run's files; the others keep theirs closed
    log, metrics = RunLog(config, plan, process, choice, val_set, start_epoch, best_acc, enabled=is_main_process()), {}
    expected = (len(train_loader) * config.batch_size * process.world_size, len(val_set))  # an epoch's images
    limits = unreadable_limits(*expected, config.strict_images)
    with saving_a_step_on_stop(log, model, training):  # a stop signal (SIGTERM, SIGUSR1) ends at a step, saved
        for epoch in range(start_epoch, config.epochs):
            batches.set_epoch(epoch)  # a new shuffle (and new augmentation) every epoch; DDP: every shard moves with it
            lr, start = training.epoch_lr(), training.epoch_start()
            # DDP: train_one_epoch and validate all-reduce their sums, so every process logs the global figures
            trained_epoch = train_one_epoch(training, train_loader, device, epoch, limits[0])
            train_seconds = time.perf_counter() - start
            confusion, ema_metrics = validate(model, training, val_loader, device, len(plan.split.classes), limits[1])
            seconds = (train_seconds, time.perf_counter() - start)
            metrics = epoch_metrics(epoch, lr, trained_epoch, seconds, confusion, expected, process) | ema_metrics
            best, best_acc = best_so_far(metrics, model, training.ema, best_acc)
            # DDP: rank 0 writes the epoch; the others wait for it, and stop with it if it cannot
            on_main_process(log.epoch, metrics, model, training, best, best_acc)
    log.done(best_acc)
    return metrics


if __name__ == "__main__":
    main()

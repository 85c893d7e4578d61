"""The training scripts' wiring, for the tests that check its properties piece by piece: the loaders and the model
of train_multi_gpu_using_launch.py's `train` (train_single_gpu.py's, for the single-process model), built by the
very statements that `train` runs. Each block between "statement for statement" and "end of" lines is the script's
own, token for token: tests/test_wiring.py fails when the two differ."""

from types import SimpleNamespace

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from model import data_parallel_over_gpus, initial_model
from multi_train_utils.distributed_utils import Process, shuffled_batches, val_shard
from multi_train_utils.sync_batchnorm import convert_sync_batchnorm
from multi_train_utils.train_eval_utils import Training
from my_dataset import EpochsAhead, TrainingBatches, ValidationBatches, datasets, loader_options
from recipe.config import Config
from recipe.loss import build_objective
from recipe.optimizer import build_optimizer, model_ema
from recipe.precision import Compute

CPU = torch.device("cpu")


def loaders(
    split, img_size: int, batch_size: int, seed: int, world_size=1, rank=0, workers=0, compute=Compute(), **augment
):
    """(training loader, validation loader) of process `rank` of `world_size`, with `workers` loader workers and
    the augmentation flags `augment` (auto_augment, random_erase); with compute.on_device, the batches made on the
    device (the CPU) instead."""
    config = Config(img_size=img_size, batch_size=batch_size, seed=seed, **augment)
    plan, process, device = SimpleNamespace(split=split), Process(rank, world_size), CPU
    # statement for statement: train_multi_gpu_using_launch.py
    train_set, val_set, decoded = datasets(plan.split, config, process)
    # end of train_multi_gpu_using_launch.py
    # statement for statement: train_multi_gpu_using_launch.py
    loading = loader_options(workers, config, device)
    batches = shuffled_batches(train_set, config.batch_size, config.seed, process.rank, process.world_size)
    val_sampler = val_shard(val_set, process.rank, process.world_size)
    if compute.on_device:
        train_loader = TrainingBatches(train_set, batches, device, compute.memory_format)
        val_loader = ValidationBatches(val_set, val_sampler, config.batch_size, device)
    else:
        train_loader = EpochsAhead(DataLoader(train_set, batch_sampler=batches, **loading), config.epochs)
        val_loader = EpochsAhead(DataLoader(val_set, batch_size=config.batch_size, sampler=val_sampler, **loading))
    # end of train_multi_gpu_using_launch.py
    return train_loader, val_loader


def model_as_trained(
    num_classes: int, compute: Compute = Compute(), sync_bn=False, distributed=False, compile=False, **options
):
    """(the model as it is trained: in DDP wrapped, with SyncBatchNorm when `sync_bn`; compiled when `compile`,
    the model itself, for evaluating and saving): ResNet-34 (or options["model"]), seeded with 0, on the CPU (or
    options["device"]); other `options` are Config fields."""
    device = options.pop("device", CPU)
    config = Config(model=options.pop("model", "resnet34"), seed=0, sync_bn=sync_bn, compile=compile, **options)
    plan = SimpleNamespace(split=SimpleNamespace(classes=range(num_classes)), weights=None)
    if distributed:
        # statement for statement: train_multi_gpu_using_launch.py
        model = initial_model(
            config.model, len(plan.split.classes), device, compute.memory_format,
            seed=config.seed, weights=plan.weights, freeze=config.freeze_layers,
            grad_checkpointing=config.grad_checkpointing,
        )  # fmt: skip
        if config.sync_bn and not config.freeze_layers:
            model = convert_sync_batchnorm(model)
        trained = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        trained = torch.compile(trained) if config.compile else trained
        # end of train_multi_gpu_using_launch.py
    else:
        # statement for statement: train_single_gpu.py
        model = initial_model(
            config.model, len(plan.split.classes), device, compute.memory_format,
            seed=config.seed, weights=plan.weights, freeze=config.freeze_layers,
            grad_checkpointing=config.grad_checkpointing,
        )  # fmt: skip
        trained = data_parallel_over_gpus(model, device) if config.data_parallel else model
        trained = torch.compile(trained) if config.compile else trained
        # end of train_single_gpu.py
    return trained, model


def training_as_built(config: Config, plan, trained, model, train_loader, device, compute: Compute) -> Training:
    """The Training of train_single_gpu.py's `train` (its optimizer, schedule, gradient scaler, loss and EMA) for
    `trained` (and its unwrapped `model`), a run of `config` on `plan.split` (its classes and train_labels) on
    `device` as `compute` says, with `train_loader`'s batches an epoch."""
    # statement for statement: train_single_gpu.py
    optimizer, scheduler = build_optimizer(trained, config, len(train_loader))
    training = Training(
        trained, optimizer, scheduler, compute, compute.grad_scaler(device),
        objective=build_objective(config, plan.split, device), accumulate=config.accumulate,
        clip_grad_norm=config.clip_grad_norm, ema=model_ema(model, config.ema_decay) if config.model_ema else None,
    )  # fmt: skip
    # end of train_single_gpu.py
    return training

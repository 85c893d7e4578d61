"""The optimizer, schedule, parameter groups and EMA: every option means the same on one process and on eight."""

import functools
import math

import torch
from torch import nn
from torch.optim import SGD, AdamW, lr_scheduler
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from network.groups import layer_scales, norms_and_biases


def build_optimizer(model, config, batches_per_epoch: int, world_size: int = 1):
    """The optimizer at learning_rate's full rate, and its schedule (schedule_factor), stepped every optimizer step."""
    rate = learning_rate(config, world_size)
    groups = parameter_groups(model, config, rate)
    # fused: one kernel for every parameter (docs/performance.md), and float16's scaler skips steps without the host
    if config.opt == "adamw":
        optimizer = AdamW(groups, lr=rate, weight_decay=config.weight_decay, fused=True)
    else:
        optimizer = SGD(groups, lr=rate, momentum=config.momentum, weight_decay=config.weight_decay, fused=True)
        # fused SGD makes these by empty_like at its first step: garbage if float16's scaler skips it
        params = [p for p in model.parameters() if p.requires_grad]
        for param in params if config.momentum else []:
            optimizer.state[param]["momentum_buffer"] = torch.zeros_like(param)
    factor = functools.partial(schedule_factor, steps_per_epoch=math.ceil(batches_per_epoch / config.accumulate),
                               epochs=config.epochs, warmup_epochs=config.warmup_epochs, lrf=config.lrf)  # fmt: skip
    return optimizer, lr_scheduler.LambdaLR(optimizer, factor)


def parameter_groups(model, config, rate: float) -> list:
    """The trainable parameters: one list, or groups sharing a rate and a weight decay (--layer-decay,
    --norm-weight-decay), the head's first: param_groups[0] has the full rate, the rate a run reports. `model` is the
    network itself, not DDP's or torch.compile's wrapper: its parameters' names choose their groups."""
    if config.layer_decay == 1 and config.norm_weight_decay is None:
        return [p for p in model.parameters() if p.requires_grad]
    scales = layer_scales(model, config.model, config.layer_decay) if config.layer_decay != 1 else {}
    norms = norms_and_biases(model, config.model) if config.norm_weight_decay is not None else frozenset()
    groups = {}
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            lr = rate * scales.get(name, 1.0)
            decay = config.norm_weight_decay if name in norms else config.weight_decay
            groups.setdefault((lr, decay), {"params": [], "lr": lr, "weight_decay": decay})["params"].append(parameter)
    return sorted(groups.values(), key=lambda group: -group["lr"])


def learning_rate(config, world_size: int = 1) -> float:
    """The full rate: --lr times the batches a step averages over (`world_size` processes, --accumulate each)."""
    return config.lr * world_size * config.accumulate


def describe_learning_rate(config, world_size: int = 1) -> str:
    global_batch = config.batch_size * world_size * config.accumulate
    return (f"Learning rate {learning_rate(config, world_size):g} (--lr {config.lr:g} x {world_size} process(es) x "
            f"{config.accumulate} batch(es)) for a global batch of {global_batch}")  # fmt: skip


def schedule_factor(step: int, *, steps_per_epoch: int, epochs: int, warmup_epochs: int, lrf: float) -> float:
    """The learning rate at optimizer step `step` (from 0) as a share of the full rate: a warmup, then half a cosine."""
    warmup = warmup_epochs * steps_per_epoch
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, epochs * steps_per_epoch - warmup)
    return lrf + (1 - lrf) * (1 + math.cos(math.pi * min(progress, 1.0))) / 2


def model_ema(model: nn.Module, decay: float) -> AveragedModel:
    return ExponentialMovingAverage(model, decay)


class ExponentialMovingAverage(AveragedModel):
    """torch's AveragedModel, the same state_dict, with an update that never makes the host wait for the device."""

    def __init__(self, model: nn.Module, decay: float):
        super().__init__(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        """The first update copies `model`'s weights and buffers; later ones average the floating-point ones."""
        ours, theirs_now = [*self.module.parameters(), *self.module.buffers()], [*model.parameters(), *model.buffers()]
        averaged, current = [], []
        first = int(self.n_averaged) == 0  # on the CPU: read without waiting for the device
        for mine, theirs in zip(ours, theirs_now, strict=True):
            if first or not mine.is_floating_point():
                mine.copy_(theirs)
            else:
                averaged.append(mine)
                current.append(theirs.detach())
        if averaged:
            self.multi_avg_fn(averaged, current, self.n_averaged)
        self.n_averaged += 1

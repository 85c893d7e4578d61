"""SyncBatchNorm for every device: torch's fused kernels, one small all-reduce per layer each way, nothing read on the
host (torch's nn.SyncBatchNorm runs on GPUs alone, waiting in every layer: docs/guarantees.md, SyncBatchNorm)."""

import itertools

import torch
import torch.distributed as dist
from torch import nn


@torch.no_grad()
def global_batch_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel mean and (biased) variance of `x` over every process's batch, and the number of values (on x's
    device: read on the host, it would make the host wait); combined in float64, as exact as the whole batch's."""
    channels = x.shape[1]
    stats_dtype = torch.promote_types(x.dtype, torch.float32)
    # Float32 buffers make torch accumulate bfloat16 input in float32; momentum 0 leaves them as they are.
    scratch = torch.zeros(2, channels, dtype=stats_dtype, device=x.device)
    mean, var = torch.batch_norm_update_stats(x, scratch[0], scratch[1], 0.0)
    mean, var = mean.double(), var.double()
    count = torch.full((1,), x.numel() // channels, dtype=torch.float64, device=x.device)  # not copied from the host
    moments = torch.cat([mean * count, (var + mean * mean) * count, count])
    dist.all_reduce(moments)
    total = moments[-1]
    mean = moments[:channels] / total
    var = (moments[channels : 2 * channels] / total - mean * mean).clamp_(min=0)
    return mean.to(stats_dtype), var.to(stats_dtype), total


class _GlobalBatchNorm(torch.autograd.Function):
    """y = weight * (x - mean) / sqrt(var + eps) + bias with the global batch's mean and var; its gradient
    dx = weight / sqrt(var + eps) * (dy - mean(dy) - x_hat * mean(dy * x_hat)) takes both means over the global
    batch, while the weight's and bias's stay this process's own sums (DDP averages them)."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, var, eps: float, total: torch.Tensor):
        ctx.save_for_backward(x, weight, mean, var, total)
        ctx.eps = eps
        return torch.batch_norm(x, weight, bias, mean, var, False, 0.0, eps, False)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, mean, var, total = ctx.saved_tensors
        invstd = torch.rsqrt(var + ctx.eps)
        # sum(dy * x_hat) and sum(dy); statistics passed as saved ones (train=True): GPUs' kernel asserts them there
        _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
            grad_out, x, weight, None, None, mean, invstd, True, ctx.eps, [False, True, True]
        )
        sums = torch.cat([sum_dy, sum_dy_xhat])
        dist.all_reduce(sums)
        channels = mean.numel()
        mean_dy, mean_dy_xhat = sums[:channels] / total, sums[channels:] / total
        scale = invstd if weight is None else weight * invstd
        # dx = scale * dy + slope * x + offset, per channel: two fused passes over the activations
        slope = -scale * invstd * mean_dy_xhat
        offset = -scale * mean_dy - slope * mean
        shape = (1, channels, 1, 1)
        grad_in = torch.addcmul(offset.view(shape), grad_out, scale.view(shape)).addcmul_(x, slope.view(shape))
        grad_weight = sum_dy_xhat if ctx.needs_input_grad[1] else None
        grad_bias = sum_dy if ctx.needs_input_grad[2] else None
        return grad_in.to(x.dtype), grad_weight, grad_bias, None, None, None, None


class SyncBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d whose training statistics cover the whole global batch; same parameters and buffers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        mean, var, total = global_batch_stats(x)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                # momentum None: the cumulative average (kept on the device)
                momentum = 1.0 / self.num_batches_tracked if self.momentum is None else self.momentum
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
                self.running_var.lerp_((var * total / (total - 1)).to(self.running_var.dtype), momentum)
        return _GlobalBatchNorm.apply(x, self.weight, self.bias, mean, var, self.eps, total)


class SyncBatchNormAct2d(SyncBatchNorm2d):
    """timm's BatchNormAct2d synchronised: BatchNorm over the global batch, then its own `drop` and `act`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.drop(super().forward(x)))


def is_norm_act(layer: nn.Module) -> bool:
    """timm's BatchNormAct2d (BatchNorm with its activation), known by its name so timm need not be imported."""
    return isinstance(layer, nn.BatchNorm2d) and type(layer).__name__ == "BatchNormAct2d" and hasattr(layer, "act")


def convert_sync_batchnorm(model: nn.Module) -> nn.Module:
    """Replace every BatchNorm2d (and timm's BatchNormAct2d) with its synchronised kind, keeping its very tensors."""
    for name, child in model.named_children():
        if type(child) is nn.BatchNorm2d or is_norm_act(child):
            kind = SyncBatchNormAct2d if is_norm_act(child) else SyncBatchNorm2d
            synced = kind(
                child.num_features, child.eps, child.momentum, child.affine, child.track_running_stats, device="meta"
            )
            for tensor_name, tensor in itertools.chain(child.named_parameters(), child.named_buffers()):
                setattr(synced, tensor_name, tensor)  # the very tensors: their values, device and requires_grad
            if kind is SyncBatchNormAct2d:
                synced.drop, synced.act = child.drop, child.act
            synced.train(child.training)
            setattr(model, name, synced)
        else:
            convert_sync_batchnorm(child)
    return model

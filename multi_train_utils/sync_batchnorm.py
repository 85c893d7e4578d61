"""SyncBatchNorm for every device: torch's own on CUDA, a small equivalent for the CPU (gloo).

torch.nn.SyncBatchNorm runs only on GPUs, and DDP refuses it on the CPU. The CPU version here computes the same
thing with one all-reduce per layer: the batch mean and variance over every process's images, with gradients
flowing back through the reduction, so DDP on N processes computes what one process would on all the images.
"""

import torch
import torch.distributed as dist
from torch import nn


class _AllReduceSum(torch.autograd.Function):
    """Sum over processes; the gradient of a sum reaches every input, so the backward pass is the same sum."""

    @staticmethod
    def forward(ctx, tensor):
        tensor = tensor.clone()
        dist.all_reduce(tensor)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class CPUSyncBatchNorm(nn.BatchNorm2d):
    """BatchNorm2d whose training statistics cover the whole global batch; same parameters and buffers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        channels = x.shape[1]
        dims = (0, 2, 3)
        count = torch.full((1,), x.numel() / channels, dtype=torch.float64)
        # Sums in float64 so that E[x^2] - E[x]^2 loses nothing worth mentioning.
        local = torch.cat([x.sum(dims, dtype=torch.float64), (x * x).sum(dims, dtype=torch.float64), count])
        total = _AllReduceSum.apply(local)
        n = total[-1]
        mean = total[:channels] / n
        var = total[channels : 2 * channels] / n - mean * mean
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
                self.running_var.lerp_((var * n / (n - 1)).to(self.running_var.dtype), momentum)
        # Normalise in float32 whatever the input (bfloat16 under autocast), as torch's BatchNorm does inside.
        invstd = torch.rsqrt(var + self.eps).float()
        shape = (1, channels, 1, 1)
        out = (x.float() - mean.float().view(shape)) * invstd.view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(x.dtype)


def convert_sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """Replace every BatchNorm2d with a synchronised one: torch's on CUDA, CPUSyncBatchNorm on the CPU."""
    if device.type != "cpu":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for name, child in model.named_children():
        if type(child) is nn.BatchNorm2d:
            synced = CPUSyncBatchNorm(
                child.num_features, child.eps, child.momentum, child.affine, child.track_running_stats
            )
            synced.load_state_dict(child.state_dict())
            synced.train(child.training)
            synced.requires_grad_(any(p.requires_grad for p in child.parameters()))
            setattr(model, name, synced)
        else:
            convert_sync_batchnorm(child, device)
    return model

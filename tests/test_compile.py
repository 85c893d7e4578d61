"""--compile under DDP on the CPU over gloo: torch.compile around DistributedDataParallel around a network whose
BatchNorm is the scripts' SyncBatchNorm2d (as train_multi_gpu_using_launch.py wires them) takes the same steps as
the same wiring uncompiled, on two ranks; the graph breaks torch.compile makes are counted and reported, and none is
SyncBatchNorm2d's.

The network is a small one (a convolution, BatchNorm, ReLU, pooling and a head): compiling ResNet-34 takes minutes
on 2 cores, and what is tested, the wrapping and the synchronised statistics under compilation, is the same."""

import torch
from spawn_world import spawn_world
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from multi_train_utils.sync_batchnorm import SyncBatchNorm2d, convert_sync_batchnorm

STEPS, BATCH = 2, 4


def small_network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(8, 5),
    )  # fmt: skip


def _steps(rank: int, world_size: int, result_path) -> None:
    """STEPS steps of SGD, compiled and not, on this rank's rows of the same global batches; rank 0 saves the
    weights of both, the graph breaks counted while compiling, and the number of SyncBatchNorm2d layers."""
    generator = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(2 * BATCH, 3, 8, 8, generator=generator), torch.randint(0, 5, (2 * BATCH,), generator=generator))
        for _ in range(STEPS)
    ]
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    results = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model = convert_sync_batchnorm(small_network())  # as the launch script wires --sync-bn, DDP and --compile
        trained = DistributedDataParallel(model)
        trained = torch.compile(trained) if compiled else trained
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for images, labels in batches:
            nn.functional.cross_entropy(trained(images[rows]), labels[rows]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        results[compiled] = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
        if compiled:
            results["graph_breaks"] = dict(torch._dynamo.utils.counters["graph_break"])
            results["sync_bn"] = sum(isinstance(layer, SyncBatchNorm2d) for layer in model.modules())
    if rank == 0:
        torch.save(results, result_path)


def test_compile_under_ddp_with_sync_batchnorm_takes_the_steps_of_the_uncompiled_wiring(tmp_path, capsys):
    spawn_world(_steps, 2, tmp_path / "steps.pt")
    results = torch.load(tmp_path / "steps.pt", weights_only=True)
    assert results["sync_bn"] == 1
    eager, compiled = results[False], results[True]
    for name, tensor in eager.items():
        assert torch.allclose(tensor.float(), compiled[name].float(), rtol=1e-4, atol=1e-5), name
    breaks = {reason.splitlines()[0]: count for reason, count in results["graph_breaks"].items()}
    # DDP's own calls break the graph (torch 2.14: its Logger, _inside_ddp_forward); SyncBatchNorm2d does not
    assert not any("sync_batchnorm" in reason for reason in results["graph_breaks"]), breaks
    with capsys.disabled():
        print(f"\ntorch.compile under DDP with SyncBatchNorm2d: {sum(breaks.values())} graph break(s): {breaks}")

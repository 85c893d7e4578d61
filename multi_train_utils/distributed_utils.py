"""DDP's helpers, each working in one process too (rank 0 of 1), so that shared code need not ask the launch mode."""

import argparse
import contextlib
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DistributedSampler

from dataset.sampling import SeededBatchSampler
from utils import UserError, number, warn

_alone: list[bool] = []  # inside alone(): this process sums and broadcasts nothing with the others


def is_dist_avail_and_initialized() -> bool:
    return dist.is_available() and dist.is_initialized() and not _alone


def get_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_dist_avail_and_initialized() else 1


@contextlib.contextmanager
def alone():
    """Inside, this process computes as a world of one (autotune/'s rank 0 timing steps while the others wait)."""
    _alone.append(True)
    try:
        yield
    finally:
        _alone.pop()


def is_main_process() -> bool:
    return get_rank() == 0


def print_once(*message) -> None:
    if is_main_process():
        print(*message, flush=True)


def warn_once(message: str) -> None:
    if is_main_process():
        warn(message)


def environment_number(name: str, text: str, minimum: int, maximum: int | None = None) -> int:
    """`text`, variable `name`'s value, checked as the flags are (utils.number); UserError naming the variable."""
    try:
        return number(int, minimum, maximum)(text)
    except (ValueError, argparse.ArgumentTypeError) as error:
        reason = error if isinstance(error, argparse.ArgumentTypeError) else "must be a whole number"
        raise UserError(f"environment variable {name}={text!r}: {reason}") from None


def launcher_environment() -> dict | None:
    """The counts a launcher (torchrun, SLURM) set, or None; UserError naming a variable that is not one a job has."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        found = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": env["WORLD_SIZE"]} | {n: env[n] for n in names if n in env}
    elif "SLURM_PROCID" in env:
        if "MASTER_ADDR" not in env:
            raise UserError("under SLURM, set MASTER_ADDR (e.g. the first host of $SLURM_JOB_NODELIST) and MASTER_PORT")
        env.setdefault("MASTER_PORT", "29500")
        names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE")
        found = {"SLURM_NTASKS": "1", "SLURM_LOCALID": "0"} | {n: env[n] for n in names if n in env}
        found.setdefault("SLURM_NTASKS_PER_NODE", found["SLURM_NTASKS"])  # "2(x3)": 2 tasks on each of 3 nodes
        found["SLURM_NTASKS_PER_NODE"] = found["SLURM_NTASKS_PER_NODE"].split("(")[0]
    else:
        return None
    counts = [environment_number(name, found[name], minimum) for name, minimum in zip(names, (0, 1, 0, 1), strict=True)]
    for rank, size in ((0, 1), (2, 3)):  # the rank below the world size, the local rank below the local one
        if counts[rank] >= counts[size]:
            limit = f"{names[size]}={counts[size]}"
            raise UserError(f"environment variable {names[rank]}={counts[rank]} must be below {limit}")
    return dict(zip(("rank", "world_size", "local_rank", "local_world_size"), counts, strict=True))


@dataclass(frozen=True)
class Process:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    distributed: bool = False


def single_process(device: str | None = None) -> Process:
    """Rank 0 of a world of one, no process group, on `device` (default: a GPU when there is one, else the CPU)."""
    process = Process(device=resolve_device(device))
    use_device(process.device)
    return process


def use_device(device: torch.device) -> None:
    """A GPU made the current one (its streams and generator; no context on GPU 0), cuDNN timing each input shape."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True


def init_distributed_mode(
    device: str | None = None, backend: str | None = None, dist_url: str = "env://", timeout_s: int = 1800,
    rank: int | None = None, world_size: int | None = None,
) -> Process:  # fmt: skip
    """Join the group as spawn's `rank` of `world_size`, a launcher's, or alone on a free port; on mps, on the CPU."""
    spawned = {"rank": rank, "world_size": world_size, "local_rank": rank, "local_world_size": world_size}
    found = launcher_environment() if rank is None else spawned
    if found is None:  # a group of one: the device named, as it is
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()))
    process_device = resolve_device(device, local_rank=None if found is None else found["local_rank"])
    found = found or {"rank": 0, "world_size": 1, "local_rank": 0, "local_world_size": 1}
    if process_device.type == "mps":
        if found["rank"] == 0:
            print(MPS_IN_DDP, flush=True)
        process_device = torch.device("cpu")
    process = Process(**found, device=process_device, distributed=True)
    use_device(process.device)
    check_backend(backend)
    if backend is None:  # nccl on CUDA GPUs where torch has NCCL (Linux), gloo everywhere else
        backend = "nccl" if process.device.type == "cuda" and dist.is_nccl_available() else "gloo"
    store = restart_safe_store(dist_url, process, timeout := timedelta(seconds=timeout_s))
    dist.init_process_group(
        backend=backend, init_method=None if store else dist_url, store=store, world_size=process.world_size,
        rank=process.rank, timeout=timeout,
        # the GPU this process binds to: init_process_group documents device_id for NCCL alone
        **({"device_id": process.device} if backend == "nccl" and process.device.type == "cuda" else {}),
    )  # fmt: skip
    return process


MPS_IN_DDP = ("DDP on a Mac: no torch.distributed backend takes tensors on its GPU (mps), so each process trains "
              "on the CPU, with gloo (for mps, use train_single_gpu.py)")  # fmt: skip


def check_backend(asked: str | None) -> None:
    """UserError if --dist-backend names nccl where this torch has none (its Windows and macOS builds)."""
    if asked == "nccl" and not dist.is_nccl_available():
        raise UserError(f"--dist-backend nccl: this torch has no NCCL (on {sys.platform}); use --dist-backend gloo")


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


START = "flowers/start"  # the key, in torchrun's store, that names the latest start of the job's processes


def restart_safe_store(dist_url: str, process: Process, timeout: timedelta):
    """torchrun's store, in this start's namespace (docs/resuming-and-failures.md, one worker dies); else None."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist_url != "env://":
        return None
    host, port = os.environ["MASTER_ADDR"], environment_number("MASTER_PORT", os.environ["MASTER_PORT"], 1, 65535)
    store = dist.TCPStore(host, port, process.world_size, is_master=False, timeout=timeout)
    name = name_start(store, process.world_size) if process.rank == 0 else join_start(store, process.rank, timeout)
    return dist.PrefixStore(f"{START}/{name}", store)


def name_start(store, world_size: int) -> str:
    """Rank 0: publish a new name for this start; returns once every other rank has asked for it and been answered."""
    name = uuid.uuid4().hex
    store.set(START, name)
    for rank in range(1, world_size):
        question = store.get(f"{START}/{name}/question/{rank}").decode()  # waits for that rank to ask
        store.set(f"{START}/{name}/answer/{rank}/{question}", "yes")
    return name


def join_start(store, rank: int, timeout: timedelta) -> str:
    """Any other rank: the name rank 0 gave this start, asked again under each newer one (a dead start answers none)."""
    question, asked, pause = uuid.uuid4().hex, None, 0.01
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        name = store.get(START).decode()  # waits for the first start's rank 0; later, an earlier name is there
        if name != asked:
            store.set(f"{START}/{name}/question/{rank}", question)
            asked = name
        if store.check([f"{START}/{name}/answer/{rank}/{question}"]):
            return name
        time.sleep(pause)
        pause = min(2 * pause, 1.0)
    raise TimeoutError(f"rank {rank}: rank 0 did not start within --dist-timeout ({timeout.total_seconds():.0f} s)")


def resolve_device(name: str | None, local_rank: int | None = None) -> torch.device:
    """The device named, else CUDA, mps or the CPU, the first there is; in DDP, the local rank's GPU."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r}: use cpu, cuda, cuda:N or mps") from None
    if device.type == "cpu":
        return device
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device {name} asked for a Mac's GPU (Metal) but torch finds none here; use --device cpu")
    if device.type == "mps":
        return torch.device("mps")
    if device.type != "cuda":
        raise UserError(f"device {name!r} is not supported here: use cpu, cuda, cuda:N or mps")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise UserError(f"--device {name} asked for a GPU but no CUDA GPU is visible; use --device cpu")
    if local_rank is not None and device.index is not None:
        raise UserError("in DDP each process takes the GPU of its local rank: use --device cuda and choose GPUs "
                        "with CUDA_VISIBLE_DEVICES")  # fmt: skip
    index = (device.index or 0) if local_rank is None else local_rank
    if index >= count:
        raise UserError(f"GPU {index} asked for but only {count} visible (CUDA_VISIBLE_DEVICES chooses which)")
    return torch.device("cuda", index)


def cleanup() -> None:
    if is_dist_avail_and_initialized():
        dist.destroy_process_group()


def reduce_value(value: torch.Tensor, average: bool = True) -> torch.Tensor:
    """Sum (or average) a tensor over all processes; in a single process it is returned as it is."""
    if get_world_size() < 2:
        return value
    with torch.no_grad():
        value = value.clone()
        dist.all_reduce(value)
        if average:
            value /= get_world_size()
    return value


def all_reduce_in_background(value: torch.Tensor):
    """Start summing `value` in place over all processes: the handle (NCCL's wait() makes the device wait), or None."""
    return dist.all_reduce(value, async_op=True) if get_world_size() > 1 else None


def broadcast_object(obj):
    """Rank 0's value of a picklable object, on every rank."""
    if get_world_size() < 2:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def on_main_process(function, *args) -> None:
    """function(*args) on rank 0 alone, the others waiting; its UserError raised on every rank, so that all stop."""
    message = None
    if is_main_process():
        try:
            function(*args)
        except UserError as error:
            message = str(error)
    message = broadcast_object(message)  # also the barrier: no rank goes on before rank 0 is done
    if message is not None:
        raise UserError(message)


def shuffled_batches(dataset, batch_size: int, seed: int, rank: int = 0, world_size: int = 1) -> SeededBatchSampler:
    """Process `rank`'s batches of its shard of each epoch's shuffle, each index with its augmentation seed (call
    set_epoch first). Shards disjoint and batches full: one process with W*b images sees what W with b see together."""
    shard = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
    return SeededBatchSampler(BatchSampler(shard, batch_size, drop_last=True), seed)


def val_shard(dataset, rank: int, world_size: int) -> range:
    """Process `rank`'s validation images: disjoint, nothing padded, so over all processes each counts once."""
    return range(rank, len(dataset), world_size)

"""Distributed helpers: joining the process group, this process's place in it, rank queries, reductions, and the
DistributedSampler set-up that gives each process its shard of the data.

Every function works in a single process too (rank 0 of a world of 1), so the shared training code calls them
without asking which launch mode it runs under.
"""

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
    """Inside, this process computes as a world of one: rank 0 timing training steps for every rank while the others
    wait for its choice (autotune/), its steps' sums its own."""
    _alone.append(True)
    try:
        yield
    finally:
        _alone.pop()


def is_main_process() -> bool:
    return get_rank() == 0


def print_once(*message) -> None:
    """print, on the main process alone: one line per job, not one per process."""
    if is_main_process():
        print(*message, flush=True)


def warn_once(message: str) -> None:
    """warn (one line on stderr), on the main process alone."""
    if is_main_process():
        warn(message)


def environment_number(name: str, text: str, minimum: int, maximum: int | None = None) -> int:
    """Environment variable `name`'s value `text` as a whole number from `minimum` to `maximum`, through the flags'
    own check (utils.number); UserError naming the variable otherwise."""
    try:
        return number(int, minimum, maximum)(text)
    except (ValueError, argparse.ArgumentTypeError) as error:
        reason = error if isinstance(error, argparse.ArgumentTypeError) else "must be a whole number"
        raise UserError(f"environment variable {name}={text!r}: {reason}") from None


def launcher_environment() -> dict | None:
    """Rank, world size and local rank set by a launcher (torchrun, torch.distributed.launch --use_env, SLURM);
    UserError naming the variable where one is not a count the job could have (the flags' own check, utils.number)."""
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
    keys = ("rank", "world_size", "local_rank", "local_world_size")
    counts = {
        key: environment_number(name, found[name], minimum)
        for key, name, minimum in zip(keys, names, (0, 1, 0, 1), strict=True)
    }
    for rank, size, (rank_name, size_name) in (
        ("rank", "world_size", names[:2]),
        ("local_rank", "local_world_size", names[2:]),
    ):
        if counts[rank] >= counts[size]:
            raise UserError(f"environment variable {rank_name}={counts[rank]} must be below {size_name}={counts[size]}")
    return counts


@dataclass(frozen=True)
class Process:
    """This process's place in the job: its rank among world_size processes, its rank and count on this machine,
    the device it computes on, and whether it is in a process group (a world of one need not be)."""

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
    """Make `device` this process's. A GPU becomes the current one: the streams, events and random generator
    torch uses by default are then this GPU's, not GPU 0's (with --device cuda:1, the step's copies to the host
    are waited for on the stream that makes them), and no context is made on GPU 0. cuDNN then times its
    convolution algorithms for each new input shape once and keeps the fastest, as torchvision's reference
    scripts and timm do (benchmark mode: the training batches all have one shape, drop_last, and validation's
    one more at most)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True


def init_distributed_mode(
    device: str | None = None,
    backend: str | None = None,
    dist_url: str = "env://",
    timeout_s: int = 1800,
    rank: int | None = None,
    world_size: int | None = None,
) -> Process:
    """Join the process group, on this process's device; returns where this process stands.

    torchrun and SLURM describe the process in environment variables; spawn passes `rank` and `world_size`
    (with MASTER_ADDR/MASTER_PORT in the environment). Without either (the launch script started with plain
    python), a group of one on a free port of this machine, on the device named: the DDP code runs unchanged. The
    backend is choose_backend's. On a Mac's GPU (mps), which no backend serves, the processes train on the CPU.
    """
    if rank is not None:
        found = {"rank": rank, "world_size": world_size, "local_rank": rank, "local_world_size": world_size}
    else:
        found = launcher_environment()
    local_rank = None if found is None else found["local_rank"]  # a group of one: the device named, as it is
    if found is None:
        found = {"rank": 0, "world_size": 1, "local_rank": 0, "local_world_size": 1}
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()))
    process_device = resolve_device(device, local_rank=local_rank)
    if process_device.type == "mps":
        if found["rank"] == 0:
            print(MPS_IN_DDP, flush=True)
        process_device = torch.device("cpu")
    process = Process(**found, device=process_device, distributed=True)
    use_device(process.device)
    backend = choose_backend(backend, process.device)
    timeout = timedelta(seconds=timeout_s)
    store = restart_safe_store(dist_url, process, timeout)
    dist.init_process_group(
        backend=backend,
        init_method=None if store else dist_url,
        store=store,
        world_size=process.world_size,
        rank=process.rank,
        timeout=timeout,
        # the GPU this process binds to: init_process_group documents device_id for NCCL alone
        **({"device_id": process.device} if backend == "nccl" and process.device.type == "cuda" else {}),
    )
    return process


MPS_IN_DDP = (
    "DDP on a Mac: no torch.distributed backend takes tensors on its GPU (mps), so each process trains on the "
    "CPU, with gloo (for mps, use train_single_gpu.py)"
)


def check_backend(asked: str | None) -> None:
    """UserError if --dist-backend names nccl where this torch has none (its Windows and macOS builds)."""
    if asked == "nccl" and not dist.is_nccl_available():
        raise UserError(f"--dist-backend nccl: this torch has no NCCL (on {sys.platform}); use --dist-backend gloo")


def choose_backend(asked: str | None, device: torch.device) -> str:
    """The communication library: `asked` (--dist-backend) if this torch has it; else nccl on CUDA GPUs where
    torch has NCCL (Linux), gloo everywhere else (the CPU, and Windows and macOS, whose builds have no NCCL)."""
    check_backend(asked)
    if asked is not None:
        return asked
    return "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"


def find_free_port() -> int:
    """A TCP port on this machine that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


START = "flowers/start"  # the key, in torchrun's store, that names the latest start of the job's processes


def restart_safe_store(dist_url: str, process: Process, timeout: timedelta):
    """Under torchrun, the key-value store where the processes meet: torchrun's own, in a namespace of this start's.

    torchrun keeps one store for all restarts of a job; without a namespace of their own, restarted processes
    can read the addresses their dead predecessors published there and wait for them until the timeout (seen
    with torch 2.14: about half of the restarts hung). TORCHELASTIC_RESTART_COUNT cannot name the start on
    several machines: each machine's torchrun counts its own restarts, and one whose processes restart only
    because another machine's failed counts none. So rank 0 names each start (name_start) and the other ranks
    take the name from it (join_start). None where torchrun gives each start a store of its own (with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a new MASTER_PORT) or without torchrun: init_process_group builds one.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist_url != "env://":
        return None
    host, port = os.environ["MASTER_ADDR"], environment_number("MASTER_PORT", os.environ["MASTER_PORT"], 1, 65535)
    store = dist.TCPStore(host, port, process.world_size, is_master=False, timeout=timeout)
    name = name_start(store, process.world_size) if process.rank == 0 else join_start(store, process.rank, timeout)
    return dist.PrefixStore(f"{START}/{name}", store)


def name_start(store, world_size: int) -> str:
    """Rank 0: a new name for this start, published in the store. Returns once every other rank has asked for it
    (with a question of its own) and has been answered, so that no rank goes on under an older start's name."""
    name = uuid.uuid4().hex
    store.set(START, name)
    for rank in range(1, world_size):
        question = store.get(f"{START}/{name}/question/{rank}").decode()  # waits for that rank to ask
        store.set(f"{START}/{name}/answer/{rank}/{question}", "yes")
    return name


def join_start(store, rank: int, timeout: timedelta) -> str:
    """Any other rank: the name that rank 0 gave this start. The name in the store may be an earlier start's,
    whose rank 0 is dead: a question asked under it gets no answer, and the rank asks again under the next name
    rank 0 publishes. The store is polled (check never blocks), less often the longer rank 0 takes."""
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
    """The device to train on: CUDA when there is one, else a Mac's GPU (mps) when there is one, otherwise the
    CPU; in DDP, the local rank's GPU."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r}: use cpu, cuda, cuda:N or mps") from None
    if device.type == "cpu":
        return device
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise UserError(
                f"--device {name} asked for a Mac's GPU (Metal) but torch finds none here; use --device cpu"
            )
        return torch.device("mps")
    if device.type != "cuda":
        raise UserError(f"device {name!r} is not supported here: use cpu, cuda, cuda:N or mps")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise UserError(f"--device {name} asked for a GPU but no CUDA GPU is visible; use --device cpu")
    if local_rank is not None:
        if device.index is not None:
            raise UserError(
                "in DDP each process takes the GPU of its local rank: "
                "use --device cuda and choose GPUs with CUDA_VISIBLE_DEVICES"
            )
        device = torch.device("cuda", local_rank)
    index = device.index or 0
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
    """Start summing `value` in place over all processes and return at once: the handle (its wait() waits for the
    sum; on a GPU with NCCL, only the device waits), or None in a single process, where there is nothing to sum."""
    return dist.all_reduce(value, async_op=True) if get_world_size() > 1 else None


def broadcast_object(obj):
    """Rank 0's value of a picklable object, on every rank."""
    if get_world_size() < 2:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def wait_for_all() -> None:
    """Return once every process has come here (a barrier; nothing to wait for in a world of one)."""
    broadcast_object(None)


def on_main_process(function, *args) -> None:
    """Call function(*args) on rank 0 alone, while the other ranks wait for it to finish. A UserError it raises
    (a full disk while saving, say) is raised on every rank at once, so that all stop together instead of
    waiting for rank 0 until the collective timeout."""
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
    """The training batches of process `rank` of `world_size`: its shard of each epoch's seeded shuffle of
    `dataset` (a DistributedSampler; a world of one takes the whole shuffle), in batches of `batch_size`, each
    index paired with its augmentation seed (SeededBatchSampler). Call set_epoch(epoch) before each epoch.

    Shards are disjoint: drop_last makes the sampler drop the tail instead of repeating images to even them out,
    and incomplete batches are dropped too, so every step of every rank has the same batch size. One process with
    batches of W*b images sees, step by step, what W processes with b each see together.
    """
    shard = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
    return SeededBatchSampler(BatchSampler(shard, batch_size, drop_last=True), seed)


def val_shard(dataset, rank: int, world_size: int) -> range:
    """The validation images of process `rank`: rank, rank + world_size, ...: disjoint, nothing padded (unlike a
    DistributedSampler's), so summed over the processes every image counts exactly once."""
    return range(rank, len(dataset), world_size)

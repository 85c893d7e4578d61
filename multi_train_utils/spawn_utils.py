"""train_multi_gpu_using_spawn.py's hardening: a free port, each failing worker's traceback, no worker left running."""

import contextlib
import functools
import os
import signal
import socket
import sys
import traceback

import torch
import torch.multiprocessing as mp

from multi_train_utils.distributed_utils import environment_number, find_free_port, resolve_device
from utils import STOP_SIGNALS, UserError


def spawn_world_size(requested: int | None, device: str | None) -> int:
    """--world-size, checked against the visible GPUs; by default one process per GPU, or 2 on the CPU."""
    gpus = torch.cuda.device_count() if resolve_device(device).type == "cuda" else 0
    if requested is None:
        return gpus or 2
    if gpus and requested > gpus:
        raise UserError(f"--world-size {requested} but only {gpus} GPUs are visible (one process per GPU)")
    return requested


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock, contextlib.suppress(OSError):
        sock.bind(("127.0.0.1", port))
        return True
    return False


def choose_meeting_point() -> str:
    """MASTER_ADDR:MASTER_PORT, set for the workers to inherit: the ones given, or a free port if that is taken."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    port = os.environ.get("MASTER_PORT")
    if port is None or not port_is_free(environment_number("MASTER_PORT", port, 1, 65535)):
        os.environ["MASTER_PORT"] = str(find_free_port())
        if port is not None:
            print(f"MASTER_PORT {port} is taken; using {os.environ['MASTER_PORT']} instead")
    return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"


def report_failures(worker):
    """A spawned worker that, on a bug, prints its traceback and rank (spawn shows one failure only) and exits 1."""

    @functools.wraps(worker)
    def wrapper(rank, *args):
        try:
            return worker(rank, *args)
        except UserError:
            raise
        except Exception:
            print(f"[rank {rank}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            sys.exit(1)

    return wrapper


def run_workers(worker, args: tuple, nprocs: int) -> None:
    """Start `nprocs` processes of worker(rank, *args) and wait for all; if one fails, stop the others and exit with
    its status; pass a stop signal on to them (they save their step). No worker outlives this process."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, stop_workers)
    context = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="spawn")
    try:
        while not context.join():  # raises as soon as any worker fails, after stopping the others
            pass
    except mp.ProcessExitedException as error:
        # the worker printed its error, or where a stop signal (128 + its number) stopped it
        if error.exit_code != 2 and error.exit_code - 128 not in STOP_SIGNALS:
            print(f"error: worker {error.error_index} ended with status {error.exit_code}", file=sys.stderr)
        sys.exit(error.exit_code if error.exit_code and error.exit_code > 0 else 1)
    finally:
        signum = stopped_by[0] if stopped_by else signal.SIGTERM
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signum)
        for process in context.processes:
            process.join()


stopped_by: list[int] = []


def stop_workers(signum, frame) -> None:
    """The first stop signal ends the wait for the workers; later ones are ignored, not to interrupt run_workers'."""
    if not stopped_by:
        stopped_by.append(signum)
        sys.exit(128 + signum)

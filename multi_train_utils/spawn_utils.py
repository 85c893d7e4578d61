"""The hardening behind train_multi_gpu_using_spawn.py: a free port for the group to meet on, a traceback from
every failing worker, and no worker left running when the job ends, whichever way it ends."""

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
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def choose_meeting_point() -> str:
    """MASTER_ADDR:MASTER_PORT for the workers (set in the environment they inherit): the ones given, unless the
    port is taken (another job holds it), then a free one."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    port = os.environ.get("MASTER_PORT")
    if port is None or not port_is_free(environment_number("MASTER_PORT", port, 1, 65535)):
        os.environ["MASTER_PORT"] = str(find_free_port())
        if port is not None:
            print(f"MASTER_PORT {port} is taken; using {os.environ['MASTER_PORT']} instead")
    return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"


def report_failures(worker):
    """Decorate a spawned worker: on a bug, print its own traceback with its rank, then exit with status 1.

    spawn hands the parent only the first failure it notices, often a peer's "connection closed": with every
    worker printing its own, the one that failed first is always shown. UserErrors pass (one line, status 2).
    """

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
    """Start `nprocs` processes of worker(rank, *args) and wait for all of them.

    If one fails, the others are stopped and this process exits with its status; if this process is stopped
    (Ctrl-C, or a stop signal: SIGTERM, SIGUSR1), it stops them first: a stop signal is passed on, and the workers
    save the step they stop at (multi_train_utils/stop_and_resume.py) before they exit. No worker outlives it.
    """
    for signum in STOP_SIGNALS:
        signal.signal(signum, stop_workers)
    context = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="spawn")
    try:
        while not context.join():  # raises as soon as any worker fails, after stopping the others
            pass
    except mp.ProcessExitedException as error:
        # The worker printed its error (one line for bad input, exit 2; a traceback otherwise) or where it stopped
        # (a stop signal, 128 + its number): pass its status on.
        if error.exit_code != 2 and error.exit_code - 128 not in STOP_SIGNALS:
            print(f"error: worker {error.error_index} ended with status {error.exit_code}", file=sys.stderr)
        sys.exit(error.exit_code if error.exit_code and error.exit_code > 0 else 1)
    finally:
        signum = stopped_by[0] if stopped_by else signal.SIGTERM
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signum)  # a stop signal: the workers stop at a step and save it
        for process in context.processes:
            process.join()


stopped_by: list[int] = []  # the stop signal this process received, if any


def stop_workers(signum, frame) -> None:
    """This process's handler of the stop signals: the first ends the wait for the workers (run_workers then passes
    the signal on to them and waits for them to save and exit); later ones are ignored, so nothing interrupts
    that wait."""
    if not stopped_by:
        stopped_by.append(signum)
        sys.exit(128 + signum)

"""One run per folder: the lock that a run's writing process holds on its folder while it lives
(docs/resuming-and-failures.md, "One run per folder"). A module of its own, beside run/plan.py that takes it, so that
holding a folder imports no torch."""

from pathlib import Path

from filelock import BaseFileLock, FileLock, Timeout

from utils import UserError

RUN_LOCK = ".run.lock"  # in a run's folder: held by the process that writes the run's files, while it lives
held_run_folders: dict[Path, BaseFileLock] = {}  # this process's, kept here (not in the Plan, which is pickled)


def hold_run_folder(folder: Path) -> None:
    """Make `folder` if need be and hold its lock until this process exits, without waiting; UserError if another
    live run holds it. The OS lock (flock, or msvcrt on Windows) ends with its process: a crash leaves none."""
    if folder.resolve() in held_run_folders:
        return  # this process holds it already (a script's main called twice in one process, as tests do)
    folder.mkdir(parents=True, exist_ok=True)
    lock = FileLock(folder / RUN_LOCK, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise UserError(f"{folder} is in use by another run (which holds {folder / RUN_LOCK}): wait for that run to "
                        "end, or choose another --output-dir") from None  # fmt: skip
    except OSError as error:  # a lock file that is a folder, or that this user may not open
        raise UserError(
            f"cannot take the lock {folder / RUN_LOCK}: {error.strerror or error} (a run's lock is a file this user "
            f"can open): if no run is using {folder}, remove it and run again"
        ) from None
    held_run_folders[folder.resolve()] = lock

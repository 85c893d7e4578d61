"""Test-only: a Python that behaves, in what the scripts rely on, as it does on Windows. Loaded by Python at
start-up in every process when this folder is on PYTHONPATH (loader workers and spawned ranks inherit it).

- `fcntl` and `resource`, POSIX-only modules, cannot be imported (ModuleNotFoundError, as on Windows);
- new processes start by `spawn` (Windows' only start method, and macOS' default): nothing is inherited by fork,
  so whatever a process needs must be importable or picklable.

This is not Windows: paths, file locking and sockets stay Linux's. tests/test_portability.py says what it checks.
"""

import multiprocessing
import sys

REFUSED = ("fcntl", "resource")


class RefusePosixModules:
    """A meta-path finder, first in line: importing a REFUSED module fails as where it does not exist."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name in REFUSED:
            raise ModuleNotFoundError(f"No module named {name!r} (tests/windows_like: as on Windows)", name=name)
        return None


for name in REFUSED:
    sys.modules.pop(name, None)  # in case start-up imported one already
sys.meta_path.insert(0, RefusePosixModules())
multiprocessing.set_start_method("spawn", force=True)

"""What this machine offers a run as torch will use it (AVX2_CAPS heeded): processor, cores, ISA, bfloat16, memory."""

import contextlib
import math
import os
import platform
import subprocess
from pathlib import Path

import torch

# Makes torch on an AVX-512/AMX CPU compute with an AVX2-only CPU's kernels: torch's own, oneDNN's (convolutions),
# MKL's (matrix products). Read when torch is imported: set it in a process's environment before it starts.
AVX2_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}

# oneDNN's ONEDNN_MAX_CPU_ISA levels, lowest first: from AVX512_CORE_BF16 on, each has bfloat16 arithmetic
ONEDNN_ISA_LEVELS = (
    "SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI", "AVX512_CORE_BF16",
    "AVX10_1_512", "AVX512_CORE_FP16", "AVX10_1_512_AMX", "AVX512_CORE_AMX", "AVX10_1_512_AMX_FP16",
    "AVX512_CORE_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2",
)  # fmt: skip

# On the CPU, loading an image (decode, crop, flip) costs a few percent of training on it (docs/performance.md,
# Where the time goes): one loader process keeps up with 8 cores.
CORES_PER_CPU_LOADER = 8
MAX_GPU_LOADERS = 8

ON_WINDOWS = os.name == "nt"


def torch_cpu_isa() -> str:
    """The instruction set of torch's own CPU kernels: "AVX512", "AVX2", ... (ATEN_CPU_CAPABILITY caps it)."""
    return torch.backends.cpu.get_cpu_capability()


def onednn_isa_cap() -> str | None:
    """The level ONEDNN_MAX_CPU_ISA (or its old name DNNL_MAX_CPU_ISA) caps oneDNN at, or None."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return cap.upper() if cap and cap.upper() not in ("ALL", "DEFAULT") else None


def cpu_bfloat16() -> tuple[bool, str]:
    """Whether the CPU computes bfloat16 natively as torch will run it, and why (a phrase for a message)."""
    if not (torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()):
        return False, "this CPU has no bfloat16 instructions (no AMX, no AVX512-BF16)"
    if torch_cpu_isa() != "AVX512":
        return False, f"torch's CPU kernels are capped at {torch_cpu_isa()} (ATEN_CPU_CAPABILITY)"
    cap = onednn_isa_cap()
    if cap in ONEDNN_ISA_LEVELS and ONEDNN_ISA_LEVELS.index(cap) < ONEDNN_ISA_LEVELS.index("AVX512_CORE_BF16"):
        return False, f"oneDNN is capped at {cap} (ONEDNN_MAX_CPU_ISA)"
    return True, "this CPU has AMX/AVX512-BF16"


def available_cores(root: Path = Path("/")) -> int:
    """CPU cores this process may use: its affinity (taskset, SLURM), capped by its cgroup's CPU quota (Docker,
    Kubernetes) rounded up, as 1.5 CPUs keep 2 threads busier than 1. `root` is where /proc and /sys are found."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cpu_quota(root)
    return max(1, min(cores, math.ceil(quota[0]))) if quota else cores


def cpu_quota(root: Path = Path("/")) -> tuple[float, str] | None:
    """(CPUs' worth of time, the file that says so): the smallest quota on this process's cgroup or one above it,
    from v2's cpu.max ("150000 100000": 1.5) or v1's cpu.cfs_quota_us / cpu.cfs_period_us; None where none is set."""
    quotas = []
    for version, mount, cgroup in cgroups(root, "cpu"):
        parts = [part for part in cgroup.split("/") if part]
        for folder in (mount.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)):  # the cgroup's, up
            source = folder / ("cpu.max" if version == 2 else "cpu.cfs_quota_us")
            if version == 2:
                quota, _, period = read_or_empty(source).partition(" ")
            else:
                quota, period = read_or_empty(source), read_or_empty(folder / "cpu.cfs_period_us")
            if quota.isdigit() and period.isdigit() and int(quota) > 0 and int(period) > 0:
                quotas.append((int(quota) / int(period), f"the cgroup's CPU quota in {source}"))
    return min(quotas, default=None)


def cgroups(root: Path, controller: str) -> list[tuple[int, Path, str]]:
    """(cgroup version, where its files are mounted, this process's cgroup path) for `controller`, from
    /proc/self/cgroup under `root`; in a container the path may not exist: readers pass over missing files."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, _, entry = line.partition(":")
        controllers, _, cgroup = entry.partition(":")
        if controllers == "":  # cgroup v2: "0::/path"
            found.append((2, root / "sys/fs/cgroup", cgroup))
        elif controller in controllers.split(","):  # cgroup v1: "4:memory:/path", "3:cpu,cpuacct:/path"
            mount = root / "sys/fs/cgroup" / controllers
            found.append((1, mount if mount.is_dir() else root / "sys/fs/cgroup" / controller, cgroup))
    return found


def read_or_empty(path: Path) -> str:
    with contextlib.suppress(OSError):
        return path.read_text().strip()
    return ""


def physical_memory() -> int | None:
    """This machine's memory in bytes (all of it, not what is free), or None where the system does not say."""
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:  # Linux, macOS
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if os.name == "nt":
        import ctypes  # Windows: GlobalMemoryStatusEx fills this structure

        class MemoryStatus(ctypes.Structure):
            _fields_ = [("length", ctypes.c_ulong), ("load", ctypes.c_ulong)]
            _fields_ += [(name, ctypes.c_ulonglong) for name in ("total", "free", "pages", "pages_free", "virtual")]
            _fields_ += [("virtual_free", ctypes.c_ulonglong), ("extended", ctypes.c_ulonglong)]

        status = MemoryStatus(length=ctypes.sizeof(MemoryStatus))
        if ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status)):
            return status.total
    return None


def cache_folder() -> Path:
    """This project's folder in the user's cache (Windows: %LOCALAPPDATA%; elsewhere $XDG_CACHE_HOME or ~/.cache)."""
    variable, default = ("LOCALAPPDATA", Path("AppData", "Local")) if ON_WINDOWS else ("XDG_CACHE_HOME", Path(".cache"))
    return Path(os.environ.get(variable) or Path.home() / default) / "flower-training"


def cpu_name() -> str:
    """E.g. "AMD EPYC": from /proc/cpuinfo, sysctl on macOS (platform.processor() says "arm"), else the platform."""
    names = []
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    if not names and platform.system() == "Darwin":
        with contextlib.suppress(OSError):
            answer = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True)
            names = [answer.stdout.strip()] if answer.returncode == 0 and answer.stdout.strip() else []
    return names[0] if names else platform.processor() or platform.machine()


def describe_cpu() -> str:
    """E.g. "AMD EPYC, 2 cores, torch kernels AVX2, no bfloat16 (...)": what a measured figure was measured on."""
    (native, why), cap = cpu_bfloat16(), onednn_isa_cap()
    capped = f", oneDNN capped at {cap}" if cap else ""
    bf16 = ", native bfloat16" if native else f", no native bfloat16: {why}"
    return f"{cpu_name()}, {available_cores()} cores, torch kernels {torch_cpu_isa()}{capped}{bf16}"


def cores_per_process(processes_here: int = 1) -> int:
    return max(1, available_cores() // processes_here)


def core_budget(device: torch.device, processes_here: int = 1, batch_size: int = 1, workers: int | None = None):
    """(loader workers, compute threads) for one of `processes_here` processes sharing this machine's cores, by rule
    (autotune/choose.py measures the rest). On the CPU a loader on a compute thread's core stalls every parallel
    operation: so a worker per 8 cores, the threads on the rest."""
    share = cores_per_process(processes_here)
    if device.type in ("cuda", "mps"):
        return (min(MAX_GPU_LOADERS, share, batch_size) if workers is None else workers), torch.get_num_threads()
    reserved = share // CORES_PER_CPU_LOADER  # cores kept for loading, whatever --workers says
    return (reserved if workers is None else workers), max(1, share - reserved)


def use_cores(device: torch.device, processes_here: int, batch_size: int, workers: int | None) -> int:
    """Sets this process's compute threads as core_budget says (on the CPU) and returns its loader workers."""
    workers, threads = core_budget(device, processes_here, batch_size, workers)
    if device.type == "cpu":
        torch.set_num_threads(threads)
    return workers

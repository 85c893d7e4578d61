"""The memory a run may use (machine.memory_limit): the least of its cgroup's limit (v2 or v1, on its cgroup or one
above it), SLURM's allocation on the node and the machine's memory, with where the number comes from; and the cores
it may use (machine.available_cores): its affinity, capped by its cgroup's CPU quota. Each test builds the files a
Linux machine would have (/proc/self/cgroup, /sys/fs/cgroup/...) in a folder of its own."""

import pytest

import machine

pytestmark = pytest.mark.fast  # no script started, no training run

GiB = 2**30
SLURM_MEMORY = ("SLURM_MEM_PER_NODE", "SLURM_MEM_PER_CPU", "SLURM_CPUS_ON_NODE", "SLURM_CPUS_PER_TASK")
V1_NO_LIMIT = "9223372036854771712"  # what cgroup v1 writes in memory.limit_in_bytes when there is no limit


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A 512 GiB Linux machine outside SLURM, its /proc and /sys in tmp_path: node(cgroups, files) writes
    /proc/self/cgroup's lines and files (path under tmp_path: content), and returns the memory_limit there."""
    monkeypatch.setattr(machine, "physical_memory", lambda: 512 * GiB)
    for name in SLURM_MEMORY:
        monkeypatch.delenv(name, raising=False)

    def limit(cgroups: list[str], files: dict[str, str]) -> tuple[int | None, str]:
        for path, text in {"proc/self/cgroup": "\n".join(cgroups) + "\n", **files}.items():
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path).write_text(text + "\n")
        return machine.memory_limit(tmp_path)

    return limit


def test_a_cgroup_v2_limit_on_the_cgroup_or_one_above_it_is_the_memory_a_run_may_use(node):
    files = {"sys/fs/cgroup/job/step/memory.max": "max", "sys/fs/cgroup/job/memory.max": str(16 * GiB)}
    limit, source = node(["0::/job/step"], files)
    assert limit == 16 * GiB and "sys/fs/cgroup/job/memory.max" in source


def test_a_cgroup_v2_limit_of_max_is_no_limit(node):
    assert node(["0::/job"], {"sys/fs/cgroup/job/memory.max": "max"}) == (512 * GiB, "the machine's memory")


def test_a_cgroup_v1_limit_is_the_memory_a_run_may_use(node):
    cgroups = ["9:name=systemd:/", "4:memory:/slurm/uid_1/job_2", "0::/"]
    limit, source = node(cgroups, {"sys/fs/cgroup/memory/slurm/uid_1/job_2/memory.limit_in_bytes": str(8 * GiB)})
    assert limit == 8 * GiB and "memory.limit_in_bytes" in source


def test_in_a_container_whose_view_starts_at_its_own_cgroup_the_top_limit_is_taken(node):
    limit, _ = node(["4:memory:/docker/0123abcd"], {"sys/fs/cgroup/memory/memory.limit_in_bytes": str(4 * GiB)})
    assert limit == 4 * GiB


def test_cgroup_v1s_no_limit_number_is_no_limit(node):
    cgroups, files = ["4:memory:/"], {"sys/fs/cgroup/memory/memory.limit_in_bytes": V1_NO_LIMIT}
    assert node(cgroups, files) == (512 * GiB, "the machine's memory")


def test_slurms_memory_per_node_is_the_memory_a_run_may_use(node, monkeypatch):
    monkeypatch.setenv("SLURM_MEM_PER_NODE", "16384")  # MiB, as --mem=16G sets it
    limit, source = node([], {})
    assert limit == 16 * GiB and "SLURM_MEM_PER_NODE" in source


@pytest.mark.parametrize("cpus", ["SLURM_CPUS_ON_NODE", "SLURM_CPUS_PER_TASK"])
def test_slurms_memory_per_cpu_counts_the_cpus_allocated(node, monkeypatch, cpus):
    monkeypatch.setenv("SLURM_MEM_PER_CPU", "2048")
    monkeypatch.setenv(cpus, "8")
    limit, source = node([], {})
    assert limit == 16 * GiB and "SLURM_MEM_PER_CPU" in source and cpus in source


def test_the_smallest_limit_that_applies_wins(node, monkeypatch):
    monkeypatch.setenv("SLURM_MEM_PER_NODE", "16384")
    v1, v2 = "sys/fs/cgroup/memory/memory.limit_in_bytes", "sys/fs/cgroup/memory.max"
    assert node(["4:memory:/", "0::/"], {v1: str(32 * GiB), v2: "max"})[0] == 16 * GiB  # SLURM's
    assert node(["4:memory:/", "0::/"], {v1: str(12 * GiB), v2: "max"})[0] == 12 * GiB  # the cgroup's
    monkeypatch.setattr(machine, "physical_memory", lambda: 8 * GiB)
    assert node(["4:memory:/", "0::/"], {v1: str(12 * GiB), v2: "max"}) == (8 * GiB, "the machine's memory")


def test_without_proc_nor_limits_the_machines_memory_is_used_and_none_where_the_system_does_not_say(
    node, tmp_path, monkeypatch
):
    assert machine.memory_limit(tmp_path / "windows") == (512 * GiB, "the machine's memory")  # no /proc, no /sys
    monkeypatch.setattr(machine, "physical_memory", lambda: None)
    assert machine.memory_limit(tmp_path / "windows") == (None, "this system does not say its memory")


# The cores a process may use (machine.available_cores): its affinity, capped by its cgroup's CPU quota


@pytest.fixture
def cores(tmp_path, monkeypatch):
    """An 8-core Linux machine, its /proc and /sys in tmp_path: cores(cgroups, files) writes /proc/self/cgroup's
    lines and files as node does, and returns (available_cores, cpu_quota) there."""
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)

    def count(cgroups: list[str], files: dict[str, str]) -> tuple[int, tuple | None]:
        for path, text in {"proc/self/cgroup": "\n".join(cgroups) + "\n", **files}.items():
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path).write_text(text + "\n")
        return machine.available_cores(tmp_path), machine.cpu_quota(tmp_path)

    return count


def test_a_cgroup_v2_cpu_quota_on_the_cgroup_or_one_above_it_caps_the_cores(cores, tmp_path):
    # Docker's limit of 1.5 CPUs, or a Kubernetes limit of 1500m, on the pod's cgroup above the container's
    files = {"sys/fs/cgroup/pod/ctr/cpu.max": "max 100000", "sys/fs/cgroup/pod/cpu.max": "150000 100000"}
    found, quota = cores(["0::/pod/ctr"], files)
    assert found == 2 and quota == (1.5, f"the cgroup's CPU quota in {tmp_path / 'sys/fs/cgroup/pod/cpu.max'}")
    assert cores(["0::/pod/ctr"], {"sys/fs/cgroup/pod/cpu.max": "max 100000"}) == (8, None)  # no quota: affinity
    assert cores(["0::/pod/ctr"], {"sys/fs/cgroup/pod/cpu.max": "2000 100000"})[0] == 1  # never below one


def test_inside_a_container_the_quota_of_its_own_cgroup_at_the_top_of_sys_fs_cgroup_counts(cores, tmp_path):
    # /sys/fs/cgroup is the container's own cgroup there: the path /proc/self/cgroup names does not exist in it
    found, quota = cores(["0::/pod/ctr"], {"sys/fs/cgroup/cpu.max": "400000 100000"})
    assert found == 4 and quota == (4.0, f"the cgroup's CPU quota in {tmp_path / 'sys/fs/cgroup/cpu.max'}")


def test_a_cgroup_v1_cfs_quota_caps_the_cores_and_a_smaller_affinity_stays(cores, tmp_path, monkeypatch):
    folder = "sys/fs/cgroup/cpu,cpuacct/docker/abc"
    limited = {f"{folder}/cpu.cfs_quota_us": "300000", f"{folder}/cpu.cfs_period_us": "100000"}
    found, quota = cores(["12:memory:/docker/abc", "3:cpu,cpuacct:/docker/abc"], limited)
    assert found == 3 and quota == (3.0, f"the cgroup's CPU quota in {tmp_path / folder / 'cpu.cfs_quota_us'}")
    unlimited = {f"{folder}/cpu.cfs_quota_us": "-1", f"{folder}/cpu.cfs_period_us": "100000"}
    assert cores(["3:cpu,cpuacct:/docker/abc"], unlimited) == (8, None)
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)  # taskset -c 0,1
    assert cores(["3:cpu,cpuacct:/docker/abc"], limited)[0] == 2

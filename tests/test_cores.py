"""The cores a process may use (machine.available_cores): its affinity, capped by its cgroup's CPU quota. Each test
builds the files a Linux machine would have (/proc/self/cgroup, /sys/fs/cgroup/...) in a folder of its own."""

import pytest

import machine

pytestmark = pytest.mark.fast  # no script started, no training run


@pytest.fixture
def cores(tmp_path, monkeypatch):
    """An 8-core Linux machine, its /proc and /sys in tmp_path: cores(cgroups, files) writes /proc/self/cgroup's
    lines and files (path under tmp_path: content), and returns (available_cores, cpu_quota) there."""
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

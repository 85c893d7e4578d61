"""Two machines, simulated on one: two torchrun agents meet through c10d rendezvous and train as one job.

Each agent is started exactly as on a real node (`--nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT`), with
one process each; the job must train the same weights as one torchrun with two processes on one machine.
"""

import os
import subprocess
import uuid

import pytest
import torch
from conftest import DDP_FLAGS, final_weights, metrics_without_timings, run_nodes, script_command

from multi_train_utils.spawn_utils import find_free_port

TIMEOUT = 240


def start_node(port: int, job_id: str, node_rank: int, data, out, log) -> subprocess.Popen:
    """One torchrun agent, as the command on node `node_rank` of a 2-node job would start it."""
    launcher = (
        "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}", "--nproc_per_node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={job_id}",
    )  # fmt: skip
    # In the one-machine run each of the two processes takes half the cores (machine.core_budget shares them out among a
    # machine's processes); each "node" here would think it has the machine to itself, so it is pinned to its half:
    # as on two real machines, it sees only its own cores, and both runs compute with the same number of threads.
    cores = sorted(os.sched_getaffinity(0))
    half = cores[: len(cores) // 2] if node_rank == 0 else cores[len(cores) // 2 :]
    command = script_command(
        "train_multi_gpu_using_launch.py", "--data-path", data, "--output-dir", out, *DDP_FLAGS, launcher=launcher
    )
    return subprocess.Popen(
        command,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
        preexec_fn=lambda: os.sched_setaffinity(0, half or cores),
    )


@pytest.fixture(scope="module")
def two_node_run(tiny_data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("two_nodes")
    out, logs = folder / "run", [folder / f"node{rank}.log" for rank in (0, 1)]
    port, job_id = find_free_port(), f"test-{uuid.uuid4().hex[:8]}"
    outputs = run_nodes(lambda rank, log: start_node(port, job_id, rank, tiny_data, out, log), logs, TIMEOUT)
    return out, outputs


def test_two_nodes_of_one_process_form_one_job_of_world_size_two(two_node_run):
    out, outputs = two_node_run
    metrics = metrics_without_timings(out)
    assert [m["epoch"] for m in metrics] == [0, 1]
    assert all(m["world_size"] == 2 for m in metrics)
    assert {p.name for p in (out / "weights").iterdir()} >= {"last.pth", "best.pth"}
    # One job: its rank 0 (on whichever node the rendezvous made it) alone prints, on behalf of both.
    assert sum("2 process(es) on cpu, backend gloo" in output for output in outputs) == 1


@pytest.mark.guarantee
@pytest.mark.across_launchers
def test_two_nodes_train_exactly_like_two_processes_on_one_node(two_node_run, torchrun_run):
    two_nodes, one_node = final_weights(two_node_run[0]), final_weights(torchrun_run[1])
    assert two_nodes.keys() == one_node.keys()
    assert all(torch.equal(two_nodes[k], one_node[k]) for k in two_nodes)
    assert metrics_without_timings(two_node_run[0]) == metrics_without_timings(torchrun_run[1])

"""Two machines, simulated on one: two torchrun agents meet through c10d rendezvous and train as one job.

Each agent is started exactly as on a real node (`--nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT`), with
one process each; the job must train the same weights as one torchrun with two processes on one machine.
"""

import json
import os
import subprocess
import time
import uuid

import pytest
import torch
from conftest import (
    DDP_FLAGS,
    fault_env,
    final_weights,
    metrics_without_timings,
    processes_with,
    run_nodes,
    script_command,
)

from multi_train_utils.spawn_utils import find_free_port

TIMEOUT = 240


def start_node(job: tuple, node_rank: int, log, *args, env=None) -> subprocess.Popen:
    """One torchrun agent, as the command on node `node_rank` of a 2-node job would start it: `job` is the job's
    torchrun flags (job_flags), `args` the training script's, `env` what this node's environment adds."""
    launcher = ("-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}", "--nproc_per_node=1", *job)
    # In the one-machine run each of the two processes takes half the cores (machine.core_budget shares them out among a
    # machine's processes); each "node" here would think it has the machine to itself, so it is pinned to its half:
    # as on two real machines, it sees only its own cores, and both runs compute with the same number of threads.
    cores = sorted(os.sched_getaffinity(0))
    half = cores[: len(cores) // 2] if node_rank == 0 else cores[len(cores) // 2 :]
    return subprocess.Popen(
        script_command("train_multi_gpu_using_launch.py", *args, launcher=launcher),
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
        preexec_fn=lambda: os.sched_setaffinity(0, half or cores),
    )


def job_flags(*more) -> tuple[str, ...]:
    """torchrun's flags for a new 2-node job: a c10d rendezvous on a free port of this machine, a new job id."""
    port, job_id = find_free_port(), f"test-{uuid.uuid4().hex[:8]}"
    return ("--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={job_id}", *more)


@pytest.fixture(scope="module")
def two_node_run(tiny_data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("two_nodes")
    out, logs, job = folder / "run", [folder / f"node{rank}.log" for rank in (0, 1)], job_flags()
    args = ("--data-path", tiny_data, "--output-dir", out, *DDP_FLAGS)
    outputs = run_nodes(lambda rank, log: start_node(job, rank, log, *args), logs, TIMEOUT)
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


def test_a_process_killed_on_one_node_restarts_both_and_the_run_completes(tiny_data, tmp_path):
    # Node 1's process dies at the start of epoch 1 (SIGKILL). Its torchrun counts a restart; node 0's, whose process
    # is busy then (as under NCCL, where a peer's death breaks no connection), restarts its process too, but only
    # because the rendezvous changed, and counts none: the two must still meet again.
    out, logs, job = tmp_path / "run", [tmp_path / f"node{rank}.log" for rank in (0, 1)], job_flags("--max-restarts=1")
    args = ("--data-path", tiny_data, "--output-dir", out, *DDP_FLAGS, "--auto-resume", "--dist-timeout", "60")
    faults = (fault_env("pause:1:5"), fault_env("kill:1"))
    outputs = run_nodes(lambda rank, log: start_node(job, rank, log, *args, env=faults[rank]), logs, TIMEOUT)
    assert "failed (exitcode: -9)" in outputs[1]  # node 1's torchrun saw its process killed, and restarted
    assert "failed (exitcode" not in outputs[0]  # node 0's stopped its process for the new rendezvous: no failure
    assert sum("Resuming from" in output for output in outputs) == 1  # the new rank 0, on either node
    assert [(m["epoch"], m["world_size"]) for m in metrics_without_timings(out)] == [(0, 2), (1, 2)]


def test_a_rank_that_raises_is_named_with_its_traceback_and_every_node_stops_promptly(tiny_data, tmp_path):
    # Rank 1 raises at the start of epoch 0, with the default --dist-timeout (1800 s): its peer learns it from
    # the closed connection, the other node's torchrun from the rendezvous; neither waits for the timeout.
    out, logs = tmp_path / "run", [tmp_path / f"node{rank}.log" for rank in (0, 1)]
    job, env = job_flags("--log-dir", tmp_path / "torchrun"), fault_env("raise:1:0")
    args = ("--data-path", tiny_data, "--output-dir", out, *DDP_FLAGS)
    outputs = run_nodes(lambda rank, log: start_node(job, rank, log, *args, env=env), logs, TIMEOUT, check=False)
    ended = time.time()
    # The error file of the rank that raised (@record): the exception, the traceback, the time it was raised.
    errors = [json.loads(path.read_text())["message"] for path in (tmp_path / "torchrun").rglob("error.json")]
    raised = [error for error in errors if "injected failure on rank 1 at epoch 0" in error["message"]]
    assert len(raised) == 1 and 'raise RuntimeError(f"injected failure' in raised[0]["extraInfo"]["py_callstack"]
    # torchrun's summary, on the failing rank's node, names the rank and shows the exception.
    summary = next(output for output in outputs if "rank      : 1 (local_rank: 0)" in output)
    assert "train_multi_gpu_using_launch.py FAILED" in summary and "error_file: <N/A>" not in summary
    assert "RuntimeError: injected failure on rank 1 at epoch 0" in summary.split("Root Cause")[1]
    assert ended - int(raised[0]["extraInfo"]["timestamp"]) < 60  # measured 7 s (contended 2 cores); timeout 1800
    assert not processes_with(env["RUN_MARKER"])

"""How a process learns its place in the group from torchrun's or SLURM's environment variables, and how the
processes of one start of a torchrun job find each other in torchrun's store."""

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist

from multi_train_utils.distributed_utils import join_start, launcher_environment, name_start
from utils import UserError

pytestmark = pytest.mark.fast  # no script started, no training run

LAUNCH_VARIABLES = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
SLURM_VARIABLES = ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in LAUNCH_VARIABLES + SLURM_VARIABLES:
        monkeypatch.setenv(name, "")  # recorded, so whatever the code under test sets is undone afterwards
        monkeypatch.delenv(name)


def test_no_launcher_means_one_process():
    assert launcher_environment() is None


def test_torchrun_variables(monkeypatch):
    for name, value in {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, value)
    assert launcher_environment() == {"rank": 5, "world_size": 8, "local_rank": 1, "local_world_size": 4}


def test_slurm_variables(monkeypatch):
    values = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2(x2)"}
    for name, value in {**values, "MASTER_ADDR": "node01"}.items():
        monkeypatch.setenv(name, value)
    assert launcher_environment() == {"rank": 3, "world_size": 4, "local_rank": 1, "local_world_size": 2}


def test_torchrun_inside_slurm_wins_over_slurm(monkeypatch):
    for name, value in {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "RANK": "1", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    assert launcher_environment()["rank"] == 1


def test_slurm_without_a_master_address_is_a_user_error(monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "0")
    with pytest.raises(UserError, match="MASTER_ADDR"):
        launcher_environment()


def test_the_ranks_of_a_restart_agree_on_its_name_though_the_store_still_holds_the_last_starts():
    # torchrun's store outlives the processes: the second start's ranks 1 and 2 come up before its rank 0, and
    # find the first start's name (and the answers its rank 0 gave), whose rank 0 is dead.
    timeout = timedelta(seconds=30)
    server = dist.TCPStore("127.0.0.1", 0, None, is_master=True, timeout=timeout, wait_for_workers=False)

    def client():
        return dist.TCPStore("127.0.0.1", server.port, None, is_master=False, timeout=timeout)

    with ThreadPoolExecutor(2) as others:
        first = [others.submit(join_start, client(), rank, timeout) for rank in (1, 2)]
        first_name = name_start(client(), world_size=3)
        assert [future.result() for future in first] == [first_name, first_name]

        second = [others.submit(join_start, client(), rank, timeout) for rank in (1, 2)]
        time.sleep(0.5)  # they ask under the first start's name, which nobody answers now
        assert not any(future.done() for future in second)
        second_name = name_start(client(), world_size=3)
        assert [future.result() for future in second] == [second_name, second_name] != [first_name, first_name]

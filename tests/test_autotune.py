"""auto measures instead of guessing (autotune/choose.py): it chooses the fastest of what it timed, remembers the
choice for the machine, torch and configuration, measures anew when any of them differ or --remeasure says so,
never measures what a flag gives, and under DDP measures once for every rank."""

import json
import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import final_weights, run_here, run_script
from spawn_world import spawn_world
from wiring import planned

import machine as machine_module
from autotune import choose as autotune
from autotune import remembered, timing
from autotune.choose import choose_workers
from autotune.remembered import CACHE_ENV, cache_file
from dataset.folders import read_split_data
from machine import available_cores
from multi_train_utils.train_eval_utils import Choice
from my_dataset import datasets
from run.config import Config

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
FP32, FP32_CL = Choice("off", False), Choice("off", True)
BF16, BF16_CL = Choice("bf16", False), Choice("bf16", True)
AUTO = Config(model="resnet18", img_size=32, batch_size=8, workers=0, batches="loader")  # precision, layout: auto
NOT_LOADED = None  # the training set choose times loading on: these tests give --workers, or fake its timing


def choose(*args) -> Choice:
    """autotune's choose, its lines printed as the run prints them (run/run_log.py's announce)."""
    chosen = autotune.choose(*args)
    print("\n".join(chosen.lines))
    return chosen


def tuned(choice: Choice) -> tuple[int, Choice]:
    """What these tests compare of a choice: (its loader workers, how it computes: precision, layout, micro-batch,
    where the batches are made). Its compute threads are this machine's share of cores, not compared."""
    return choice.workers, replace(choice, workers=0, threads=None)


@pytest.fixture
def plan(tmp_path):
    """The part of a Plan that choose reads: the classes (for the model's head) and the data folder."""
    return SimpleNamespace(split=SimpleNamespace(classes=list("abcde")), data_path=tmp_path / "data", saved=None)


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A CPU with bfloat16 instructions (so all four candidates are timed), this test's own cache file, a
    GPU's memory that takes the whole batch, and a timing function that substitutes the seconds per image
    machine.seconds gives (FP32 fastest unless a test says otherwise) and counts its calls. The compute threads
    are restored afterwards."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache" / "autotune.json"))
    with_bfloat16(monkeypatch.setattr)
    for cap in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        monkeypatch.delenv(cap, raising=False)
    state = SimpleNamespace(seconds={FP32: 1.0, FP32_CL: 2.0, BF16: 3.0, BF16_CL: 4.0}, timed=[])

    def time_candidates(candidates, config, plan, device, world_size=1):
        state.timed.append(list(candidates))
        return {candidate: state.seconds[candidate] for candidate in candidates}

    monkeypatch.setattr(timing, "time_candidates", time_candidates)
    # A GPU here is a name (the step is never run): the whole batch fits its memory (tests/test_micro_batch.py
    # checks the search itself, on the CPU with the out-of-memory condition substituted)
    monkeypatch.setattr(timing, "fitting_micro_batch", lambda *args: (None, []))
    threads = torch.get_num_threads()
    yield state
    torch.set_num_threads(threads)


def with_bfloat16(setattr):
    """Make this CPU one with AMX that torch computes on uncapped: auto then times bfloat16 beside float32."""
    setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")


def forbid_measuring(monkeypatch):
    def refuse(*args):
        raise AssertionError("measured, though it should not have")

    monkeypatch.setattr(autotune, "measure", refuse)
    monkeypatch.setattr(timing, "time_candidates", refuse)
    monkeypatch.setattr(timing, "time_loading", refuse)


@pytest.mark.parametrize("fastest", [FP32, FP32_CL, BF16, BF16_CL])
@pytest.mark.fast
def test_auto_chooses_the_fastest_of_what_it_measured(machine, plan, capsys, fastest):
    machine.seconds[fastest] = 0.5
    workers, compute = tuned(choose(AUTO, plan, CPU, 1, NOT_LOADED))
    assert compute == fastest and workers == 0
    assert machine.timed == [[FP32, BF16, FP32_CL, BF16_CL]]  # every candidate, NCHW first
    printed = capsys.readouterr().out
    assert f"Auto: chose {fastest.name()}, the fastest" in printed
    assert f"in img/s: float32 NCHW {1 / machine.seconds[FP32]:.1f}, " in printed  # what it measured
    assert f"{fastest.name()} 2.0" in printed
    assert "(--amp auto: the fastest measured); memory layout" in printed and "(auto: the fastest measured)" in printed


@pytest.mark.fast
def test_turns_keep_each_candidates_fastest_step_and_stop_at_the_measuring_budget(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def run(seconds: dict, run_steps: float) -> dict:
        samples = {candidate: iter(times) for candidate, times in seconds.items()}

        def steps(candidate, count):  # each call takes the next of the candidate's times, per step
            taken = next(samples[candidate]) * count
            clock[0] += taken
            return taken

        return timing.take_turns(steps, list(seconds), 1, run_steps)

    seconds = {FP32: [9.0, 1.0, 1.2, 0.9], BF16: [9.0, 2.0, 1.5, 1.9]}  # an untimed first step, then three
    assert run(seconds, run_steps=10_000) == {FP32: 0.9, BF16: 1.5}  # a long run: every round, the fastest of each
    # The demo's 150 steps: 21 s for the warm-up and the first round, more than 5 % of 150 s: no second round
    assert run(seconds, run_steps=150) == {FP32: 1.0, BF16: 2.0}


@pytest.mark.fast
def test_the_second_run_takes_the_remembered_choice_without_measuring(machine, plan, capsys, monkeypatch):
    machine.seconds[BF16_CL] = 0.5
    first = tuned(choose(AUTO, plan, CPU, 1, NOT_LOADED))
    assert "Auto: remembered in " + str(cache_file()) in capsys.readouterr().out
    forbid_measuring(monkeypatch)
    assert tuned(choose(AUTO, plan, CPU, 1, NOT_LOADED)) == first == (0, BF16_CL)
    printed = capsys.readouterr().out
    assert "Auto: bfloat16 channels_last, 0 loader workers, as measured on " in printed and "timed" not in printed
    [entry] = json.loads(cache_file().read_text())["entries"]
    assert entry["choice"]["amp"] == "bf16" and entry["choice"]["channels_last"] is True
    assert entry["key"]["model"] == "resnet18" and entry["key"]["img_size"] == 32 and entry["key"]["cores"] >= 1


@pytest.mark.parametrize(
    "change",
    ["processor", "instruction set cap", "cores", "torch", "image size", "batch size", "model", "processes"],
)
@pytest.mark.fast
def test_another_machine_torch_or_configuration_is_measured_anew(machine, plan, monkeypatch, change):
    choose(AUTO, plan, CPU, 1, NOT_LOADED)
    config, processes = AUTO, 1
    if change == "processor":
        monkeypatch.setattr(remembered, "cpu_name", lambda: "Some Other CPU")
    elif change == "instruction set cap":
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    elif change == "cores":
        monkeypatch.setattr(remembered, "available_cores", lambda: 64)
    elif change == "torch":
        monkeypatch.setattr(torch, "__version__", "9.9.9")
    elif change == "processes":
        processes = 2
    else:
        field = {"image size": "img_size", "batch size": "batch_size", "model": "model"}[change]
        config = replace(AUTO, **{field: {"img_size": 64, "batch_size": 16, "model": "resnet50"}[field]})
    choose(config, plan, CPU, processes, NOT_LOADED)
    assert len(machine.timed) == 2  # measured again...
    assert len(json.loads(cache_file().read_text())["entries"]) == 2  # ...and both choices kept


@pytest.mark.fast
def test_remeasure_measures_again_and_replaces_the_remembered_choice(machine, plan):
    assert tuned(choose(AUTO, plan, CPU, 1, NOT_LOADED))[1] == FP32
    machine.seconds[BF16] = 0.1  # the machine has changed (say, another BIOS setting)
    assert tuned(choose(AUTO, plan, CPU, 1, NOT_LOADED))[1] == FP32  # remembered
    assert tuned(choose(replace(AUTO, remeasure=True), plan, CPU, 1, NOT_LOADED))[1] == BF16
    assert len(machine.timed) == 2
    assert tuned(choose(AUTO, plan, CPU, 1, NOT_LOADED))[1] == BF16  # the new choice replaced the old
    assert len(json.loads(cache_file().read_text())["entries"]) == 1


@pytest.mark.fast
def test_flags_that_say_everything_are_never_measured_nor_remembered(machine, plan, capsys, monkeypatch):
    forbid_measuring(monkeypatch)
    pinned = replace(AUTO, amp="bf16", channels_last=True, workers=0, remeasure=True)
    assert tuned(choose(pinned, plan, CPU, 1, NOT_LOADED)) == (0, BF16_CL)
    printed = capsys.readouterr().out
    assert printed == (
        "Precision: bfloat16 autocast (--amp bf16); memory layout channels_last (--channels-last)\n"
        "Batches: made by the loader (--batches loader)\n"
    )
    assert not cache_file().exists()


@pytest.mark.fast
def test_a_given_flag_is_not_measured_and_the_rest_is(machine, plan, monkeypatch):
    assert tuned(choose(replace(AUTO, amp="off"), plan, CPU, 1, NOT_LOADED))[1] == FP32  # the layout alone is timed
    assert (
        tuned(choose(replace(AUTO, channels_last=True), plan, CPU, 1, NOT_LOADED))[1] == FP32_CL
    )  # the precision alone
    assert machine.timed == [[FP32, FP32_CL], [FP32_CL, BF16_CL]]
    # On a GPU with precision and layout given, the step is timed all the same: the workers must keep up with it
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    monkeypatch.setattr(timing, "time_loading", lambda train_set, *how: 0.002)
    monkeypatch.setattr(autotune, "cores_per_process", lambda processes_here: 8)
    machine.seconds[BF16] = 0.001  # seconds per image
    workers, compute = tuned(
        choose(replace(AUTO, amp="bf16", channels_last=False, workers=None), plan, CUDA, 1, NOT_LOADED)
    )
    assert compute == BF16 and machine.timed[-1] == [BF16]
    assert workers == 3  # loading 1.5 times as fast as training: 1.5 x 2 ms / 1 ms


@pytest.mark.fast
def test_a_cache_file_that_is_not_ours_is_measured_over(machine, plan):
    cache_file().parent.mkdir(parents=True)
    cache_file().write_text("not json {")
    assert tuned(choose(AUTO, plan, CPU, 1, NOT_LOADED))[1] == FP32
    assert len(json.loads(cache_file().read_text())["entries"]) == 1


@pytest.mark.fast
def test_runs_remembering_at_once_keep_every_choice(monkeypatch, tmp_path):
    path = tmp_path / "autotune.json"
    keys = [{"img_size": size} for size in range(8)]
    facts = {"measured": {}, "load_ms": None, "seconds": 0.0, "date": ""}
    threads = [threading.Thread(target=remembered.remember, args=(path, key, Choice(), facts)) for key in keys]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(entry["key"]["img_size"] for entry in json.loads(path.read_text())["entries"]) == list(range(8))


@pytest.mark.fast
def test_the_cache_file_is_in_the_users_cache_folder_unless_relocated(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "elsewhere.json"))
    assert cache_file() == tmp_path / "elsewhere.json"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_file() == tmp_path / "xdg" / "flower-training" / "autotune.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_file() == Path.home() / ".cache" / "flower-training" / "autotune.json"
    monkeypatch.setattr(machine_module, "ON_WINDOWS", True)
    monkeypatch.setenv("LOCALAPPDATA", str(tmp_path / "local"))
    assert cache_file() == tmp_path / "local" / "flower-training" / "autotune.json"


@pytest.mark.parametrize(
    "device, share, step_ms, load_ms, expected",
    [
        ("cpu", 2, 10.0, 1.0, 0),  # the demo on 2 cores: a worker would halve the compute to save 1 ms in 11
        ("cpu", 16, 4.0, 1.4, 1),  # 224 px on 16 cores: one core loading costs less than loading between steps
        ("cpu", 16, 0.5, 2.0, 3),  # a fast step, slow images: several cores loading
        ("cuda", 16, 0.3, 1.4, 7),  # a GPU: enough workers to load 1.5x as fast as it trains
        ("cuda", 4, 0.1, 1.4, 3),  # ...but no more than the cores less one, which drives the GPU
        ("cuda", 1, 0.1, 1.4, 1),
    ],
)
@pytest.mark.fast
def test_loader_workers_from_the_measured_loading_and_step(device, share, step_ms, load_ms, expected):
    workers, why = choose_workers(torch.device(device), share, step_ms / 1000, load_ms / 1000)
    assert workers == expected
    assert f"a loader worker delivers an image in {load_ms:.1f} ms" in why


def _tune_in_rank(rank, world_size, cache, results):
    """In each rank of a gloo group: choose with timings that differ by rank (were rank 1 to measure, it would choose
    otherwise); writes what it chose and whether it measured."""
    os.environ[CACHE_ENV] = str(cache)
    timed = []
    fastest = {0: BF16, 1: FP32_CL}[rank]

    def time_candidates(candidates, config, plan, device, world_size=1):
        timed.append(rank)
        return {candidate: 0.5 if candidate == fastest else 1.0 for candidate in candidates}

    timing.time_candidates = time_candidates  # a process of its own: nothing to restore
    with_bfloat16(lambda owner, name, value: setattr(owner, name, value))
    for cap in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        os.environ.pop(cap, None)
    plan = SimpleNamespace(split=SimpleNamespace(classes=list("abcde")), data_path=cache.parent, saved=None)
    workers, compute = tuned(choose(AUTO, plan, CPU, world_size, NOT_LOADED))
    (results / str(rank)).write_text(json.dumps([compute.name(), workers, timed]))


def test_under_ddp_rank_0_measures_and_every_rank_trains_as_it_chose(tmp_path):
    spawn_world(_tune_in_rank, 2, tmp_path / "autotune.json", tmp_path)
    results = [json.loads((tmp_path / str(rank)).read_text()) for rank in (0, 1)]
    assert results == [["bfloat16 NCHW", 0, [0]], ["bfloat16 NCHW", 0, []]]
    [entry] = json.loads((tmp_path / "autotune.json").read_text())["entries"]
    assert entry["key"]["processes_here"] == 2


def test_a_run_with_auto_measures_and_remembers_and_the_next_starts_at_once(tiny_data, tmp_path, monkeypatch):
    cache = tmp_path / "autotune.json"
    flags = ("--data-path", tiny_data, "--img-size", "32", "--batch-size", "8", "--epochs", "1", "--device", "cpu")
    first = run_script("train_single_gpu.py", *flags, "--output-dir", tmp_path / "first", env={CACHE_ENV: str(cache)})
    assert first.returncode == 0, first.stderr
    assert "Auto: timed training steps of resnet34 at 32 px, batch 8, on cpu" in first.stdout
    assert "measuring took" in first.stdout
    if available_cores() > 1:  # with one core (a share of the test workers' cores) no loader would pay: not timed
        assert "Auto: a loader worker delivers an image in " in first.stdout
    [entry] = json.loads(cache.read_text())["entries"]
    chosen = entry["choice"]
    assert chosen["seconds"] > 0 and len(chosen["measured"]) in (2, 4)  # both layouts, in bfloat16 too if native
    monkeypatch.setenv(CACHE_ENV, str(cache))  # the second run in this process: what it reads is the file's
    second = run_here("train_single_gpu.py", *flags, "--output-dir", tmp_path / "second")
    assert second.returncode == 0, second.stderr
    assert "as measured on" in second.stdout and "Auto: timed" not in second.stdout
    run = json.loads((tmp_path / "second" / "args.json").read_text())  # the run records what auto chose
    assert (run["amp"], run["channels_last"]) == (chosen["amp"], chosen["channels_last"])
    first_weights, second_weights = final_weights(tmp_path / "first"), final_weights(tmp_path / "second")
    assert all(torch.equal(first_weights[k], second_weights[k]) for k in first_weights)  # measuring changed nothing


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_auto_times_its_candidates(plan, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "autotune.json"))
    workers, compute = tuned(choose(AUTO, plan, torch.device("cuda", 0), 1, NOT_LOADED))
    entry = json.loads((tmp_path / "autotune.json").read_text())["entries"][0]
    assert compute.name() == max(entry["choice"]["measured"], key=entry["choice"]["measured"].get)
    assert entry["key"]["gpu"] == torch.cuda.get_device_name(0) and workers == 0
    assert "on cuda (cuda:0)" in capsys.readouterr().out


@pytest.mark.fast
@pytest.mark.parametrize("making, on_device", [(1e-6, True), (1.0, False)], ids=["device-faster", "loader-faster"])
def test_auto_makes_the_batches_where_it_measured_them_faster_says_so_and_remembers_it(
    machine, plan, monkeypatch, capsys, making, on_device
):
    """Where the images fit on the device (substituted), auto times making a batch there (substituted: `making`
    seconds an image) against loading (2 ms an image on one core) beside the measured step, and chooses."""
    room = "from the training images held there: 4 images take 0.00 GB, within half of the 1.0 GB free"
    monkeypatch.setattr(autotune, "device_batches_room", lambda *args: ("device", 1000, room))
    monkeypatch.setattr(timing, "device_seconds_per_image", lambda *args: making)
    monkeypatch.setattr(timing, "time_loading", lambda train_set, *how: 0.002)
    plan.split.train_images = ["image.jpg"] * 80  # 10 steps an epoch
    config = replace(AUTO, batches="auto")
    workers, compute = tuned(choose(config, plan, CPU, 1, NOT_LOADED))
    printed = capsys.readouterr().out
    assert compute.on_device is on_device and workers == 0
    assert f"Auto: batches made {'on the device' if on_device else 'by the loader'}: there " in printed
    if on_device:
        assert f"Batches: made on the device (--batches auto), {room}" in printed
    assert tuned(choose(config, plan, CPU, 1, NOT_LOADED))[1].on_device is on_device  # remembered
    assert "batches made on the device, as measured on" in capsys.readouterr().out or not on_device


def test_a_loader_worker_is_timed_as_it_delivers_batches_so_a_slower_collation_starts_more_workers(
    tiny_data, monkeypatch
):
    """time_loading runs one real loader worker: what it does besides cropping (collating a batch, shipping it)
    counts. A collation made 50 ms a batch slower (substituted) is measured so, and on a GPU auto starts more
    workers to keep ahead of the same step. (20 ms, within 10 %, failed once on a loaded 2-core CI machine: the
    difference measured was 2.22 ms an image against 2.25 asked; a timing's noise is not what this checks.)"""
    config = Config(img_size=32, batch_size=8)
    train_set = datasets(planned(read_split_data(tiny_data), config), config)[0]
    quick = timing.time_loading(train_set, config, CPU)
    collate = torch.utils.data._utils.collate.default_collate
    monkeypatch.setattr(
        torch.utils.data._utils.collate, "default_collate", lambda batch: time.sleep(0.05) or collate(batch)
    )
    slow = timing.time_loading(train_set, config, CPU)
    assert slow >= quick + 0.8 * 0.05 / 8  # 6.25 ms an image more, 5 asked
    gpu, step = torch.device("cuda"), 0.0005  # a GPU step of 0.5 ms an image; 16 cores
    assert autotune.choose_workers(gpu, 16, step, slow)[0] > autotune.choose_workers(gpu, 16, step, quick)[0]

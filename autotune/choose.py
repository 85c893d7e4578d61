"""What `auto` chooses: the run's whole choice of how to train (multi_train_utils.train_eval_utils.Choice), taken
once, here, and read by everything else: the precision, the memory layout, the micro-batch, where the batches are
made, the loader workers and the compute threads, with the lines the run prints about it.

A flag given is never measured. The rest is measured on this machine before training (autotune/timing.py), for the
run's model, image size and batch size, and remembered for later runs (autotune/remembered.py):
- precision and layout: a few of train_one_epoch's steps in each candidate (float32, and bfloat16 where the device
  has its instructions, each in NCHW and channels_last), taken in turns; the fastest wins.
- the micro-batch, on a GPU: the largest that fits its memory.
- loader workers: one worker's seconds per image against the chosen step's. On a GPU the cores only load: enough
  workers to keep ahead of it. On the CPU each worker takes a core from the compute threads: the count whose
  estimated speed is best.
- where batches are made: where the images fit on the device, making a batch there against the loader.
Under DDP rank 0 measures (or reads the file) while the others wait, and every rank trains as it chose.
"""

import datetime
import math
import time
from dataclasses import replace

import torch

from autotune.remembered import remember, remembered
from autotune.timing import Measured, measure
from dataset.in_memory import memory_budget
from dataset.on_device import crop_and_flip, held_size
from machine import CORES_PER_CPU_LOADER, cores_per_process, cpu_bfloat16
from multi_train_utils.distributed_utils import alone, broadcast_object, get_world_size, is_main_process
from multi_train_utils.memory import memory_limited
from multi_train_utils.train_eval_utils import Choice
from utils import UserError

GPU_LOADER_MARGIN = 1.5  # workers enough to load this much faster than the GPU trains (JPEGs vary in size)
DEVICE_SHARE = 0.5  # of a GPU's free memory, at most, for the images held there: the rest is the training's
PRECISION_NAMES = {"off": "float32", "bf16": "bfloat16 autocast", "fp16": "float16 autocast with gradient scaling"}


def choose(config, plan, device: torch.device, processes_here: int, train_set) -> Choice:
    """The run's whole choice (`processes_here` training processes sharing this machine): what the flags give, the
    rest measured by rank 0 or remembered, the same on every rank, with the lines saying so. Sets this process's
    compute threads (on the CPU: its share of the cores less its loader workers)."""
    given = config.amp != "auto" and config.channels_last is not None and config.workers is not None
    given = given and (config.micro_batch is not None or not memory_limited(device))
    candidates = compute_candidates(config.amp, config.channels_last, device)
    share = cores_per_process(processes_here)
    held, room = device_batches_room(config, train_set, device, processes_here)  # held: None if they cannot be
    if config.batches == "device" and held is None:
        raise UserError(f"--batches device: {room.removeprefix('Batches: made by the loader: ')}")
    if given:
        where = "device" if held is not None and config.batches == "device" else "loader"
        choice = Choice(config.amp, config.channels_last, small_micro_batch(config), where, config.workers)
    else:
        if device.type == "cpu":  # measured on the threads it trains with: its whole share, less --workers' reserve
            torch.set_num_threads(share - share // CORES_PER_CPU_LOADER if config.workers is not None else share)
        mine = is_main_process() and remembered_or_measured(
            config, plan, device, processes_here, train_set, held, candidates
        )
        choice = broadcast_object(mine)  # DDP: every rank trains as rank 0 chose
    workers = 0 if choice.on_device else choice.workers if config.workers is None else config.workers
    threads = None
    if device.type == "cpu":  # --workers changes the workers, not the threads (machine.core_budget's rule)
        given_workers = config.workers is not None and not choice.on_device
        threads = share - share // CORES_PER_CPU_LOADER if given_workers else max(1, share - workers)
        torch.set_num_threads(threads)
    lines = (*choice.lines, precision_line(choice, config, device), batches_line(choice.on_device, room, config))
    return replace(choice, workers=workers, threads=threads, lines=lines)


def small_micro_batch(config) -> int | None:
    """--micro-batch as given (None: the whole batch, where it is not smaller)."""
    return config.micro_batch if config.micro_batch is not None and config.micro_batch < config.batch_size else None


def remembered_or_measured(config, plan, device, processes_here: int, train_set, held: int | None, candidates: list):
    """The choice remembered for this machine and configuration, else (or with --remeasure) the fastest of
    `candidates`, measured and remembered, each with the lines saying so. `held`: the bytes the training images take
    held on the device (None where they cannot be)."""
    path, key, found = remembered(config, plan, device, processes_here)
    if found is not None:
        return found
    share = torch.get_num_threads() if device.type == "cpu" else cores_per_process(processes_here)
    todo = {
        "workers": config.workers is None and (device.type != "cpu" or share > 1),
        "micro_batch": config.micro_batch is None and memory_limited(device),
        "where": held is not None and config.batches == "auto" and not config.workers,  # --workers N: the loader
        "given_micro_batch": small_micro_batch(config),
        "held": held or 0,
        "world_size": get_world_size(),
    }
    where = "device" if held is not None and config.batches == "device" else "loader"
    if len(candidates) == 1 and not (todo["workers"] or todo["micro_batch"] or todo["where"]):  # nothing to measure
        return replace(candidates[0], micro_batch=todo["given_micro_batch"], batches=where, workers=config.workers or 0)
    start = time.perf_counter()
    with alone():  # the other ranks wait in broadcast_object: rank 0's steps sum nothing with them
        measured = measure(config, plan, device, train_set, candidates, todo)
    choice, lines = decided(measured, config, plan, device, share, todo, where)
    seconds = round(time.perf_counter() - start, 2)
    chose = f"chose {choice.name()}, the fastest" if len(measured.speeds) > 1 else f"{choice.name()} as given"
    facts = {"measured": {candidate.name(): round(speed, 2) for candidate, speed in measured.speeds.items()},
             "load_ms": None if measured.load is None else round(measured.load * 1000, 3), "seconds": seconds,
             "date": datetime.date.today().isoformat()}  # fmt: skip
    line = f"Auto: {chose}; measuring took {seconds:.1f} s"
    return replace(choice, lines=(*lines, line, remember(path, key, choice, facts)))


def decided(measured: Measured, config, plan, device: torch.device, share: int, todo: dict, where: str):
    """(the choice the measured figures make, the lines saying what was measured and why it was chosen)."""
    speeds = measured.speeds
    fastest = max(speeds, key=speeds.get)
    step = 1 / speeds[fastest]
    threads = f"{torch.get_num_threads()} threads" if device.type == "cpu" else str(device)
    figures = ", ".join(f"{candidate.name()} {speed:.1f}" for candidate, speed in speeds.items())
    lines = [*measured.lines, f"Auto: timed training steps of {config.model} at {config.img_size} px, batch "
             f"{config.batch_size}, on {device.type} ({threads}), in img/s: {figures}"]  # fmt: skip
    workers = config.workers or 0
    if todo["workers"]:
        workers, why = choose_workers(device, share, step, measured.load)
        lines.append(f"Auto: {why}")
    if todo["where"]:
        steps = max(1, len(plan.split.train_images) // (config.batch_size * todo["world_size"]))
        on_device, why = choose_batches(device, step, measured.making, measured.load, workers, share, steps)
        where = "device" if on_device else "loader"
        lines.append(f"Auto: {why}")
    return replace(fastest, workers=workers, batches=where), lines


def choose_workers(device: torch.device, share: int, step: float, load: float) -> tuple[int, str]:
    """(loader workers, why) for a process with `share` cores, from the seconds per image of a training step on them
    (`step`) and of loading an image on one core (`load`)."""
    measured = f"a loader worker delivers an image in {load * 1000:.1f} ms, training on it takes {step * 1000:.1f} ms"
    if device.type != "cpu":  # the cores only load: enough workers to keep ahead of the GPU, one core left to drive it
        workers = max(1, min(max(1, share - 1), math.ceil(GPU_LOADER_MARGIN * load / step)))
        return workers, f"{measured}: {workers} loader workers keep ahead of it"

    def per_image(workers: int) -> float:  # estimated: load, then train; or the slower of loading and training
        return load + step if workers == 0 else max(load / workers, step * share / (share - workers))

    workers = min(range(share), key=per_image)
    estimate = ", ".join(f"{w} workers {1 / per_image(w):.0f} img/s" for w in sorted({0, 1, workers}))
    return workers, f"{measured} on {share} threads: {workers} loader workers (estimated: {estimate})"


def choose_batches(device, step: float, on_device: float, load: float, workers: int, share: int, steps: int):
    """(whether to make batches on the device, why), from seconds per image: a training step's, making a batch on the
    device, and loading an image on one core; `workers` loader workers, `share` this process's cores, `steps` an
    epoch's. On the device a batch is made before its step; by the loader, the slower of loading on the workers'
    cores and training on the rest, and each epoch starts by waiting for a worker's first batch."""
    if workers == 0:
        loader = load + step
    elif device.type == "cpu":
        loader = max(load / workers, step * share / max(share - workers, 1)) + load / steps
    else:
        loader = max(load / workers, step) + load / steps
    device_time = step + on_device
    chosen = device_time < loader
    start = ", and each epoch's start" if workers else ""
    return chosen, (
        f"batches made {'on the device' if chosen else 'by the loader'}: there {device_time * 1000:.3f} ms an image "
        f"(the step, and making its batch {on_device * 1000:.3f}); by the loader {loader * 1000:.3f} ({workers} "
        f"workers at {load * 1000:.2f} ms an image each{start})"
    )


def device_batches_room(config, train_set, device: torch.device, processes_here: int) -> tuple[int | None, str]:
    """(the bytes the training images take held on `device`, None where the batches cannot be made there; the line
    saying why not, or the room they take there). They can be with a plain crop and flip (no --auto-augment,
    --random-erase), the images decoded once into memory, and room for them: within DEVICE_SHARE of a GPU's free
    memory, or beside the decoded images on the CPU."""
    if config.batches == "loader":
        return None, "Batches: made by the loader (--batches loader)"
    if device.type not in ("cuda", "cpu"):
        return None, f"Batches: made by the loader: on {device.type}, making them on the device is not measured here"
    try:
        crop_and_flip(train_set.transform)
    except ValueError:
        switch = "--auto-augment" if config.auto_augment != "none" else "--random-erase"
        return None, f"Batches: made by the loader: {switch} has no batched form on the device"
    if train_set.decoded is None:
        return None, "Batches: made by the loader: the images were not decoded into memory (see the Images line)"
    needed, height, width = held_size(train_set, config.img_size)
    if device.type == "cuda":
        room = DEVICE_SHARE * torch.cuda.mem_get_info(device)[0]
        where = f"half of the {room / DEVICE_SHARE / 1e9:.1f} GB free on {device}"
    else:
        budget, why = memory_budget(config.image_cache_gb, processes_here)
        room = (budget or 0) - train_set.decoded.pixels.numel()
        where = f"what the decoded images leave of {why}"
    sizes = f"{len(train_set)} images padded to {height} x {width} px: {needed / 1e9:.2f} GB"
    if needed > room:
        return None, f"Batches: made by the loader: held on {device.type}, {sizes}, more than {where}"
    return needed, f"{sizes}, within {where}"


def amp_candidates(amp: str, device: torch.device) -> tuple[list[str], str]:
    """The --amp values to choose among on `device`, and why. "auto" is float32, and bfloat16 too where the device
    has its arithmetic (GPUs from Ampere on; CPUs with AMX or AVX512-BF16, unless torch is capped below them):
    having it does not make it faster (a Xeon without AMX computes float32 faster), so both are timed. float16 is
    never chosen for you: its gradient scaling skips steps, a change only a flag should make. On mps: float32."""
    if amp != "auto":
        return [amp], f"--amp {amp}"
    if device.type == "mps":
        return ["off"], "--amp auto: autocast on mps is not measured here"
    if device.type == "cuda":
        native = torch.cuda.get_device_capability(device) >= (8, 0)
        why = "this GPU computes bfloat16 natively" if native else "this GPU has no native bfloat16"
    else:
        native, why = cpu_bfloat16()
    return (["off", "bf16"] if native else ["off"]), f"--amp auto: {why}"


def compute_candidates(amp: str, channels_last: bool | None, device: torch.device) -> list[Choice]:
    """Every way of computing the flags allow: amp_candidates' precisions, each in both layouts unless a flag says
    which (NCHW first: the original's float32 NCHW leads)."""
    layouts = [False, True] if channels_last is None else [channels_last]
    return [Choice(precision, layout) for layout in layouts for precision in amp_candidates(amp, device)[0]]


def precision_line(choice: Choice, config, device: torch.device) -> str:
    """E.g. "Precision: float32 (--amp off); memory layout NCHW (--no-channels-last)"."""
    candidates, amp_reason = amp_candidates(config.amp, device)
    if config.amp == "auto" and len(candidates) > 1:
        amp_reason = "--amp auto: the fastest measured"
    if config.channels_last is None:
        layout_reason = "auto: the fastest measured"
    else:
        layout_reason = "--channels-last" if config.channels_last else "--no-channels-last"
    layout = "channels_last" if choice.channels_last else "NCHW"
    return f"Precision: {PRECISION_NAMES[choice.amp]} ({amp_reason}); memory layout {layout} ({layout_reason})"


def batches_line(on_device: bool, room: str, config) -> str:
    """The line saying where the training batches are made, and why."""
    why = f"--batches {config.batches}"
    if on_device:
        return f"Batches: made on the device ({why}), from the training images held there: {room}"
    return room if room.startswith("Batches:") else f"Batches: made by the loader ({why}); on the device, {room}"

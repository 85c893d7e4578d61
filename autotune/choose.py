"""What `auto` chooses: the run's whole choice of how to train (multi_train_utils.train_eval_utils.Choice), taken
once, here, and read by everything else. A flag given is never measured; the rest is timed on this machine for the
run's model and sizes (autotune/timing.py), by rank 0 under DDP, and remembered for later runs
(autotune/remembered.py). What each choice weighs: docs/performance.md, Machines."""

import datetime
import math
import time
from dataclasses import replace

import torch

from autotune.remembered import remember, remembered
from autotune.timing import measure
from dataset.on_device import STAGING, crop_and_flip, held_bytes
from machine import CORES_PER_CPU_LOADER, cores_per_process, cpu_bfloat16
from multi_train_utils.distributed_utils import alone, broadcast_object, get_world_size, is_main_process
from multi_train_utils.memory import memory_limited
from multi_train_utils.train_eval_utils import Choice
from utils import UserError

GPU_LOADER_MARGIN = 1.5  # workers enough to load this much faster than the GPU trains (JPEGs vary in size)
DEVICE_SHARE = 0.5  # of a GPU's free memory, at most, for the images held there: the rest is the training's
PRECISION_NAMES = {"off": "float32", "bf16": "bfloat16 autocast", "fp16": "float16 autocast with gradient scaling"}


def choose(config, plan, device: torch.device, processes_here: int, train_set) -> Choice:
    """The run's choice, the same on every rank, with its lines (`processes_here` processes share this machine).
    Sets this process's compute threads (on the CPU: its share of the cores less its loader workers)."""
    given = config.amp != "auto" and config.channels_last is not None and config.workers is not None
    given = given and (config.micro_batch is not None or not memory_limited(device))
    candidates = compute_candidates(config.amp, config.channels_last, device)
    share = cores_per_process(processes_here)
    beside_workers = share - share // CORES_PER_CPU_LOADER  # the threads beside --workers (machine.core_budget's rule)
    where, held, room = device_batches_room(config, train_set, device)  # where: None if they cannot be made there
    if config.batches == "device" and where is None:
        raise UserError(f"--batches device: {room.removeprefix('Batches: made by the loader: ')}")
    if given:
        choice = Choice(config.amp, config.channels_last, small_micro_batch(config), "device", config.workers)
        choice = replace(choice, batches=where if where is not None and config.batches == "device" else "loader")
    else:
        if device.type == "cpu":  # measured on the threads it trains with: its whole share, less --workers' reserve
            torch.set_num_threads(beside_workers if config.workers is not None else share)
        mine = is_main_process() and remembered_or_measured(config, plan, device, processes_here, train_set, held,
                                                            where, candidates)  # fmt: skip
        choice = broadcast_object(mine)  # DDP: every rank trains as rank 0 chose
        if choice.on_device:  # held or streamed: as the images fit the device today, whatever was remembered
            choice = replace(choice, batches=where)
    workers = 0 if choice.on_device else choice.workers if config.workers is None else config.workers
    threads = None
    if device.type == "cpu":  # --workers changes the workers, not the threads
        threads = beside_workers if config.workers is not None and not choice.on_device else max(1, share - workers)
        torch.set_num_threads(threads)
    why = f"--batches {config.batches}"
    if choice.on_device:
        room = f"Batches: made on the device ({why}), {room}"
    elif not room.startswith("Batches:"):
        room = f"Batches: made by the loader ({why}); on the device, {room}"
    lines = (*choice.lines, precision_line(choice, config, device), room)
    return replace(choice, workers=workers, threads=threads, lines=lines)


def small_micro_batch(config) -> int | None:
    """--micro-batch as given (None: the whole batch, where it is not smaller)."""
    return config.micro_batch if config.micro_batch is not None and config.micro_batch < config.batch_size else None


def remembered_or_measured(config, plan, device, processes_here: int, train_set, held: int, where, candidates: list):
    """The choice remembered for this machine and configuration, else (or with --remeasure) the fastest of
    `candidates`, measured and remembered. `held`: the bytes the images take on the device; `where` the batches can
    be made there (device_batches_room; None: nowhere)."""
    path, key, found = remembered(config, plan, device, processes_here)
    if found is not None:
        return found
    share = torch.get_num_threads() if device.type == "cpu" else cores_per_process(processes_here)
    todo = {"workers": config.workers is None and (device.type != "cpu" or share > 1),
            "micro_batch": config.micro_batch is None and memory_limited(device), "held": held,
            "where": where is not None and config.batches == "auto" and not config.workers,  # --workers N: the loader
            "given_micro_batch": small_micro_batch(config), "world_size": get_world_size()}  # fmt: skip
    where = "device" if where is not None and config.batches == "device" else "loader"
    if len(candidates) == 1 and not (todo["workers"] or todo["micro_batch"] or todo["where"]):  # nothing to measure
        return replace(candidates[0], micro_batch=todo["given_micro_batch"], batches=where, workers=config.workers or 0)
    start = time.perf_counter()
    with alone():  # the other ranks wait in broadcast_object: rank 0's steps sum nothing with them
        measured = measure(config, plan, device, train_set, candidates, todo)
    fastest = max(measured.speeds, key=measured.speeds.get)
    step = 1 / measured.speeds[fastest]
    threads = f"{torch.get_num_threads()} threads" if device.type == "cpu" else str(device)
    figures = ", ".join(f"{candidate.name()} {speed:.1f}" for candidate, speed in measured.speeds.items())
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
    choice = replace(fastest, workers=workers, batches=where)
    seconds = round(time.perf_counter() - start, 2)
    chose = f"chose {choice.name()}, the fastest" if len(measured.speeds) > 1 else f"{choice.name()} as given"
    facts = {"measured": {candidate.name(): round(speed, 2) for candidate, speed in measured.speeds.items()},
             "load_ms": None if measured.load is None else round(measured.load * 1000, 3), "seconds": seconds,
             "date": datetime.date.today().isoformat()}  # fmt: skip
    line = f"Auto: {chose}; measuring took {seconds:.1f} s"
    return replace(choice, lines=(*lines, line, remember(path, key, choice, facts)))


def choose_workers(device: torch.device, share: int, step: float, load: float) -> tuple[int, str]:
    """(loader workers, why) for a process of `share` cores, from seconds per image: a step's, one core's load."""
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
    """(whether to make batches on the device, why), from seconds per image; `steps`: an epoch's."""
    if workers == 0:
        loader = load + step
    elif device.type == "cpu":
        loader = max(load / workers, step * share / max(share - workers, 1)) + load / steps
    else:
        loader = max(load / workers, step) + load / steps
    device_time = step + on_device
    chosen = device_time < loader
    start, made = ", and each epoch's start" if workers else "", "on the device" if chosen else "by the loader"
    return chosen, (f"batches made {made}: there {device_time * 1000:.3f} ms an image (the step, and making its batch "
                    f"{on_device * 1000:.3f}); by the loader {loader * 1000:.3f} ({workers} workers at "
                    f"{load * 1000:.2f} ms an image each{start})")  # fmt: skip


def device_batches_room(config, train_set, device: torch.device) -> tuple[str | None, int, str]:
    """(where batches can be made on `device`: "device" from the training images held there, "stream" from the store
    a few batches ahead, None: not there; the bytes held there; the line saying why). Held where they fit
    --device-images-gb (by default half a GPU's free memory; on the CPU the mapped store is held already)."""
    if config.batches == "loader":
        return None, 0, "Batches: made by the loader (--batches loader)"
    if device.type not in ("cuda", "cpu"):
        return None, 0, f"Batches: made by the loader: on {device.type}, making them on the device is not measured here"
    try:
        crop_and_flip(train_set.transform)
    except ValueError:
        switch = "--auto-augment" if config.auto_augment != "none" else "--random-erase"
        return None, 0, f"Batches: made by the loader: {switch} has no batched form on the device"
    if train_set.decoded is None:
        return None, 0, "Batches: made by the loader: the images are in no store (see the Images line)"
    held = held_bytes(train_set.decoded)
    needed = held + STAGING  # what holding them takes on the device, at its peak: while a chunk is copied there
    if config.device_images_gb is not None:
        room, where = config.device_images_gb * 1e9, f"the {config.device_images_gb:g} GB of --device-images-gb"
    elif device.type == "cuda":
        room = DEVICE_SHARE * torch.cuda.mem_get_info(device)[0]
        where = f"half of the {room / DEVICE_SHARE / 1e9:.1f} GB free on {device}"
    else:
        stored = train_set.decoded.bytes / 1e9
        return "device", 0, f"from the {len(train_set)} training images mapped from the store ({stored:.2f} GB)"
    sizes = f"the {len(train_set)} training images take {needed / 1e9:.2f} GB"
    if needed > room:
        return "stream", 0, f"streamed from the store a few batches ahead of the step: {sizes}, more than {where}"
    return ("device", held if device.type == "cuda" else 0,
            f"from the training images held there: {sizes}, within {where}")  # fmt: skip


def amp_candidates(amp: str, device: torch.device) -> tuple[list[str], str]:
    """The --amp values to choose among on `device`, and why (float16 only by --amp fp16: its scaler skips steps)."""
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
    """Every way of computing the flags allow, amp_candidates' precisions in each layout (the original's NCHW first)."""
    layouts = [False, True] if channels_last is None else [channels_last]
    return [Choice(precision, layout) for layout in layouts for precision in amp_candidates(amp, device)[0]]


def precision_line(choice: Choice, config, device: torch.device) -> str:
    """E.g. "Precision: float32 (--amp off); memory layout NCHW (--no-channels-last)"."""
    candidates, amp_reason = amp_candidates(config.amp, device)
    if config.amp == "auto" and len(candidates) > 1:
        amp_reason = "--amp auto: the fastest measured"
    layout_reason = {None: "auto: the fastest measured", True: "--channels-last", False: "--no-channels-last"}
    layout = f"{'channels_last' if choice.channels_last else 'NCHW'} ({layout_reason[config.channels_last]})"
    return f"Precision: {PRECISION_NAMES[choice.amp]} ({amp_reason}); memory layout {layout}"

"""What `auto` chooses, by measuring: the precision, the memory layout and the number of loader workers that
train fastest on this machine, for the run's model, image size and batch size; remembered, so that later runs
start at once.

--amp, --channels-last and --workers leave these to auto unless given. A given flag always wins and is never
measured. For the rest, a run times what it may choose between before it trains:

- precision and layout: a few training steps (forward, loss, backward, optimizer step) of the run's model on a
  synthetic batch of the run's size, in each candidate (recipe/precision.py compute_candidates: float32, and
  bfloat16 where the device has its instructions, each in NCHW and channels_last), after an untimed warm-up step
  (it allocates memory and picks kernels). The steps take turns, so that a machine whose speed drifts (a shared
  CPU, a GPU warming up) slows every candidate alike, and each keeps its fastest step: one round, and more (up to
  MAX_ROUNDS) only while the measuring stays within MEASURE_SHARE of the run's training (at the demo's size on 2
  cores: one round, 8 steps against the demo's 144). The fastest candidate wins.
- loader workers: the seconds per image one loader worker delivers (time_loading: a DataLoader of one worker, a few
  of the run's batches cropped and flipped, read and decoded first where the images were not decoded once into
  memory, collated and shipped to this process as the scripts' loaders ship them), against the seconds per image of
  the chosen step. On a GPU the cores only load, so enough workers to load faster than the GPU trains, with room to
  spare. On the CPU every worker takes a core from the compute threads, so the count whose estimated speed is best
  (no worker: load, then train; w workers: the slower of loading on w cores and training on the rest), estimated
  from the two measurements: one worker is started to time it, not every count.
- where batches are made (run/batches.py): where the images fit on the device, the seconds making a batch there
  takes, against the loader's (with each epoch's start, waiting for a worker's first batch).

The choice is printed, with what was measured, and kept in a small JSON file (cache_file: delete it at will, or
pass --remeasure) under a key naming the machine (processor, the instruction set torch computes with and the
environment variables that cap it, the cores this process may use, the GPU), the torch version and the
configuration (model, image size, batch size, device type, processes sharing the machine, the flags given, the
data). A run whose key is there starts at once with that choice; any other measures anew.

Under DDP, rank 0 measures (or reads the file) while the other ranks wait, and every rank trains with its choice:
each step then computes the same thing on every rank, and the ranks do not compete for the cores they share
while one of them measures. On several machines, rank 0's choice holds on all of them (a job's machines are
normally alike).
"""

import datetime
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from filelock import FileLock, Timeout
from torch.utils.data import DataLoader

from machine import AVX2_CAPS, available_cores, cores_per_process, cpu_bfloat16, cpu_name, torch_cpu_isa, use_cores
from model import create_model, enable_grad_checkpointing, freeze_all_but_head
from multi_train_utils.distributed_utils import (
    broadcast_object,
    get_world_size,
    is_main_process,
    print_once,
    shuffled_batches,
)
from multi_train_utils.memory import OutOfMemory, largest_that_fits, memory_limited, pass_fits
from multi_train_utils.stop_and_resume import ignore_stop_signals
from read_back import NUMBER, misfits, read_json
from recipe.loss import Objective
from recipe.precision import AMP_DTYPES, Compute, amp_flag, choose_compute, short_name, summary
from run.batches import (
    choose_batches,
    device_batches_possible,
    device_seconds_per_image,
    held_bytes,
    steps_per_epoch,
)
from run.plan import note_inexact_resume
from utils import OutputError, UserError, warn, write_json

# Where the choices are kept (a file path), instead of the user's cache folder: for tests, or a shared disk.
CACHE_ENV = "FLOWERS_AUTOTUNE_CACHE"
CACHE_VERSION = 2  # 2: where batches are made (Choice.batches)
ON_WINDOWS = os.name == "nt"
MAX_ROUNDS = 3  # timed samples per candidate, taken in turns: the fastest of them counts
MEASURE_SHARE = 0.05  # more than one round only while the measuring stays within this share of the run's training
SAMPLE_SECONDS = 0.05  # a timed sample is at least this long (several steps where a step is quicker)
LOAD_IMAGES = 16  # training images loaded to time loading in this process (after one untimed)
LOADER_BATCHES = 3  # batches a loader worker delivers to time it (after its first)
GPU_LOADER_MARGIN = 1.5  # workers enough to load this much faster than the GPU trains (JPEGs vary in size)


@dataclass(frozen=True)
class Choice:
    """How a run trains where flags left it to auto (`micro_batch`: None for the whole batch), and what that was
    decided from: `measured` is each timed candidate's training images per second, `load_ms` one core's
    milliseconds to load an image, `seconds` what the measuring took, `lines` what the run printed about it."""

    amp: str
    channels_last: bool
    workers: int
    measured: dict = field(default_factory=dict)
    load_ms: float | None = None
    seconds: float = 0.0
    date: str = ""
    lines: tuple = ()
    micro_batch: int | None = None
    batches: str = "loader"  # where training batches are made: "device" or "loader" (run/batches.py)

    @property
    def compute(self) -> Compute:
        return Compute(AMP_DTYPES[self.amp], self.channels_last, self.micro_batch, self.batches == "device")


# A remembered choice in the cache file, as remember() writes it (read_back.misfits' shapes)
CHOICE_SHAPE = {"amp": str, "channels_last": bool, "workers": int, "micro_batch": (int, type(None)),
                "measured": dict, "load_ms": (NUMBER, type(None)), "seconds": NUMBER, "date": str,
                "lines": list, "batches": str}  # fmt: skip
ENTRY_SHAPE = {"key": dict, "choice": CHOICE_SHAPE}


def tune(config, plan, device: torch.device, processes_here: int, train_set) -> tuple[int, Compute]:
    """This process's loader workers and how it computes: what the flags give, the rest measured on this machine
    (or remembered from an earlier run), the same on every rank; loading is timed on `train_set`. Sets this
    process's compute threads on the CPU (its share of the cores, less its loader workers) and prints the choice."""
    possible, room = device_batches_possible(config, train_set, device, processes_here)
    if config.batches == "device" and not possible:
        raise UserError(f"--batches device: {room.removeprefix('Batches: made by the loader: ')}")
    given = config.amp != "auto" and config.channels_last is not None and config.workers is not None
    if given and (config.micro_batch is not None or not memory_limited(device)):
        on_device = possible and config.batches == "device"  # auto, with nothing measured: the loader
        workers = use_cores(device, processes_here, config.batch_size, 0 if on_device else config.workers)
        compute, line = choose_compute(config.amp, config.channels_last, device)
        print_once(line)
        print_once(batches_line(on_device, room, f"--batches {config.batches}"))
        compute = replace(compute, micro_batch=given_micro_batch(config), on_device=on_device)
        note_inexact_resume(config, plan.saved, get_world_size(), compute.micro_batch)
        return workers, compute
    threads = share_cores(device, processes_here, config)
    if is_main_process():
        choice = cached_or_measured(config, plan, device, processes_here, train_set, (possible, room))
    choice = broadcast_object(choice if is_main_process() else None)  # DDP: every rank trains as rank 0 chose
    workers = 0 if choice.compute.on_device else choice.workers if config.workers is None else config.workers
    if device.type == "cpu" and (config.workers is None or choice.compute.on_device):
        torch.set_num_threads(max(1, threads - workers))  # the workers' cores are taken from the compute threads
    for line in choice.lines:
        print_once(line)
    print_once(summary(choice.compute, *reasons(config, device)))
    print_once(batches_line(choice.compute.on_device, room, f"--batches {config.batches}"))
    note_inexact_resume(config, plan.saved, get_world_size(), choice.compute.micro_batch)
    return workers, choice.compute  # with the micro-batch measured, remembered or given (the cache key holds it)


def batches_line(on_device: bool, room: str, why: str) -> str:
    """The line saying where the training batches are made, and why."""
    if on_device:
        return f"Batches: made on the device ({why}), from the training images held there: {room}"
    return room if room.startswith("Batches:") else f"Batches: made by the loader ({why}); on the device, {room}"


def given_micro_batch(config) -> int | None:
    """--micro-batch as given (None: the whole batch, where it is not smaller)."""
    return config.micro_batch if config.micro_batch is not None and config.micro_batch < config.batch_size else None


def share_cores(device: torch.device, processes_here: int, config) -> int:
    """Set this process's compute threads for measuring (on the CPU: its whole share when the workers are left to
    auto, which takes theirs away afterwards; else as for --workers) and return them."""
    if config.workers is not None:
        use_cores(device, processes_here, config.batch_size, config.workers)
    elif device.type == "cpu":
        torch.set_num_threads(cores_per_process(processes_here))
    return torch.get_num_threads()


def reasons(config, device: torch.device) -> tuple[str, str]:
    """Why the precision and the layout are what they are: a flag, the only candidate, or the fastest measured."""
    candidates, amp_reason = amp_candidates(config.amp, device)
    if config.amp == "auto" and len(candidates) > 1:
        amp_reason = "--amp auto: the fastest measured"
    if config.channels_last is None:
        return amp_reason, "auto: the fastest measured"
    return amp_reason, "--channels-last" if config.channels_last else "--no-channels-last"


def cached_or_measured(config, plan, device: torch.device, processes_here: int, train_set, batches) -> Choice:
    """The choice remembered for this machine and configuration, else (or with --remeasure) a new one, measured
    and remembered. `batches`: whether the batches can be made on the device, and the line saying so."""
    path, key = cache_file(), cache_key(config, plan, device, processes_here)
    if not config.remeasure:
        cached = remembered(path, key)
        if cached is not None:
            return cached
    choice = measure(config, plan, device, processes_here, train_set, batches)
    if not choice.measured:
        return choice  # nothing was left to measure here (one candidate, no core to spare for a loader)
    kept = remember(path, key, choice)
    where = f"remembered in {path} (delete it, or pass --remeasure, to measure again)" if kept else kept_not(path)
    return Choice(**{**asdict(choice), "lines": (*choice.lines, f"Auto: {where}")})


def measure(config, plan, device: torch.device, processes_here: int, train_set, batches) -> Choice:
    """Time the candidates (precision, layout) the flags leave open, then the loading of `train_set`, then (where
    `batches` says they can be) making batches on the device, and choose."""
    start = time.perf_counter()
    candidates = compute_candidates(config.amp, config.channels_last, device)
    share = torch.get_num_threads() if device.type == "cpu" else cores_per_process(processes_here)
    workers_to_choose = config.workers is None and (device.type != "cpu" or share > 1)
    to_fit = config.micro_batch is None and memory_limited(device)
    possible = batches[0]
    where_to_choose = possible and config.batches == "auto" and not config.workers  # --workers N: the loader
    where = "device" if possible and config.batches == "device" else "loader"
    if len(candidates) == 1 and not workers_to_choose and not to_fit and not where_to_choose:
        only = candidates[0]
        return Choice(amp_flag(only), only.channels_last, config.workers or 0,
                      micro_batch=given_micro_batch(config), batches=where)  # fmt: skip
    held = held_bytes(train_set, config.img_size) if possible else 0  # beside the training, if chosen
    micro_batch, lines = fitting_micro_batch(config, plan, device, candidates[0], held) if to_fit else (None, [])
    candidates = [replace(candidate, micro_batch=micro_batch or given_micro_batch(config)) for candidate in candidates]
    try:
        seconds = time_candidates(candidates, config, plan, device)
    except torch.OutOfMemoryError:  # a --micro-batch given by hand (auto's was found to fit)
        raise OutOfMemory(
            f"--micro-batch {config.micro_batch} does not fit in the memory of {config.model} at {config.img_size} "
            f"px on {device}: give a smaller one, or leave it to auto"
        ) from None
    speeds = {candidate: 1 / seconds[candidate] for candidate in candidates}
    fastest = max(speeds, key=speeds.get)
    lines.append(measured_line(speeds, config, device))
    workers, load_ms = config.workers or 0, None
    if workers_to_choose or where_to_choose:
        load = time_loading(train_set, config.batch_size, device.type == "cuda")
        load_ms = round(load * 1000, 3)
    if workers_to_choose:
        workers, why = choose_workers(device, share, 1 / speeds[fastest], load)
        lines.append(f"Auto: {why}")
    if where_to_choose:
        making = device_seconds_per_image(train_set, config.batch_size, device, fastest.memory_format)
        steps = steps_per_epoch(config, plan, get_world_size())
        on_device, why = choose_batches(device, 1 / speeds[fastest], making, load, workers, share, steps)
        where = "device" if on_device else "loader"
        lines.append(f"Auto: {why}")
    elapsed = round(time.perf_counter() - start, 2)
    chose = f"chose {short_name(fastest)}, the fastest" if len(candidates) > 1 else f"{short_name(fastest)} as given"
    lines.append(f"Auto: {chose}; measuring took {elapsed:.1f} s")
    return Choice(
        amp_flag(fastest), fastest.channels_last, workers, {short_name(c): round(s, 2) for c, s in speeds.items()},
        load_ms, elapsed, datetime.date.today().isoformat(), tuple(lines), fastest.micro_batch, where,
    )  # fmt: skip


def fitting_micro_batch(
    config, plan, device: torch.device, hungriest: Compute, held: int = 0
) -> tuple[int | None, list[str]]:
    """The largest micro-batch of the run's model that fits `device` (None: the whole --batch-size), and the line
    saying so: forward and backward passes of the run's model on synthetic batches, in `hungriest`'s precision
    (float32, the candidate whose activations take most memory: autocast keeps many of them in 16 bits), alongside
    what training holds besides (the optimizer's moments, one copy of the weights for SGD's momentum and two for
    AdamW's, and one more for DDP's gradient buckets). UserError where not even one image fits."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model = measured_model(config, len(plan.split.classes), device).to(memory_format=hungriest.memory_format)
        trained = [p for p in model.parameters() if p.requires_grad]
        copies = (2 if config.opt == "adamw" else 1) + (get_world_size() > 1)
        reserve = copies * sum(p.numel() * p.element_size() for p in trained) + held
        images = torch.randn(config.batch_size, 3, config.img_size, config.img_size, device=device)
        images = images.contiguous(memory_format=hungriest.memory_format)
        size = largest_that_fits(lambda m: pass_fits(model, hungriest, images[:m], reserve, train=True), len(images))
    where = f"{config.model} at {config.img_size} px on {device}"
    if size == 0:
        raise UserError(
            f"not even one image fits in the memory of {where}: a smaller --img-size, --grad-checkpointing, "
            "or a device with more memory"
        )
    if size == config.batch_size:
        return None, [f"Auto: the whole batch of {size} images fits in the memory of {where}"]
    return size, [
        f"Auto: micro-batches of {size} images, the most that fit in the memory of {where}: each step sums "
        f"the gradients of {math.ceil(config.batch_size / size)} of them (--batch-size {config.batch_size} unchanged)"
    ]


def measured_model(config, num_classes: int, device: torch.device):
    """A model such as the run trains (not its weights), for measuring: the run's random state is the caller's to
    keep (the initial weights and dropout draw from the global generators)."""
    model = create_model(num_classes, config.model)
    if config.freeze_layers:
        freeze_all_but_head(model, config.model)
    if config.grad_checkpointing:  # its memory and its time: each block computed twice
        enable_grad_checkpointing(model, config.model)
    return model.to(device).train()


def measured_line(speeds: dict, config, device: torch.device) -> str:
    where = f"{torch.get_num_threads()} threads" if device.type == "cpu" else str(device)
    figures = ", ".join(f"{short_name(candidate)} {speed:.1f}" for candidate, speed in speeds.items())
    return (
        f"Auto: timed training steps of {config.model} at {config.img_size} px, batch {config.batch_size}, on "
        f"{device.type} ({where}), in img/s: {figures}"
    )


def time_candidates(candidates: list[Compute], config, plan, device: torch.device) -> dict:
    """Seconds per image of a training step of the run's model in each candidate, on a synthetic batch of the
    run's size: the fastest of its timed steps, taken in turns (take_turns) after one untimed step each (two on a
    GPU, whose first step also sets up its libraries). The run's random state is left as it was."""
    num_classes = len(plan.split.classes)
    # What this process will train: its share of the training images, every epoch
    images = config.epochs * len(plan.split.train_images) / get_world_size()
    # The model's initial weights (and dropout, in models that have it) draw from the global generators
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model = measured_model(config, num_classes, device)
        steps = stepper(model, candidates, config.batch_size, config.img_size, num_classes, device)
        best = take_turns(steps, candidates, 1 if device.type == "cpu" else 2, images / config.batch_size)
    del model, steps
    if device.type == "cuda":  # the run's own memory figures should not include the measuring
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return {candidate: seconds / config.batch_size for candidate, seconds in best.items()}


def take_turns(steps, candidates: list[Compute], warm_up: int, run_steps: float) -> dict:
    """The fastest step of each candidate, in seconds: `warm_up` untimed steps each, then rounds of timed samples
    (a step, or several where a step is quicker than SAMPLE_SECONDS), one per candidate in turn. The first round
    always; more, up to MAX_ROUNDS, while the measuring stays within MEASURE_SHARE of the `run_steps` training
    steps the run will take (at the fastest speed so far): a short run measures briefly, a long one closer."""
    start = time.perf_counter()
    warmed = {candidate: [steps(candidate, 1) for _ in range(warm_up)][-1] for candidate in candidates}
    count = {candidate: max(1, math.ceil(SAMPLE_SECONDS / seconds)) for candidate, seconds in warmed.items()}
    best = {candidate: math.inf for candidate in candidates}
    for _ in range(MAX_ROUNDS):
        round_start = time.perf_counter()
        for candidate in candidates:
            best[candidate] = min(best[candidate], steps(candidate, count[candidate]) / count[candidate])
        now = time.perf_counter()
        if now - start + (now - round_start) > MEASURE_SHARE * run_steps * min(best.values()):
            break  # another round would take the measuring past its share of the run
    return best


def stepper(model, candidates: list[Compute], batch_size: int, img_size: int, num_classes: int, device):
    """steps(candidate, count): the seconds `count` training steps of `model` take in `candidate`, on one
    synthetic batch. The optimizer is plain SGD: momentum or AdamW would add the same cost to every candidate
    (the weights are float32 in all of them), and their state would keep the layout of the first candidate."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(batch_size, 3, img_size, img_size, generator=generator)
    labels = torch.randint(0, num_classes, (batch_size,), generator=generator).to(device)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    scalers = {candidate: candidate.grad_scaler(device) for candidate in candidates}

    def steps(candidate: Compute, count: int) -> float:
        model.to(memory_format=candidate.memory_format)  # in place; nothing to do when the layout is the same
        batch = candidate.batch_to(images, device)
        synchronize(device)
        start = time.perf_counter()
        for _ in range(count):
            training_step(model, optimizer, scalers[candidate], candidate, batch, labels)
        synchronize(device)
        return time.perf_counter() - start

    return steps


def training_step(model, optimizer, scaler, compute: Compute, images, labels) -> torch.Tensor:
    """One training step as train_one_epoch takes it: forward under autocast, cross-entropy, the scaled backward
    pass (one per micro-batch), the optimizer's step. Returns the loss (reading it makes the CPU wait for the
    device)."""
    loss = torch.zeros((), device=images.device)
    for piece, piece_labels, _ in Objective.pieces(images, labels, None, compute.micro_batch):
        with compute.autocast(images.device):
            piece_loss = torch.nn.functional.cross_entropy(model(piece), piece_labels, reduction="sum") / len(images)
        scaler.scale(piece_loss).backward()
        loss += piece_loss.detach()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def synchronize(device: torch.device) -> None:
    """Wait until the device has finished the work queued on it (the CPU computes as it is asked)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def time_loading(train_set, batch_size: int = LOAD_IMAGES, pin_memory: bool = False) -> float:
    """Seconds per image that one loader worker delivers to this process: a DataLoader of `train_set` with one
    worker, its batches of `batch_size` seeded, cropped and flipped (read and decoded first where the images were not
    decoded once into memory), collated and shipped through shared memory as the scripts' loaders do (and pinned,
    `pin_memory`, where the run trains on a GPU), timed over LOADER_BATCHES batches after its first (the worker's
    start). Where the set holds too few batches for that, the images are loaded in this process, one thread, as a
    worker computes, LOAD_IMAGES of them after an untimed first."""
    batches = shuffled_batches(train_set, batch_size, seed=0)
    if len(batches) < LOADER_BATCHES + 1:
        return time_loading_here(train_set)
    # One batch asked for at a time: each one timed is made after the last one arrived, never ahead of the clock
    loading = {"num_workers": 1, "pin_memory": pin_memory, "worker_init_fn": ignore_stop_signals, "prefetch_factor": 1}
    loaded = iter(DataLoader(train_set, batch_sampler=batches, **loading))
    next(loaded)  # the worker starts, and loads its first batch
    start = time.perf_counter()
    for _ in range(LOADER_BATCHES):
        next(loaded)
    seconds = time.perf_counter() - start
    del loaded  # the worker stops
    return seconds / (LOADER_BATCHES * batch_size)


def time_loading_here(train_set) -> float:
    """Seconds one core takes to load one image of `train_set` in this process: one thread, as a worker computes,
    the mean over LOAD_IMAGES images after an untimed first one (it imports image plug-ins)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_set[(0, 0)]
        count = min(LOAD_IMAGES, len(train_set))
        start = time.perf_counter()
        for index in range(count):
            train_set[(index, index)]  # (index, augmentation seed), as the loader asks
        return (time.perf_counter() - start) / count
    finally:
        torch.set_num_threads(threads)


def choose_workers(device: torch.device, share: int, step: float, load: float) -> tuple[int, str]:
    """(loader workers, why) for a process with `share` cores, from the seconds per image of a training step on
    them (`step`) and of loading an image on one core (`load`); see the top of this file."""
    measured = f"a loader worker delivers an image in {load * 1000:.1f} ms, training on it takes {step * 1000:.1f} ms"
    if device.type != "cpu":  # the cores only load: enough workers to keep ahead of the GPU, one core left to drive it
        workers = max(1, min(max(1, share - 1), math.ceil(GPU_LOADER_MARGIN * load / step)))
        return workers, f"{measured}: {workers} loader workers keep ahead of it"

    def per_image(workers: int) -> float:  # estimated seconds per image with `workers` of the share's cores loading
        return load + step if workers == 0 else max(load / workers, step * share / (share - workers))

    workers = min(range(share), key=per_image)
    estimate = ", ".join(f"{w} workers {1 / per_image(w):.0f} img/s" for w in sorted({0, 1, workers}))
    return workers, f"{measured} on {share} threads: {workers} loader workers (estimated: {estimate})"


def amp_candidates(amp: str, device: torch.device) -> tuple[list[str], str]:
    """The --amp values to choose among on `device`, and why (the phrase the printed line gives).

    A given value is the only one. "auto" is float32, and bfloat16 too where the device has bfloat16 arithmetic
    (GPUs from Ampere on; CPUs with AMX or AVX512-BF16, unless ATEN_CPU_CAPABILITY or ONEDNN_MAX_CPU_ISA cap
    torch below them): elsewhere bfloat16 is emulated and slower than float32, not worth timing. Having the
    instructions does not make it faster: run/autotune.py times both (on a Xeon with AVX512-BF16 but no
    AMX, float32 is faster). float16 is never chosen for you: its gradient scaling skips steps that overflow, a
    change to training that only a flag should make. On a Mac's GPU (mps) auto is float32: autocast there is not
    checked here.
    """
    if amp != "auto":
        return [amp], f"--amp {amp}"
    if device.type == "mps":
        return ["off"], "--amp auto: autocast on mps is not measured here"
    if device.type == "cuda":
        native = torch.cuda.get_device_capability(device) >= (8, 0)  # Ampere and later compute bf16 natively
        why = "this GPU computes bfloat16 natively" if native else "this GPU has no native bfloat16"
    else:
        native, why = cpu_bfloat16()
    return (["off", "bf16"] if native else ["off"]), f"--amp auto: {why}"


def compute_candidates(amp: str, channels_last: bool | None, device: torch.device) -> list[Compute]:
    """Every way of computing the flags allow: the precisions of amp_candidates, each in both memory layouts
    unless --channels-last or --no-channels-last says which (NCHW first: the original's float32 NCHW leads)."""
    layouts = [False, True] if channels_last is None else [channels_last]
    precisions = amp_candidates(amp, device)[0]
    return [Compute(AMP_DTYPES[precision], layout) for layout in layouts for precision in precisions]


def cache_file() -> Path:
    """The file of remembered choices: $FLOWERS_AUTOTUNE_CACHE if set; else in the user's cache folder (Windows:
    %LOCALAPPDATA%; elsewhere $XDG_CACHE_HOME, by default ~/.cache)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    if ON_WINDOWS:
        base = os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local"
    else:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "flower-training" / "autotune.json"


def cache_key(config, plan, device: torch.device, processes_here: int) -> dict:
    """What a remembered choice holds for: the machine as torch computes on it, torch, and the configuration."""
    machine = {
        "cpu": cpu_name(),
        "torch_cpu_isa": torch_cpu_isa(),
        "isa_caps": {name: os.environ[name] for name in AVX2_CAPS if name in os.environ},
        "cores": available_cores(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
    }
    run = {name: getattr(config, name) for name in ("model", "img_size", "batch_size", "freeze_layers", "opt")}
    run["grad_checkpointing"] = config.grad_checkpointing
    run |= {name: getattr(config, name) for name in ("amp", "channels_last", "workers", "micro_batch", "auto_augment")}
    run |= {"random_erase": config.random_erase, "batches": config.batches}
    run |= {"device": device.type, "processes_here": processes_here, "data": str(Path(plan.data_path).resolve())}
    return machine | run


def remembered(path: Path, key: dict) -> Choice | None:
    """The choice the file holds for `key`, with the line saying so; None if it holds none. A damaged file (cut
    short, edited by hand, of another version) holds none: one warning says so, and remember() replaces it."""
    try:
        entries = read_entries(path)
    except UserError as damage:
        warn(f"{damage}: measuring again, and replacing it")
        return None
    found = next((entry["choice"] for entry in entries if entry["key"] == key), None)
    if found is None:
        return None
    choice = Choice(**{name: found.get(name) for name in CHOICE_SHAPE})  # (fields a later version adds: not read)
    line = (
        f"Auto: {short_name(choice.compute)}, "
        + ("batches made on the device" if choice.batches == "device" else f"{choice.workers} loader workers")
        + (f", micro-batches of {choice.micro_batch}" if choice.micro_batch else "")
        + f", as measured on {choice.date} for "
        f"this machine and configuration ({path}; --remeasure measures again)"
    )
    return Choice(**{**asdict(choice), "lines": (line,)})


def read_entries(path: Path) -> list[dict]:
    """The file's entries, {"key": ..., "choice": ...} each (none before it is written); UserError naming it if it
    is not one this code wrote whole: not JSON, another version, an entry of another shape or a choice no run
    makes (an --amp unknown, workers below 0)."""
    if not path.exists():
        return []
    cache = read_json(path, "autotune cache")
    if cache.get("version") != CACHE_VERSION:
        raise UserError(f"autotune cache {path} is of another version ({cache.get('version')!r}, not {CACHE_VERSION})")
    damage = misfits(cache, {"entries": [ENTRY_SHAPE]})
    for entry in [] if damage else cache["entries"]:
        choice = entry["choice"]
        damage += [f"amp {choice['amp']!r} is no --amp"] * (choice["amp"] not in AMP_DTYPES)
        damage += [f"workers is {choice['workers']}"] * (choice["workers"] < 0)
        damage += [f"batches {choice['batches']!r} is no --batches"] * (choice["batches"] not in ("device", "loader"))
    if damage:
        raise UserError(f"autotune cache {path} is damaged ({'; '.join(damage[:3])})")
    return cache["entries"]


def remember(path: Path, key: dict, choice: Choice) -> bool:
    """Add (or replace) the choice for `key` in the file: under a lock, so that runs starting together all keep
    theirs, and written whole or not at all (utils.write_atomically); a damaged file is replaced. False if the
    file cannot be written (the run trains all the same)."""
    entry = {"key": key, "choice": {**asdict(choice), "lines": []}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{path}.lock", timeout=60):
            entries = [old for old in entries_to_keep(path) if old["key"] != key]
            write_json(path, {"version": CACHE_VERSION, "entries": [*entries, entry]})
    except (OSError, OutputError, Timeout):
        return False
    return True


def entries_to_keep(path: Path) -> list[dict]:
    """The file's entries; none if it is damaged (remembered() warned of it): it is replaced whole."""
    try:
        return read_entries(path)
    except UserError:
        return []


def kept_not(path: Path) -> str:
    return f"could not remember this in {path} (not writable): the next run measures again"

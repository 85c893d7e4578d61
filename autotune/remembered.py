"""auto's choices remembered, so that a later run with the same configuration on the same machine starts at once:
autotune.json in the user's cache folder, keyed by the machine, torch and the configuration (docs/performance.md)."""

import os
from dataclasses import asdict, replace
from pathlib import Path

import torch
from filelock import FileLock, Timeout

from machine import AVX2_CAPS, available_cores, cache_folder, cpu_name, torch_cpu_isa
from multi_train_utils.train_eval_utils import AMP_DTYPES, Choice
from read_back import NUMBER, misfits, read_json
from utils import OutputError, UserError, warn, write_json

CACHE_ENV = "FLOWERS_AUTOTUNE_CACHE"  # a file path instead of the user's cache folder: for tests, or a shared disk
CACHE_VERSION = 2
# A remembered choice, as remember() writes it (read_back.misfits' shapes): the Choice and what it was decided from
CHOICE_SHAPE = {"amp": str, "channels_last": bool, "workers": int, "micro_batch": (int, type(None)),
                "measured": dict, "load_ms": (NUMBER, type(None)), "seconds": NUMBER, "date": str,
                "lines": list, "batches": str}  # fmt: skip
ENTRY_SHAPE = {"key": dict, "choice": CHOICE_SHAPE}
RUN_KEY = ("model", "img_size", "batch_size", "freeze_layers", "opt", "grad_checkpointing", "amp", "channels_last",
           "workers", "micro_batch", "auto_augment", "random_erase", "batches")  # fmt: skip


def cache_file() -> Path:
    """$FLOWERS_AUTOTUNE_CACHE if set; else in the user's cache folder."""
    return Path(os.environ[CACHE_ENV]) if os.environ.get(CACHE_ENV) else cache_folder() / "autotune.json"


def cache_key(config, plan, device: torch.device, processes_here: int) -> dict:
    """What a remembered choice holds for: the machine as torch computes on it, torch, and the configuration."""
    machine = {"cpu": cpu_name(), "torch_cpu_isa": torch_cpu_isa(),
               "isa_caps": {name: os.environ[name] for name in AVX2_CAPS if name in os.environ},
               "cores": available_cores(), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
               "torch": torch.__version__}  # fmt: skip
    run = {name: getattr(config, name) for name in RUN_KEY}
    run |= {"device": device.type, "processes_here": processes_here, "data": str(Path(plan.data_path).resolve())}
    return machine | run


def remembered(config, plan, device: torch.device, processes_here: int):
    """(the cache file, the key, the choice remembered for it or None). A damaged file holds none, with a warning."""
    path, key = cache_file(), cache_key(config, plan, device, processes_here)
    try:
        entries = [] if config.remeasure else read_entries(path)
    except UserError as damage:
        warn(f"{damage}: measuring again, and replacing it")
        entries = []
    found = next((entry["choice"] for entry in entries if entry["key"] == key), None)
    if found is None:
        return path, key, None
    choice = Choice(**{name: found[name] for name in ("amp", "channels_last", "micro_batch", "batches", "workers")})
    how = "batches made on the device" if choice.on_device else f"{choice.workers} loader workers"
    how += f", micro-batches of {choice.micro_batch}" if choice.micro_batch else ""
    line = (f"Auto: {choice.name()}, {how}, as measured on {found['date']} for this machine and configuration ({path}; "
            "--remeasure measures again)")  # fmt: skip
    return path, key, replace(choice, lines=(line,))


def read_entries(path: Path) -> list[dict]:
    """The file's entries (none before it is written); UserError naming it if it is not one this code wrote whole."""
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


def remember(path: Path, key: dict, choice: Choice, facts: dict) -> str:
    """Add (or replace) the choice for `key`, under a lock, written whole; the line saying where, or that it cannot."""
    stored = {name: value for name, value in asdict(choice).items() if name not in ("threads", "lines")}
    entry = {"key": key, "choice": stored | facts | {"lines": []}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{path}.lock", timeout=60):
            try:
                entries = [old for old in read_entries(path) if old["key"] != key]
            except UserError:  # damaged (remembered() warned of it): replaced whole
                entries = []
            write_json(path, {"version": CACHE_VERSION, "entries": [*entries, entry]})
    except (OSError, OutputError, Timeout):
        return f"Auto: could not remember this in {path} (not writable): the next run measures again"
    return f"Auto: remembered in {path} (delete it, or pass --remeasure, to measure again)"

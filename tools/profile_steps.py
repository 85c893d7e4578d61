"""A torch.profiler trace of a few steps of a training script's own loop, and what it says.

    python tools/profile_steps.py --epoch 1 --steps 10 --trace-dir DIR train_single_gpu.py --data-path ... FLAGS

runs the script in this process, its train_one_epoch wrapped so that epoch --epoch has its first --steps steps
traced (docs/performance.md, "A profile of the real loop")."""

import argparse
import gzip
import inspect
import json
import runpy
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, schedule

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for `python tools/profile_steps.py` from anywhere

from utils import OutputError, UserError, check_writable, entry_point, write_json, writing  # noqa: E402

TRACE_NAME, SUMMARY_NAME = "profile_trace.json.gz", "profile_summary.json"
TOP_OPERATIONS = 12
STEP_PREFIX = "ProfilerStep"  # the span profile.step() marks around each step: "ProfilerStep#3"


class ProfiledBatches:
    """`total` batches of `batches` (default: skip + steps), with a loader's length; each batch asked for begins a
    profiler step, so a traced step holds its batch's wait."""

    def __init__(self, batches, skip: int, steps: int, profiler: profile, total: int | None = None):
        self.batches, self.total, self.profiler = batches, skip + steps if total is None else total, profiler

    def __len__(self):
        return self.total

    def __iter__(self):
        for _ in range(self.total):
            self.profiler.step()  # a step begins (step 0 ran from the profiler's start to the first batch)
            yield next(self.batches)


def traced(run, batches, skip: int, steps: int, device: torch.device, folder: Path, total=None) -> dict:
    """Run the loop `run` over ProfiledBatches, `steps` batches after `skip` traced (folder/TRACE_NAME); a summary."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    found = {}

    def ready(profiler: profile) -> None:  # when the traced steps end
        path = folder / TRACE_NAME
        with writing(path):
            profiler.export_chrome_trace(str(path))  # a name ending in .gz: torch writes it gzipped
        try:  # read back: torch's C++ writes the trace into a temporary file, and says nothing of a write that fails
            trace_events(path)
        except (EOFError, ValueError, OSError):  # (gzip's: cut short, not gzip)
            raise OutputError(f"cannot write {path}: torch's profiler could not write it whole (in "
                              f"{tempfile.gettempdir()} first)") from None  # fmt: skip
        found.update(summary_of(profiler.events(), device), trace=str(path), trace_bytes=path.stat().st_size)

    plan = schedule(wait=skip, warmup=1, active=steps, repeat=1)
    with profile(activities=activities, schedule=plan, on_trace_ready=ready) as profiler:
        run(ProfiledBatches(batches, skip, steps, profiler, total))
        profiler.step()  # the last traced step's span closes, and the trace is ready
    return found


def traced_epoch(train_one_epoch, epoch: int, steps: int, folder: Path, found: dict):
    """`train_one_epoch`, the first `steps` steps of epoch `epoch` traced (the summary into `found`)."""

    def wrapped(training, data_loader, device, this_epoch, *args):
        if this_epoch != epoch:
            return train_one_epoch(training, data_loader, device, this_epoch, *args)
        result, batches = [], len(data_loader)
        loop = lambda profiled: result.append(train_one_epoch(training, profiled, device, this_epoch, *args))  # noqa: E731
        found.update(traced(loop, iter(data_loader), 0, min(steps, batches), torch.device(device), folder, batches))
        return result[0]

    return wrapped


@entry_point
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epoch", type=int, default=1, help="the epoch traced (counted from 0)")
    p.add_argument("--steps", type=int, default=10, help="its steps traced, from its first")
    p.add_argument("--trace-dir", type=Path, default=Path("."), help="where the trace and its summary go")
    p.add_argument("script", type=Path, help="a training script whose loop runs in its own process")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="the script's flags")
    args = p.parse_args(argv)
    check_writable(args.trace_dir)  # before the script runs, not once it has trained to the traced epoch
    # the script's namespace, main not yet called (run_path returns a copy: its functions' globals are the one)
    script = inspect.unwrap(runpy.run_path(str(args.script), run_name="profiled")["main"]).__globals__
    found = {}
    args.trace_dir.mkdir(parents=True, exist_ok=True)
    script["train_one_epoch"] = traced_epoch(script["train_one_epoch"], args.epoch, args.steps, args.trace_dir, found)
    script["main"](args.flags)
    if not found:
        raise UserError(f"{args.script} ended before its epoch {args.epoch}: nothing traced")
    write_json(args.trace_dir / SUMMARY_NAME, found)
    print(printed(found))


def summary_of(events, device: torch.device) -> dict:
    """The traced steps' seconds, the GPU's idle time (None on the CPU), the waits for batches, the top operations."""
    # (on a GPU each step is marked on its timeline too: not counted)
    steps = [e for e in events if e.name.startswith(STEP_PREFIX) and e.device_type == DeviceType.CPU]
    steps.sort(key=lambda e: e.time_range.start)
    if not steps:
        raise RuntimeError("the profile holds no step: did the loop run?")
    start, end = steps[0].time_range.start, max(e.time_range.end for e in steps)
    on_gpu = device.type == "cuda"
    device_events = [e for e in events if on_gpu and is_device_work(e)]
    busy = covered([(e.time_range.start, e.time_range.end) for e in device_events], start, end)
    waits = [e for e in events if e.name.startswith("enumerate(") and e.device_type == DeviceType.CPU]
    waited = covered([(e.time_range.start, e.time_range.end) for e in waits], start, end)
    step_ms = [round(e.time_range.elapsed_us() / 1e3, 2) for e in steps]
    return {
        "traced_steps": len(steps), "device_events": len(device_events), "traced_seconds": (end - start) / 1e6,
        "device_idle_seconds": (end - start - busy) / 1e6 if on_gpu else None,
        "device_idle_fraction": (1 - busy / (end - start)) if on_gpu else None,
        "waiting_for_batches_seconds": waited / 1e6, "waiting_for_batches_fraction": waited / (end - start),
        "step_ms": step_ms, "first_step_ms": step_ms[0],
        "other_steps_median_ms": statistics.median(step_ms[1:]) if len(step_ms) > 1 else None,
        "top_operations": top_operations(events, on_gpu),
    }  # fmt: skip


def is_device_work(event) -> bool:
    """A kernel, copy or memset on the GPU, not an annotation on its timeline (a step's span), which spans idle time."""
    annotation = getattr(event, "is_user_annotation", False) or event.name.startswith(STEP_PREFIX) or "#" in event.name
    return event.device_type == DeviceType.CUDA and not annotation


def covered(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """The length of the union of `intervals`, each clipped to [start, end]."""
    total, reached = 0.0, start
    for low, high in sorted(intervals):
        low, high = max(low, reached), min(high, end)
        if high > low:
            total += high - low
            reached = high
    return total


def top_operations(events, on_gpu: bool) -> list[dict]:
    """The TOP_OPERATIONS operations (on a GPU, kernels) that took most of their own time, with their share."""
    totals: dict[str, list] = {}
    for event in events:
        if event.name.startswith(STEP_PREFIX) or on_gpu and not is_device_work(event):
            continue
        own = event.time_range.elapsed_us() if on_gpu else event.self_cpu_time_total
        entry = totals.setdefault(event.name, [0, 0.0])
        entry[0] += 1
        entry[1] += own
    whole = sum(us for _, us in totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda item: item[1][1], reverse=True)[:TOP_OPERATIONS]
    return [{"name": name, "calls": calls, "ms": round(us / 1e3, 3), "share": round(us / whole, 4)}
            for name, (calls, us) in ranked]  # fmt: skip


def printed(found: dict) -> str:
    """The summary as the benchmark prints it."""
    lines = [f"Profile of {found['traced_steps']} steps ({found['traced_seconds']:.3f} s): {found['trace']}"]
    if found["device_idle_seconds"] is not None:
        idle, share = found["device_idle_seconds"], found["device_idle_fraction"]
        lines.append(f"  the GPU sat idle {idle:.3f} s of them ({share:.0%})")
    lines.append(f"  the training process waited for batches {found['waiting_for_batches_seconds']:.3f} s "
                 f"({found['waiting_for_batches_fraction']:.0%}); the first step (an epoch's start) "
                 f"{found['first_step_ms']} ms, the others' median {found['other_steps_median_ms']} ms")  # fmt: skip
    lines.append(f"  top {'CPU operations, own time' if found['device_idle_seconds'] is None else 'GPU kernels'}:")
    for op in found["top_operations"]:
        lines.append(f"    {op['share']:6.1%} {op['ms']:10.2f} ms {op['calls']:6d} x  {op['name'][:90]}")
    return "\n".join(lines)


def trace_events(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


if __name__ == "__main__":
    main()

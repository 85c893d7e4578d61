"""tools/profile_steps.py: the profile of the training loop, its trace and what its summary says. On the CPU, on a
loop small enough for the fast tier; the GPU's figures (the device's idle time) from made-up events, whose
arithmetic is the same."""

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from tools.profile_steps import TRACE_NAME, covered, summary_of, trace_events, traced, traced_epoch

pytestmark = pytest.mark.fast
CUDA = torch.device("cuda")


def event(name, start, end, device_type=DeviceType.CPU, **options) -> FunctionEvent:
    return FunctionEvent(0, name, 1, start, end, device_type=device_type, **options)


def test_the_union_of_intervals_counts_overlaps_once_and_only_within_the_window():
    assert covered([(0, 10), (5, 15), (20, 30)], 0, 100) == 25
    assert covered([(0, 10), (5, 15), (20, 30)], 8, 25) == 7 + 5
    assert covered([], 0, 10) == 0


def test_a_gpu_profile_counts_idle_time_between_kernels_not_the_spans_marked_on_its_timeline():
    # Two steps of 100 us on the CPU; the GPU works 0-30, 25-50 and 120-170 (copies and kernels overlapping), and
    # torch.profiler marks each step on the GPU's timeline too (a span as long as the step), and the optimizer's.
    events = [
        event("ProfilerStep#3", 0, 100), event("ProfilerStep#4", 100, 200),
        event("ProfilerStep#3", 0, 100, DeviceType.CUDA, is_user_annotation=True),
        event("Optimizer.step#SGD.step", 0, 200, DeviceType.CUDA, is_user_annotation=True),
        event("Memcpy HtoD (Pinned -> Device)", 0, 30, DeviceType.CUDA),
        event("sm90_xmma_fprop", 25, 50, DeviceType.CUDA), event("sm90_xmma_fprop", 120, 170, DeviceType.CUDA),
        event("enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__", 100, 118),
    ]  # fmt: skip
    found = summary_of(events, CUDA)
    assert found["traced_steps"] == 2 and found["device_events"] == 3
    assert found["traced_seconds"] == pytest.approx(200e-6)
    assert found["device_idle_seconds"] == pytest.approx(100e-6) and found["device_idle_fraction"] == pytest.approx(0.5)
    assert found["waiting_for_batches_seconds"] == pytest.approx(18e-6)
    assert found["step_ms"] == [0.1, 0.1] and found["first_step_ms"] == 0.1 and found["other_steps_median_ms"] == 0.1
    top = found["top_operations"]
    assert [(op["name"], op["calls"]) for op in top] == [("sm90_xmma_fprop", 2), ("Memcpy HtoD (Pinned -> Device)", 1)]
    assert top[0]["ms"] == 0.075 and top[0]["share"] == pytest.approx(75 / 105, abs=1e-4)


def test_a_profile_without_a_step_is_an_error_not_a_figure():
    with pytest.raises(RuntimeError, match="no step"):
        summary_of([event("aten::mm", 0, 10)], torch.device("cpu"))


def test_the_loop_is_traced_from_the_step_after_the_skipped_ones_and_the_trace_opens(tmp_path):
    """A loop of 5 batches with 2 skipped: batches 2, 3 and 4 traced, each with its batch's work in it; the trace is
    a gzipped Chrome trace that holds them (each batch's step is numbered from 1: step 0 runs up to the first)."""
    seen = []

    def loop(batches):
        assert len(batches) == 5
        for batch in batches:
            seen.append(batch)
            torch.ones(64, 64) @ torch.ones(64, 64)

    found = traced(loop, iter(range(100)), 2, 3, torch.device("cpu"), tmp_path)
    assert seen == [0, 1, 2, 3, 4]
    assert found["traced_steps"] == 3 and found["device_idle_seconds"] is None
    assert any(op["name"] == "aten::mm" and op["calls"] == 3 for op in found["top_operations"])
    names = {e.get("name") for e in trace_events(tmp_path / TRACE_NAME)}
    assert {"ProfilerStep#3", "ProfilerStep#4", "ProfilerStep#5"} <= names and "ProfilerStep#2" not in names
    assert found["trace"] == str(tmp_path / TRACE_NAME) and found["trace_bytes"] > 0


def test_a_wrapped_train_one_epoch_traces_the_chosen_epochs_first_steps_and_trains_every_batch(tmp_path):
    """tools/profile_steps.py's wrapper of a script's train_one_epoch: epoch 1 traced for its first 2 of 4 batches,
    every epoch (that one too) given all its batches and its result returned as it was."""
    calls = []

    def train_one_epoch(training, data_loader, device, epoch, max_skipped=None):
        assert len(data_loader) == 4
        calls.append((epoch, [batch for batch in data_loader], max_skipped))
        torch.ones(64, 64) @ torch.ones(64, 64)
        return 0.5, 4 * 8

    found = {}
    wrapped = traced_epoch(train_one_epoch, 1, 2, tmp_path, found)
    assert wrapped(None, range(4), "cpu", 0, 7) == (0.5, 32) and not found  # epoch 0: not traced
    assert wrapped(None, range(4), "cpu", 1, 7) == (0.5, 32)
    assert calls == [(0, [0, 1, 2, 3], 7), (1, [0, 1, 2, 3], 7)]
    assert found["traced_steps"] == 2 and (tmp_path / TRACE_NAME).exists()

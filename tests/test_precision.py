"""The speed options change how the model computes, not what it learns: mixed precision, channels_last, compile."""

import argparse

import pytest
import torch
from conftest import FAST, run_script
from torch import nn

from multi_train_utils.train_eval_utils import Compute, evaluate, train_one_epoch
from training import build_model, choose_compute
from utils import make_demo_data

CPU = torch.device("cpu")


def model_args(**overrides):
    values = dict(
        seed=0, weights=None, freeze_layers=False, distributed=False, channels_last=False, compile=False,
        data_parallel=False, amp="off", lr=0.01, momentum=0.9, weight_decay=0.0, epochs=1, lrf=1.0,
    )  # fmt: skip
    return argparse.Namespace(**{**values, **overrides})


def fixed_batches(steps, size=32, batch=4):
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(batch, 3, size, size, generator=g), torch.arange(batch) % 5
    return [(images, labels)] * steps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_precision_steps_learn_a_fixed_batch(dtype):
    model, _ = build_model(model_args(channels_last=True), 5, CPU)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    # The scale starts at 2**10, not the default 2**16, which spends the first steps halving itself on overflows.
    scaler = torch.amp.GradScaler("cpu", init_scale=2**10, enabled=dtype == torch.float16)
    compute = Compute(dtype, channels_last=True)
    first, _ = train_one_epoch(model, optimizer, fixed_batches(1), CPU, 0, compute, scaler)
    train_one_epoch(model, optimizer, fixed_batches(5), CPU, 0, compute, scaler)
    last, _ = train_one_epoch(model, optimizer, fixed_batches(1), CPU, 0, compute, scaler)
    assert last < 0.5 * first, (first, last)  # memorising 4 images: the loss falls steeply
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())  # master weights
    if dtype == torch.float16:
        assert scaler.get_scale() > 1  # the scaler is active, and has not collapsed to nothing


def test_channels_last_computes_what_nchw_computes():
    torch.manual_seed(0)
    images = torch.randn(4, 3, 64, 64)
    nchw = build_model(model_args(), 5, CPU)[0].eval()
    nhwc = build_model(model_args(channels_last=True), 5, CPU)[0].eval()
    assert nhwc.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert not nchw.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        expected = nchw(images)
        got = nhwc(Compute(channels_last=True).batch_to(images, CPU))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_bfloat16_evaluation_agrees_with_float32_on_nearly_every_image():
    torch.manual_seed(0)
    model = build_model(model_args(), 5, CPU)[0]
    batches = fixed_batches(1, batch=32)
    # A network that has seen some data, so that its predictions are not all near-ties.
    train_one_epoch(model, torch.optim.SGD(model.parameters(), lr=0.01), fixed_batches(3, batch=32), CPU, 0)
    fp32 = evaluate(model, batches, CPU, 5)
    bf16 = evaluate(model, batches, CPU, 5, Compute(torch.bfloat16, channels_last=True))
    assert int(fp32.sum()) == int(bf16.sum()) == 32
    assert abs(int(fp32.trace()) - int(bf16.trace())) <= 2


def test_compile_wraps_the_model_and_saves_plain_names():
    model, plain = build_model(model_args(compile=True), 5, CPU)  # compiles lazily: nothing is compiled here
    assert hasattr(model, "_orig_mod") and model._orig_mod is plain
    assert not any(name.startswith(("_orig_mod.", "module.")) for name in plain.state_dict())


@pytest.mark.parametrize(
    "amp, gpu_capability, cpu_bf16, expected",
    [
        ("auto", None, True, torch.bfloat16),
        ("auto", None, False, None),
        ("auto", (8, 0), False, torch.bfloat16),
        ("auto", (7, 0), True, None),  # a V100: bfloat16 only emulated, so float32
        ("off", None, True, None),
        ("fp16", None, False, torch.float16),
        ("bf16", None, False, torch.bfloat16),
    ],
)
def test_amp_auto_picks_bfloat16_only_where_the_device_computes_it(
    monkeypatch, amp, gpu_capability, cpu_bf16, expected
):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: cpu_bf16)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: cpu_bf16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: gpu_capability)
    device = torch.device("cuda", 0) if gpu_capability else CPU
    compute, summary = choose_compute(model_args(amp=amp, channels_last=True), device)
    assert compute.amp_dtype == expected and compute.channels_last
    assert summary.startswith("Precision: ") and f"--amp {amp}" in summary


def test_a_float16_run_saves_its_gradient_scaler_and_resumes_with_it(tmp_path):
    # float16 convolutions are about 20x slower than float32 on a CPU: the smallest data that still makes steps.
    data = make_demo_data(tmp_path / "data", images_per_class=5, size=(20, 20))
    out = tmp_path / "run"
    flags = ("--data-path", data, "--output-dir", out, "--amp", "fp16", "--img-size", "16", "--batch-size", "4")
    result = run_script("train_single_gpu.py", *flags, "--workers", "0", "--epochs", "1")
    assert result.returncode == 0, result.stderr
    assert "float16 autocast with gradient scaling" in result.stdout
    state = torch.load(out / "checkpoint.pth", weights_only=True)
    assert state["scaler"]["scale"] > 1
    result = run_script("train_single_gpu.py", *flags, "--workers", "0", "--epochs", "2", "--auto-resume")
    assert result.returncode == 0, result.stderr
    assert torch.load(out / "checkpoint.pth", weights_only=True)["epoch"] == 1


def test_non_persistent_workers_still_train(tiny_data, tmp_path):
    """--no-persistent-workers (the original's behaviour, the benchmark's baseline) restarts workers each epoch."""
    flags = ("--data-path", tiny_data, "--output-dir", tmp_path / "run", *FAST, "--workers", "1")
    result = run_script("train_single_gpu.py", *flags, "--epochs", "2", "--no-persistent-workers", "--amp", "off")
    assert result.returncode == 0, result.stderr
    assert "float32" in result.stdout and len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


def test_every_module_of_the_model_is_converted_to_channels_last():
    model = build_model(model_args(channels_last=True), 5, CPU)[0]
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert convs and all(m.weight.is_contiguous(memory_format=torch.channels_last) for m in convs)

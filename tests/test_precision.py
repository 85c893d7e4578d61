"""The speed options change how the model computes, not what it learns: mixed precision, channels_last, compile."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, fault_env, run_here, run_script
from torch import nn
from wiring import model_as_trained

from autotune.choose import amp_candidates, compute_candidates, precision_line
from dataset.demo import make_demo_data
from dataset.folders import write_class_indices
from dataset.transforms import normalise
from inference.trained import load_trained_model
from multi_train_utils.checkpoint import save_atomically
from multi_train_utils.train_eval_utils import Choice, Training, evaluate, train_one_epoch
from network.architectures import create_model
from run.config import Config
from utils import write_json

CPU = torch.device("cpu")


def fixed_batches(steps, size=32, batch=4):
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(batch, 3, size, size, generator=g), torch.arange(batch) % 5
    return [(images, labels)] * steps


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
@pytest.mark.fast
def test_mixed_precision_steps_learn_a_fixed_batch(amp):
    # ResNet-18: the same layers as the default ResNet-34 (convolutions, BatchNorm, the head) in half the depth
    model, _ = model_as_trained(5, Choice(channels_last=True), model="resnet18")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    # The scale starts at 2**10, not the default 2**16, which spends the first steps halving itself on overflows.
    scaler = torch.amp.GradScaler("cpu", init_scale=2**10, enabled=amp == "fp16")
    training = Training(model, optimizer, choice=Choice(amp, channels_last=True), scaler=scaler)
    # 32 px: layer4's first convolution reads 2 x 2 pixels. At 16 px it reads 1 x 1, where the CPU's bfloat16 weight
    # gradient (oneDNN, on a Zen 4) came out non-finite in about 1 run in 4, the loss unchanged: the kernel's, not
    # the step's (2026-11-29)
    first, _ = train_one_epoch(training, fixed_batches(1, size=32), CPU, 0)
    train_one_epoch(training, fixed_batches(5, size=32), CPU, 0)
    last, _ = train_one_epoch(training, fixed_batches(1, size=32), CPU, 0)
    assert last < 0.5 * first, (first, last)  # memorising 4 images: the loss falls steeply
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())  # master weights
    if amp == "fp16":
        assert scaler.get_scale() > 1  # the scaler is active, and has not collapsed to nothing


@pytest.mark.fast
def test_channels_last_computes_what_nchw_computes():
    torch.manual_seed(0)
    images = torch.randn(4, 3, 64, 64)
    nchw = model_as_trained(5)[0].eval()
    nhwc = model_as_trained(5, Choice(channels_last=True))[0].eval()
    assert nhwc.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert not nchw.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        expected = nchw(images)
        got = nhwc(Choice(channels_last=True).batch_to(images, CPU))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.fast
def test_an_8_bit_batch_arrives_normalised_in_the_layout_asked_for():
    images = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    got = Choice(channels_last=True).batch_to(images, CPU)
    assert got.dtype == torch.float32 and got.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(got, normalise(images))


@pytest.mark.fast
def test_bfloat16_evaluation_agrees_with_float32_on_nearly_every_image():
    torch.manual_seed(0)
    model = model_as_trained(5, model="resnet18")[0]  # ResNet-34's layers, in half the depth
    batches = fixed_batches(1, batch=32)
    # A network that has seen some data, so that its predictions are not all near-ties.
    train_one_epoch(Training(model, torch.optim.SGD(model.parameters(), lr=0.01)), fixed_batches(3, batch=32), CPU, 0)
    fp32 = evaluate(model, batches, CPU, 5)
    bf16 = evaluate(model, batches, CPU, 5, Choice("bf16", channels_last=True))
    assert int(fp32.sum()) == int(bf16.sum()) == 32
    assert abs(int(fp32.trace()) - int(bf16.trace())) <= 2


@pytest.mark.fast
def test_compile_wraps_the_model_and_saves_plain_names():
    model, plain = model_as_trained(5, compile=True, model="resnet18")  # compiles lazily: nothing is compiled here
    assert hasattr(model, "_orig_mod") and model._orig_mod is plain
    assert not any(name.startswith(("_orig_mod.", "module.")) for name in plain.state_dict())


@pytest.fixture
def uncapped_cpu(monkeypatch):
    """A CPU whose bfloat16 support a test sets, with torch uncapped (AVX-512 kernels, no oneDNN cap)."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)

    def set_bfloat16(supported: bool):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: supported)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: supported)

    return set_bfloat16


@pytest.mark.parametrize(
    "amp, gpu_capability, cpu_bf16, expected",
    [
        ("auto", None, True, ["off", "bf16"]),
        ("auto", None, False, ["off"]),  # emulated bfloat16 is slower than float32: not worth timing
        ("auto", (8, 0), False, ["off", "bf16"]),
        ("auto", (7, 0), True, ["off"]),  # a V100: bfloat16 only emulated
        ("off", None, True, ["off"]),  # a given flag is the only candidate
        ("fp16", None, False, ["fp16"]),
        ("bf16", None, False, ["bf16"]),
    ],
)
@pytest.mark.fast
def test_amp_auto_times_bfloat16_only_where_the_device_has_its_instructions(
    uncapped_cpu, monkeypatch, amp, gpu_capability, cpu_bf16, expected
):
    uncapped_cpu(cpu_bf16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: gpu_capability)
    device = torch.device("cuda", 0) if gpu_capability else CPU
    candidates, reason = amp_candidates(amp, device)
    assert candidates == expected and reason.startswith(f"--amp {amp}")
    assert compute_candidates(amp, True, device) == [Choice(a, channels_last=True) for a in expected]


@pytest.mark.parametrize(
    "torch_isa, onednn_cap, expected",
    [
        ("AVX512", None, ["off", "bf16"]),
        ("AVX2", None, ["off"]),  # ATEN_CPU_CAPABILITY=avx2
        ("AVX512", "AVX2", ["off"]),  # ONEDNN_MAX_CPU_ISA=AVX2
        ("AVX512", "avx512_core", ["off"]),  # AVX-512 without its bfloat16 instructions
        ("AVX512", "AVX512_CORE_AMX", ["off", "bf16"]),
        ("AVX512", "ALL", ["off", "bf16"]),
    ],
)
@pytest.mark.fast
def test_amp_auto_honours_the_caps_that_make_torch_compute_like_an_avx2_cpu(
    uncapped_cpu, monkeypatch, torch_isa, onednn_cap, expected
):
    uncapped_cpu(True)  # an AMX machine...
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: torch_isa)  # ...with torch capped, or not
    if onednn_cap:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", onednn_cap)
    candidates, reason = amp_candidates("auto", CPU)
    assert candidates == expected
    assert ("capped" in reason) == (expected == ["off"])


def test_under_the_avx2_caps_auto_considers_float32_alone_on_any_cpu():
    code = (
        "import torch; from autotune.choose import amp_candidates; print(amp_candidates('auto', torch.device('cpu')))"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("(['off'], ") and "--amp auto: " in result.stdout, result.stdout


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.fast
def test_auto_times_both_layouts_and_a_flag_pins_one(device):
    device = torch.device(device)
    assert compute_candidates("off", None, device) == [Choice("off", channels_last=False), Choice("off", True)]
    for flag, name in ((True, "--channels-last"), (False, "--no-channels-last")):
        assert compute_candidates("off", flag, device) == [Choice("off", flag)]
        line = precision_line(Choice("off", flag), Config(amp="off", channels_last=flag), device)
        assert line.endswith(f"({name})")


@pytest.mark.fast
def test_without_measuring_auto_is_the_originals_float32_nchw(tmp_path):
    # Predicting with a run recorded before auto measured: its args.json says "auto" for the precision and layout
    save_atomically(create_model(2, "squeezenet1_1").state_dict(), tmp_path / "weights" / "best.pth")
    write_class_indices(["a", "b"], tmp_path)
    write_json(tmp_path / "args.json", Config(model="squeezenet1_1").record())  # --amp auto, channels_last None
    trained = load_trained_model(tmp_path / "weights" / "best.pth", None, CPU)
    assert trained.choice == Choice("off", channels_last=False)
    assert not trained.model.features[0].weight.is_contiguous(memory_format=torch.channels_last)


def test_a_float16_run_saves_its_gradient_scaler_and_resumes_with_it(tmp_path):
    # float16 convolutions are about 20x slower than float32 on a CPU: the smallest data that still makes steps, and
    # a small network (the scaler, not the network, is under test: 8 s an epoch here against ResNet-34's 18 s).
    data = make_demo_data(tmp_path / "data", images_per_class=5, size=(20, 20))
    out = tmp_path / "run"
    flags = ("--data-path", data, "--output-dir", out, "--amp", "fp16", "--img-size", "16", "--batch-size", "4")
    flags += ("--workers", "0", "--no-channels-last", "--epochs", "2", "--model", "mobilenet_v3_small")
    result = run_script("train_single_gpu.py", *flags, env=fault_env("raise:0:1"))  # stops after epoch 0
    assert "float16 autocast with gradient scaling" in result.stdout
    state = torch.load(out / "checkpoint.pth", weights_only=True)
    assert state["epoch"] == 0 and state["scaler"]["scale"] > 1
    result = run_here("train_single_gpu.py", *flags, "--auto-resume")
    assert result.returncode == 0, result.stderr
    assert torch.load(out / "checkpoint.pth", weights_only=True)["epoch"] == 1


@pytest.mark.fast
def test_every_module_of_the_model_is_converted_to_channels_last():
    model = model_as_trained(5, Choice(channels_last=True))[0]
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert convs and all(m.weight.is_contiguous(memory_format=torch.channels_last) for m in convs)

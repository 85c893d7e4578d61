"""export.py: a run's network as an ONNX or TorchScript file that computes PyTorch's float32 logits, carries the
class names and preprocessing, and never replaces a file or leaves a bad one behind."""

import contextlib
import io
import json
import re
import sys
import warnings

import onnxruntime
import pytest
import torch
from conftest import SMALL_MODEL, assert_user_error, run_script
from torch.utils.data import DataLoader
from torchvision.models import resnet18

import export
from dataset.folders import read_split_data, write_class_indices
from dataset.transforms import normalise, val_transform
from my_dataset import MyDataSet
from network.architectures import create_model
from utils import UserError

CLASSES = ["daisy", "dandelion", "roses", "sunflowers", "tulips"]  # tiny_data's


@pytest.fixture(scope="module")
def run(tiny_data, tmp_path_factory):
    """A run folder laid out as training writes it, made directly (training one takes longer than the exports):
    weights/best.pth of a ResNet-18 whose BatchNorm statistics are away from their initial 0 and 1, class_indices.json,
    and args.json of a ResNet-18 run at 32 px in bfloat16 and channels_last, which the export must not carry into the
    file (the network it does take from there: the default, ResNet-34, would refuse these weights)."""
    folder = tmp_path_factory.mktemp("export") / "run"
    (folder / "weights").mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    model = create_model(len(CLASSES), SMALL_MODEL[1])
    for layer in model.modules():
        if isinstance(layer, torch.nn.BatchNorm2d):
            for tensor, low, high in [(layer.running_mean, -0.2, 0.2), (layer.running_var, 0.5, 2.0)]:
                tensor.copy_(torch.empty_like(tensor).uniform_(low, high, generator=generator))
    torch.save(model.state_dict(), folder / "weights" / "best.pth")
    write_class_indices(CLASSES, folder)
    run_args = {"data_path": str(tiny_data), "model": SMALL_MODEL[1], "img_size": 32, "batch_size": 8}
    (folder / "args.json").write_text(
        json.dumps({**run_args, "val_rate": 0.2, "seed": 0, "amp": "bf16", "channels_last": True})
    )
    return folder


@pytest.fixture(scope="module")
def images(tiny_data) -> list[str]:
    """Real images: the validation split of tiny_data (10 images, a batch size neither the export nor its check saw)."""
    images = read_split_data(tiny_data, 0.2, 0).val_images
    assert len(images) == 10
    return images


@pytest.fixture(scope="module")
def pytorch_logits(run, images) -> tuple[torch.Tensor, torch.Tensor]:
    """torchvision's ResNet-18 with the run's weights, float32 and NCHW on the CPU, on the images as evaluate.py
    sees them: (logits, the batch)."""
    model = resnet18(num_classes=len(CLASSES))
    model.load_state_dict(torch.load(run / "weights" / "best.pth", weights_only=True))
    batch, _ = next(iter(DataLoader(MyDataSet(images, [0] * len(images), val_transform(32)), batch_size=len(images))))
    batch = normalise(batch)  # as Choice.batch_to does on the device
    with torch.no_grad():
        return model.eval()(batch), batch


@pytest.fixture(scope="module")
def onnx_export(run, tmp_path_factory):
    """export.py --format onnx as a user runs it, to a file of its own: (stdout, the file)."""
    output = tmp_path_factory.mktemp("onnx") / "flowers.onnx"
    result = run_script("export.py", run / "weights" / "best.pth", "--format", "onnx", "--output", output)
    assert result.returncode == 0, result.stderr
    return result.stdout, output


@pytest.fixture(scope="module")
def onnx_session(onnx_export):
    return onnxruntime.InferenceSession(str(onnx_export[1]), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def torchscript_export(run):
    """export.py --format torchscript to the default file, in this process (the ONNX export runs the script as a
    user does; a second interpreter would only add its start-up): (stdout, the file)."""
    with contextlib.redirect_stdout(io.StringIO()) as stdout:
        export.main([str(run / "weights" / "best.pth"), "--format", "torchscript"])
    return stdout.getvalue(), run / "weights" / "best.torchscript.pt"


def assert_check_printed(stdout: str, runtime: str, tiny_data):
    """The check's line: the runtime, the real images it ran on, and a measured difference within the limit."""
    line = rf"Checked with {runtime} .*? on 8 images of {re.escape(str(tiny_data))}: max abs difference from "
    found = re.search(line + r"PyTorch float32 logits (\S+) \(limit 1e-04\)$", stdout, re.MULTILINE)
    assert found, stdout
    assert 0.0 <= float(found.group(1)) <= 1e-4


def test_the_onnx_file_computes_pytorchs_float32_logits_in_onnxruntime(
    onnx_export, onnx_session, pytorch_logits, tiny_data
):
    assert_check_printed(onnx_export[0], "onnxruntime", tiny_data)
    session = onnx_session
    assert [(i.name, i.shape, i.type) for i in session.get_inputs()] == [
        ("images", ["batch", 3, 32, 32], "tensor(float)")
    ]
    expected, batch = pytorch_logits
    for rows in (slice(None), slice(0, 1)):  # the batch dimension is dynamic: 10 images, then 1
        (logits,) = session.run(["logits"], {"images": batch[rows].numpy()})
        assert torch.from_numpy(logits).sub(expected[rows]).abs().max() <= 1e-4


def test_the_onnx_file_names_the_classes_and_the_preprocessing(onnx_session):
    meta = onnx_session.get_modelmeta()
    indices = json.loads(meta.custom_metadata_map["class_indices"])
    assert [indices[str(i)] for i in range(len(indices))] == CLASSES
    assert json.loads(meta.custom_metadata_map["preprocessing"]) == {
        "input": "images",
        "shape": ["batch", 3, 32, 32],
        "resize_shorter_side": 37,  # 32 * 256 / 224, as val_transform resizes
        "interpolation": "bilinear, antialiased",
        "center_crop": 32,
        "scale": "1/255",
        "mean": [0.485, 0.456, 0.406],
        "std": [0.229, 0.224, 0.225],
        "output": "logits",
    }
    assert "resize the shorter side to 37 px" in meta.description and "crop the centre 32 px" in meta.description


@pytest.mark.fast
def test_the_torchscript_file_computes_the_same_logits_and_carries_the_class_names(
    torchscript_export, pytorch_logits, tiny_data
):
    stdout, path = torchscript_export  # the default name: beside the weights
    assert_check_printed(stdout, "torch.jit.load", tiny_data)
    extra_files = {"class_indices.json": "", "preprocessing.json": ""}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.14 deprecates TorchScript; it still loads
        loaded = torch.jit.load(path, map_location="cpu", _extra_files=extra_files)
    assert list(json.loads(extra_files["class_indices.json"]).values()) == CLASSES
    assert json.loads(extra_files["preprocessing.json"])["resize_shorter_side"] == 37
    expected, batch = pytorch_logits
    with torch.no_grad():
        assert loaded(batch).sub(expected).abs().max() <= 1e-4


def test_an_existing_output_is_refused_and_left_untouched(run, torchscript_export, run_main, tmp_path):
    (tmp_path / "flowers.onnx").write_bytes(b"someone's model")
    result = run_main(
        "export.py", run / "weights" / "best.pth", "--format", "onnx", "--output", tmp_path / "flowers.onnx"
    )
    assert_user_error(result, f"{tmp_path / 'flowers.onnx'} exists: name another --output, or pass --force")
    assert (tmp_path / "flowers.onnx").read_bytes() == b"someone's model"
    before = torchscript_export[1].stat()
    result = run_main("export.py", run / "weights" / "best.pth", "--format", "torchscript")  # the default name
    assert_user_error(result, "best.torchscript.pt exists")
    assert torchscript_export[1].stat().st_mtime_ns == before.st_mtime_ns


def test_an_unknown_format_is_rejected_by_argparse(run, run_main):
    result = run_main("export.py", run / "weights" / "best.pth", "--format", "tflite")
    assert_user_error(result, "argument --format: invalid choice: 'tflite' (choose from 'onnx', 'torchscript')")


@pytest.fixture
def traced(torchscript_export, monkeypatch):
    """In-process runs of export.py --format torchscript, the trace replaced by the file traced above (the export
    itself is tested there): what follows the trace, in a second rather than several."""
    traced_bytes = torchscript_export[1].read_bytes()
    monkeypatch.setattr(export, "export_torchscript", lambda *args: traced_bytes)
    return traced_bytes


@pytest.mark.fast
def test_a_file_that_fails_the_check_is_not_written(run, traced, monkeypatch, tmp_path):
    real_runner = export.torchscript_runner

    def off_by_a_little(data):
        run_file, runtime = real_runner(data)
        return (lambda batch: run_file(batch) + 1e-3), runtime

    monkeypatch.setattr(export, "torchscript_runner", off_by_a_little)
    argv = [str(run / "weights" / "best.pth"), "--format", "torchscript", "--output", str(tmp_path / "bad.pt")]
    with pytest.raises(export.ExportCheckError, match=r"differ from PyTorch's by up to 1\.0e-03 \(limit 1e-04\)"):
        export.main.__wrapped__(argv)
    assert list(tmp_path.iterdir()) == []  # neither the file nor a temporary one


def said_before_loading(monkeypatch, capsys) -> list[str]:
    """What export.py has printed on stderr when it starts loading the weights (nothing more is loaded before)."""
    said, load = [], export.load_trained_model

    def loading(*args, **options):
        said.append(capsys.readouterr().err)
        return load(*args, **options)

    monkeypatch.setattr(export, "load_trained_model", loading)
    return said


def test_without_onnxruntime_the_check_alone_is_skipped_said_before_anything_is_loaded(
    run, onnx_export, monkeypatch, tmp_path, capsys
):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime raises ImportError
    exported = onnx_export[1].read_bytes()
    monkeypatch.setattr(export, "export_onnx", lambda *args: exported)  # the export itself is tested above
    said = said_before_loading(monkeypatch, capsys)
    export.main.__wrapped__(
        [str(run / "weights" / "best.pth"), "--format", "onnx", "--output", str(tmp_path / "m.onnx")]
    )
    printed = capsys.readouterr()
    (line,) = said[0].splitlines()
    assert line.startswith("warning: onnxruntime cannot be imported (") and not printed.err
    assert line.endswith("): the ONNX file will not be checked (pip install onnxruntime)")
    assert "Checked with" not in printed.out and (tmp_path / "m.onnx").read_bytes() == exported


@pytest.mark.fast
def test_without_onnxscript_an_onnx_export_is_refused_before_anything_is_loaded(run, monkeypatch, tmp_path, run_main):
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # not installed, as importlib finds it
    monkeypatch.setattr(export, "load_trained_model", lambda *args: pytest.fail("loaded"))
    result = run_main("export.py", run / "weights" / "best.pth", "--format", "onnx", "--output", tmp_path / "m.onnx")
    assert_user_error(result, "ONNX export needs onnxscript (and onnx): pip install onnx onnxscript onnxruntime")
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.fast
def test_without_the_runs_images_the_check_runs_on_a_seeded_random_batch(run, traced, tmp_path, capsys):
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "best.pth").symlink_to(run / "weights" / "best.pth")
    (tmp_path / "class_indices.json").symlink_to(run / "class_indices.json")
    run_args = {**json.loads((run / "args.json").read_text()), "data_path": str(tmp_path / "moved")}
    (tmp_path / "args.json").write_text(json.dumps(run_args))
    export.main.__wrapped__([str(tmp_path / "weights" / "best.pth"), "--format", "torchscript"])
    stdout = capsys.readouterr().out
    expected = f"on a seeded random batch (the run's data folder {tmp_path / 'moved'} is not here; --data-path"
    assert expected in stdout and (tmp_path / "weights" / "best.torchscript.pt").read_bytes() == traced
    (tmp_path / "weights" / "best.torchscript.pt").unlink()
    with pytest.raises(UserError, match="--data-path .* is not a folder"):
        export.main.__wrapped__(
            [str(tmp_path / "weights" / "best.pth"), "--format", "torchscript", "--data-path", str(tmp_path / "moved")]
        )

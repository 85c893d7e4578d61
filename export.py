"""Export a run's trained network as one ONNX or TorchScript file, for runtimes that do not have this code.

python export.py runs/demo-single/weights/best.pth --format onnx
python export.py runs/demo-single/weights/best.pth --format torchscript --output flowers.torchscript.pt

The file holds the network in float32, NCHW, and the class names and preprocessing a deployer needs. It is written
only if the runtime a deployer would use gives PyTorch's logits within TOLERANCE (docs/trained-models.md).
"""

import contextlib
import importlib.util
import io
import json
import warnings
from itertools import islice, zip_longest
from pathlib import Path

import torch

from dataset.folders import list_images
from dataset.images import image_problem
from dataset.transforms import IMAGENET_MEAN, IMAGENET_STD, RESIZE_RATIO, normalise
from inference.trained import add_run_overrides, image_loader, load_trained_model
from multi_train_utils.distributed_utils import resolve_device
from utils import HelpFormatter, Parser, UserError, check_new_file, entry_point, warn, write_atomically

FORMATS = {"onnx": ".onnx", "torchscript": ".torchscript.pt"}  # the default output's suffix
TOLERANCE = 1e-4  # largest absolute difference in logits from PyTorch float32 that the check accepts
CHECK_IMAGES = 8


class ExportCheckError(UserError):
    """The exported file computes other logits than the network it came from: nothing is written."""


def parse_args(argv=None):
    p = Parser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    p.add_argument("weights", type=Path, metavar="RUN_WEIGHTS",
                   help="weights/best.pth, weights/last.pth, weights/model-N.pth or checkpoint.pth")  # fmt: skip
    p.add_argument("--format", required=True, choices=list(FORMATS), help="the file to write")
    p.add_argument("--output", type=Path, help="the file (default: beside the weights, named after them: best.onnx, "
                   "best.torchscript.pt)")  # fmt: skip
    p.add_argument("--force", action="store_true", help="replace the output file if it exists")
    add_run_overrides(p)
    p.add_argument("--data-path", type=Path, help="class folders whose images the check runs on (default: the run's; "
                   "none: a seeded random batch)")  # fmt: skip
    p.add_argument("--device", default="cpu",
                   help="where the network is traced: cpu, cuda or cuda:N (the check runs on the CPU)")  # fmt: skip
    return p.parse_args(argv)


def output_path(args) -> Path:
    """The file to write, refused if it exists (without --force) or is the weights file itself."""
    output = args.output or args.weights.with_name(args.weights.stem + FORMATS[args.format])
    if output.exists() and output.resolve() == args.weights.resolve():
        raise UserError(f"--output {output} is the weights file itself: name another file")
    check_new_file(output, "--output", args.force)
    return output


def preprocessing(img_size: int) -> dict:
    """How an image becomes the network's input (as val_transform does it), for the file's metadata."""
    return {
        "input": "images", "shape": ["batch", 3, img_size, img_size],  # NCHW, float32, RGB
        "resize_shorter_side": round(img_size * RESIZE_RATIO), "interpolation": "bilinear, antialiased",
        "center_crop": img_size, "scale": "1/255",  # 8-bit pixel values to [0, 1], before the normalisation
        "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD),
        "output": "logits",  # [batch, classes]; softmax over classes gives probabilities
    }  # fmt: skip


def describe_input(prep: dict, classes: list[str]) -> str:
    """The ONNX file's doc_string: its preprocessing in words, for a person reading the model."""
    size = prep["center_crop"]
    return (
        f"ResNet-34 image classifier, {len(classes)} classes ({', '.join(classes)}; metadata 'class_indices' maps "
        f"each logit's index to its name). Input 'images': float32 RGB, NCHW [batch, 3, {size}, {size}]: resize "
        f"the shorter side to {prep['resize_shorter_side']} px (bilinear, antialiased), crop the centre {size} px, "
        f"scale pixels to [0, 1], subtract mean {prep['mean']} and divide by std {prep['std']} per channel. "
        f"Output 'logits': [batch, {len(classes)}]; softmax gives probabilities. Metadata 'preprocessing' holds "
        "the same as JSON."
    )


def export_onnx(model, example: torch.Tensor, metadata: dict, doc: str) -> bytes:
    """The network as ONNX bytes by the torch.export-based exporter: batch dimension dynamic, `metadata` as props."""
    program = torch.onnx.export(model, (example,), dynamo=True, input_names=["images"], output_names=["logits"],
                                dynamic_shapes=({0: torch.export.Dim("batch")},), verbose=False)  # fmt: skip
    proto = program.model_proto
    proto.doc_string = doc
    for key, value in metadata.items():
        proto.metadata_props.add(key=key, value=value)
    return proto.SerializeToString()


@contextlib.contextmanager
def quiet_torchscript():
    """torch 2.14 warns that torch.jit is deprecated at every trace, save and load; here TorchScript is asked for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.\w+` is deprecated")
        yield


def export_torchscript(model, example: torch.Tensor, metadata: dict) -> bytes:
    """The traced network as TorchScript bytes, `metadata` as extra files."""
    buffer = io.BytesIO()
    with quiet_torchscript(), torch.no_grad():
        # A trace is exact for ResNet (no data-dependent control flow); the check below replaces check_trace.
        traced = torch.jit.trace(model, example, check_trace=False)
        torch.jit.save(traced, buffer, _extra_files={f"{key}.json": value for key, value in metadata.items()})
    return buffer.getvalue()


def onnx_needs() -> bool:
    """What the ONNX export needs beyond torch, checked before anything is loaded: onnxscript (else a UserError), and
    onnxruntime for its check (False where it cannot be imported: the check alone is skipped, said in one warning)."""
    if importlib.util.find_spec("onnxscript") is None:
        raise UserError("ONNX export needs onnxscript (and onnx): pip install onnx onnxscript onnxruntime")
    try:
        import onnxruntime  # noqa: F401
    except ImportError as error:
        warn(f"onnxruntime cannot be imported ({error}): the ONNX file will not be checked (pip install onnxruntime)")
        return False
    return True


def onnx_runner(data: bytes):
    """A function from a batch to the file's logits in onnxruntime (CPU), and the runtime's name."""
    import onnxruntime

    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    run = lambda batch: torch.from_numpy(session.run(["logits"], {"images": batch.numpy()})[0])  # noqa: E731
    return run, f"onnxruntime {onnxruntime.__version__}"


def torchscript_runner(data: bytes):
    """A function from a batch to the file's logits as torch.jit.load runs them (CPU), and the runtime's name."""
    with quiet_torchscript():
        loaded = torch.jit.load(io.BytesIO(data), map_location="cpu")

    def run(batch):
        with quiet_torchscript(), torch.no_grad():
            return loaded(batch)

    return run, f"torch.jit.load (torch {torch.__version__})"


def check_batch(trained, args, img_size: int) -> tuple[torch.Tensor, str]:
    """The check's input, prepared as evaluate.py prepares it (else a seeded random batch), and its source in words."""
    data_path = trained.setting("data_path", args.data_path)
    images = []
    if data_path is None:
        why = "no data folder known"
    elif not Path(data_path).is_dir():
        why = f"the run's data folder {data_path} is not here"
    else:  # up to CHECK_IMAGES readable images, taking each class in turn
        folders = sorted(p for p in Path(data_path).iterdir() if p.is_dir() and not p.name.startswith("."))
        in_turn = (image for row in zip_longest(*map(list_images, folders)) for image in row if image is not None)
        images = list(islice((image for image in in_turn if image_problem(image) is None), CHECK_IMAGES))
        why = f"no readable images in {data_path}"
    if not images:
        batch = torch.randn(CHECK_IMAGES, 3, img_size, img_size, generator=torch.Generator().manual_seed(0))
        return batch, f"a seeded random batch ({why}; --data-path names images to check on)"
    loader = image_loader(trained, images, [0] * len(images), img_size=img_size, batch_size=len(images), workers=0)
    batch, _ = next(iter(loader))
    return normalise(batch), f"{len(images)} images of {data_path}"  # the loader's 8-bit pixels, as the file takes them


@entry_point
def main(argv=None):
    args = parse_args(argv)
    output = output_path(args)
    if args.data_path is not None and not args.data_path.is_dir():
        raise UserError(f"--data-path {args.data_path} is not a folder")
    checked = onnx_needs() if args.format == "onnx" else True
    trained = load_trained_model(args.weights, args.class_indices, resolve_device(args.device), args.model)
    img_size = trained.setting("img_size", args.img_size)
    # float32 and NCHW whatever the run's --amp and --channels-last: no autocast here, and contiguous weights
    model = trained.model.float().to(memory_format=torch.contiguous_format)
    prep = preprocessing(img_size)
    metadata = {"class_indices": json.dumps(dict(enumerate(trained.classes))), "preprocessing": json.dumps(prep)}
    print(f"Exporting {args.weights} ({len(trained.classes)} classes) as {args.format}: float32, "
          f"input [batch, 3, {img_size}, {img_size}]")  # fmt: skip
    example = torch.zeros(2, 3, img_size, img_size, device=trained.device)  # torch.export specialises batch 1
    if args.format == "onnx":
        data = export_onnx(model, example, metadata, describe_input(prep, trained.classes))
        run, runtime = onnx_runner(data) if checked else (None, None)
    else:
        data = export_torchscript(model, example, metadata)
        run, runtime = torchscript_runner(data)
    if run is not None:
        batch, source = check_batch(trained, args, img_size)
        with torch.no_grad():
            expected = model.cpu()(batch)
        got = run(batch)
        if got.shape != expected.shape:
            raise ExportCheckError(f"the exported file gives logits of shape {list(got.shape)}, "
                                   f"not {list(expected.shape)}")  # fmt: skip
        difference = (got.float() - expected).abs().max().item()
        print(f"Checked with {runtime} on {source}: max abs difference from PyTorch float32 logits "
              f"{difference:.1e} (limit {TOLERANCE:.0e})")  # fmt: skip
        if not difference <= TOLERANCE:  # NaN fails too
            raise ExportCheckError(f"the exported file's logits differ from PyTorch's by up to {difference:.1e} "
                                   f"(limit {TOLERANCE:.0e}): {output} not written")  # fmt: skip
    write_atomically(output, lambda f: f.write(data), binary=True, size=len(data))
    print(f"Wrote {output} ({len(data) / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()

"""Loading weights: ImageNet-style files, our own saved weights, wrapper prefixes, and files that must be refused;
`--weights imagenet` (torchvision's cached file, its download, and failing clearly offline); timm's models, their
weights files (.pth, .safetensors) and their pretrained weights in Hugging Face's cache. No test uses the network:
the ImageNet file is made locally, and downloads go to a web server on 127.0.0.1 or find no network."""

import hashlib
import pickle
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import save_file
from torchvision.models import ResNet34_Weights, resnet18, resnet34, resnet50
from wiring import built_once

from dataset.transforms import IMAGENET_MEAN, IMAGENET_STD, normalise, val_transform
from network.architectures import IMAGENET, create_model, freeze_all_but_head
from network.weights import imagenet_weights_file, load_weights, weights_file
from utils import UserError

pytestmark = pytest.mark.fast  # no script started, no training run

IMAGENET_WEIGHTS = ResNet34_Weights.IMAGENET1K_V1  # what `--weights imagenet` means for the default model
OFFICIAL_NAME = "resnet34-b627a593.pth"  # the file name in IMAGENET_WEIGHTS.url, under which torch.hub caches it


# A ResNet-34 for 5 classes as create_model builds it, to load weights into: target(5), a copy of one built once
# (building one takes a third of a second on 2 cores, copying it a twentieth). Every copy holds the same weights: a
# test that compares two models builds the one it loads from with create_model.
target = built_once(create_model)


def test_a_1000_class_file_loads_everything_but_the_head(tmp_path):
    torch.manual_seed(0)
    imagenet_like = resnet34()  # the official file's layout: 1000-class fc
    torch.save(imagenet_like.state_dict(), tmp_path / "resnet34-imagenet.pth")
    model = target(5)
    head_before = model.fc.weight.clone()

    report = load_weights(model, tmp_path / "resnet34-imagenet.pth")

    assert sorted(report.skipped_shape) == ["fc.bias", "fc.weight"]
    assert report.missing == [] and report.unexpected == []
    assert torch.equal(model.layer4[2].conv2.weight, imagenet_like.layer4[2].conv2.weight)
    assert torch.equal(model.bn1.running_var, imagenet_like.bn1.running_var)
    assert torch.equal(model.fc.weight, head_before)
    assert "2 skipped for a different shape" in report.summary()


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "_orig_mod.module."])
def test_wrapper_prefixes_are_stripped(tmp_path, prefix):
    torch.manual_seed(1)
    source = create_model(5)
    torch.save({prefix + k: v for k, v in source.state_dict().items()}, tmp_path / "w.pth")
    model = target(5)
    report = load_weights(model, tmp_path / "w.pth")
    assert not report.missing and not report.unexpected and not report.skipped_shape
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), source.state_dict().values(), strict=True)
    )


def test_saved_weights_are_a_plain_torchvision_state_dict(tmp_path):
    model = create_model(5)
    torch.save(model.state_dict(), tmp_path / "model-0.pth")
    plain = resnet34(num_classes=5)
    plain.load_state_dict(torch.load(tmp_path / "model-0.pth", weights_only=True))  # strict: every key matches


def test_a_checkpoint_holding_the_model_under_model_is_accepted(tmp_path):
    model = target(5)
    torch.save({"model": model.state_dict(), "epoch": 3}, tmp_path / "checkpoint.pth")
    assert len(load_weights(target(5), tmp_path / "checkpoint.pth").loaded) == len(model.state_dict())


def test_missing_counters_and_unexpected_keys_are_reported(tmp_path):
    state = target(5).state_dict()
    del state["bn1.num_batches_tracked"]  # as in files saved before torchvision 0.4.1
    state["extra.weight"] = torch.zeros(1)
    torch.save(state, tmp_path / "w.pth")
    report = load_weights(target(5), tmp_path / "w.pth")
    assert report.missing == ["bn1.num_batches_tracked"]
    assert report.unexpected == ["extra.weight"]
    assert "1 missing from the file" in report.summary() and "1 in the file but not in the model" in report.summary()


def test_weights_of_another_architecture_are_refused(tmp_path):
    torch.save({"encoder.weight": torch.zeros(3, 3)}, tmp_path / "other.pth")
    with pytest.raises(UserError, match="no tensor that fits"):
        load_weights(target(5), tmp_path / "other.pth")


def test_a_file_that_is_not_a_state_dict_is_refused(tmp_path):
    torch.save([1, 2, 3], tmp_path / "list.pth")
    with pytest.raises(UserError, match="does not hold a state dict"):
        load_weights(target(5), tmp_path / "list.pth")
    (tmp_path / "text.pth").write_text("hello")
    with pytest.raises(UserError, match=r"is not a PyTorch file \(a text file"):
        load_weights(target(5), tmp_path / "text.pth")
    with pytest.raises(UserError, match="does not exist"):
        load_weights(target(5), tmp_path / "absent.pth")


class RunsCode:
    def __reduce__(self):
        return (exec, ("open(__import__('os').environ['PWNED_PATH'], 'w').write('ran')",))


def test_a_pickle_that_would_run_code_is_refused_and_never_runs(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("PWNED_PATH", str(marker))
    with open(tmp_path / "evil.pth", "wb") as f:
        pickle.dump({"fc.weight": RunsCode()}, f, protocol=2)
    with pytest.raises(UserError, match="weights_only=True"):
        load_weights(target(5), tmp_path / "evil.pth")
    assert not marker.exists()


def test_freezing_leaves_only_the_head_trainable():
    model = create_model(5)
    freeze_all_but_head(model)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {"fc.weight", "fc.bias"}


@pytest.mark.parametrize("other", [resnet18, resnet50])
def test_weights_of_another_resnet_are_refused(tmp_path, other):
    torch.save(other(num_classes=5).state_dict(), tmp_path / "other.pth")
    model = target(5)
    before = model.conv1.weight.clone()
    with pytest.raises(UserError, match="does not fit resnet34"):
        load_weights(model, tmp_path / "other.pth")
    assert torch.equal(model.conv1.weight, before)  # nothing half-loaded


# --- --weights imagenet ------------------------------------------------------------------------------------------


@pytest.fixture
def torch_cache(tmp_path, monkeypatch):
    """An empty torch cache of the test's own (TORCH_HOME); returns the folder torchvision downloads weights into."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    return tmp_path / "torch" / "hub" / "checkpoints"


@pytest.fixture
def no_network(monkeypatch):
    """A machine without network: every host name lookup fails as it does offline. Returns the names looked up."""
    looked_up = []

    def offline_lookup(host, *args, **kwargs):
        looked_up.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", offline_lookup)
    return looked_up


@pytest.fixture
def web_server(monkeypatch):
    """A web server on 127.0.0.1 whose answer each test sets: headers announcing `length` bytes (default: the
    body's), `body`, then, when the body is shorter, nothing more until the test ends (a download that stalls).
    `requests` counts the downloads; url(name) is the address of a file of that name."""
    monkeypatch.setenv("no_proxy", "*")  # straight to 127.0.0.1, even where a proxy is configured
    test_over = threading.Event()
    answer = SimpleNamespace(body=b"", length=None, delay_s=0.0, requests=0)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            answer.requests += 1
            time.sleep(answer.delay_s)
            self.send_response(200)
            self.send_header("Content-Length", str(answer.length or len(answer.body)))
            self.end_headers()
            self.wfile.write(answer.body)
            self.wfile.flush()
            if answer.length:
                test_over.wait(timeout=60)

        def log_message(self, *args):  # keep the test output clean
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    # polled every 20 ms for the shutdown at the end (the default, 0.5 s, made each test wait that long)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    answer.url = lambda name: f"http://127.0.0.1:{server.server_port}/models/{name}"
    yield answer
    test_over.set()
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("with_counters", [True, False], ids=["with-num_batches_tracked", "without"])
def test_cached_imagenet_weights_are_found_offline_and_load_all_but_the_head(torch_cache, no_network, with_counters):
    torch.manual_seed(2)
    # The official file's layout: torchvision's 1000-class ResNet-34. Every tensor differs from a fresh model's,
    # so that equality below proves it was loaded. Old files lack the num_batches_tracked counters.
    official = {
        name: torch.randn_like(tensor) if tensor.is_floating_point() else tensor + 123
        for name, tensor in resnet34(num_classes=1000).state_dict().items()
        if with_counters or not name.endswith("num_batches_tracked")
    }
    torch_cache.mkdir(parents=True)
    torch.save(official, torch_cache / OFFICIAL_NAME)

    path = weights_file(IMAGENET)
    model = target(5)
    report = load_weights(model, path)

    assert path == torch_cache / OFFICIAL_NAME and no_network == []  # found in the cache, no download tried
    assert report.loaded == [name for name in official if not name.startswith("fc.")]
    assert all(torch.equal(model.state_dict()[name], official[name]) for name in report.loaded)
    assert report.skipped_shape == ["fc.weight", "fc.bias"] and model.fc.weight.shape == (5, 512)
    assert "2 skipped for a different shape: fc.weight, fc.bias" in report.summary()
    assert len(report.missing) == (0 if with_counters else 36)  # the counters; a fresh model's are used


def test_offline_imagenet_fails_with_the_url_and_where_to_put_the_file(torch_cache, no_network):
    with pytest.raises(UserError) as caught:
        weights_file(IMAGENET)

    message = str(caught.value)
    assert message.startswith("cannot download ImageNet weights (no network?") and "\n" not in message
    assert f"fetch {IMAGENET_WEIGHTS.url} and put it at {torch_cache / OFFICIAL_NAME}" in message
    assert no_network == ["download.pytorch.org"]  # torch.hub's download tried, and failed as it does offline
    assert [p.name for p in torch_cache.iterdir()] == [f".{OFFICIAL_NAME}.lock"]  # no weights file, no .partial


def test_a_stalled_download_gives_up_after_the_timeout_and_leaves_no_partial_file(torch_cache, web_server, monkeypatch):
    monkeypatch.setattr("network.weights.DOWNLOAD_TIMEOUT_S", 0.5)
    web_server.body, web_server.length = b"x" * 1000, 10**6  # 1000 bytes of a million, then silence

    started = time.monotonic()
    with pytest.raises(UserError, match=r"no network\? timed out\): fetch http://127\.0\.0\.1:\d+/models/resnet34"):
        imagenet_weights_file(web_server.url(OFFICIAL_NAME))

    assert time.monotonic() - started < 10
    assert [p.name for p in torch_cache.iterdir()] == [f".{OFFICIAL_NAME}.lock"]


def test_a_download_that_is_not_the_expected_file_is_refused_and_not_kept(torch_cache, web_server):
    web_server.body = b"<html>Please sign in to use this network</html>"  # a captive portal's answer
    with pytest.raises(UserError, match="is not the expected one .*invalid hash value.*and put it at"):
        imagenet_weights_file(web_server.url(OFFICIAL_NAME))
    assert not (torch_cache / OFFICIAL_NAME).exists()


def test_processes_asking_at_once_download_once(torch_cache, web_server):
    web_server.body, web_server.delay_s = b"pretend weights", 0.3
    name = f"resnet34-{hashlib.sha256(web_server.body).hexdigest()[:8]}.pth"  # passes torch.hub's hash check
    # Threads stand in for processes: each call makes its own FileLock, which opens the lock file itself, and the
    # flock under it (on Linux) locks per open file.
    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(imagenet_weights_file, [web_server.url(name)] * 2))
    assert paths == [torch_cache / name] * 2
    assert web_server.requests == 1
    assert (torch_cache / name).read_bytes() == web_server.body


def test_a_path_is_returned_unchanged(tmp_path, no_network):
    assert weights_file(tmp_path / "best.pth") == tmp_path / "best.pth"
    assert weights_file("runs/a/weights/best.pth") == Path("runs/a/weights/best.pth")
    assert weights_file(Path("imagenet")) == Path("imagenet")  # a file of that name: only the word is special
    assert no_network == []


def test_the_dataset_prepares_images_as_the_imagenet_weights_expect():
    official = IMAGENET_WEIGHTS.transforms()  # resize 256, centre crop 224, ImageNet mean and std
    assert (tuple(official.mean), tuple(official.std)) == (IMAGENET_MEAN, IMAGENET_STD)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (300, 400, 3), dtype=np.uint8))
    one_level = 1 / 255 / min(IMAGENET_STD)  # resizing PIL images or uint8 tensors may round a pixel differently
    ours = normalise(val_transform(224)(image))  # the loader's 8-bit crop, normalised as Choice.batch_to does
    torch.testing.assert_close(ours, official(image), rtol=0, atol=one_level * 1.01)


# --- timm's models: their own weights files, `--weights imagenet` from Hugging Face's cache --------------------------

TIMM_MODEL = "timm/test_resnet"  # timm's tiny ResNet made for tests; its default pretrained tag is r160_in1k
TIMM_REPO = "timm/test_resnet.r160_in1k"  # where Hugging Face keeps those weights


def timm_imagenet_like() -> dict:
    """A state dict in the layout of timm's pretrained weights for TIMM_MODEL (a 1000-class head), every tensor
    random."""
    torch.manual_seed(4)
    state = timm.create_model("test_resnet", num_classes=1000).state_dict()
    return {key: torch.randn_like(t) if t.is_floating_point() else t + 123 for key, t in state.items()}


@pytest.mark.parametrize("form", ["state dict .pth", ".safetensors", "checkpoint of timm's training script"])
def test_a_timm_weights_file_loads_all_but_the_head(tmp_path, form):
    official = timm_imagenet_like()
    path = tmp_path / ("weights.safetensors" if form == ".safetensors" else "weights.pth")
    if form == ".safetensors":
        save_file(official, path)
    else:
        torch.save({"state_dict": official, "epoch": 3} if "checkpoint" in form else official, path)
    model = create_model(5, TIMM_MODEL)
    report = load_weights(model, path, name=TIMM_MODEL)
    assert sorted(report.skipped_shape) == ["fc.bias", "fc.weight"] and not report.missing and not report.unexpected
    assert all(torch.equal(model.state_dict()[key], official[key]) for key in report.loaded)
    assert model.fc.weight.shape == (5, model.fc.in_features)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache of the test's own; returns it."""
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf"))
    return tmp_path / "hf"


def test_cached_timm_weights_are_found_offline_and_load_all_but_the_head(hf_cache, no_network):
    # the cache as huggingface_hub lays it out: a snapshot of the repository, and the commit its main branch names
    repo = hf_cache / f"models--{TIMM_REPO.replace('/', '--')}"
    (repo / "snapshots" / "0123abcd").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    save_file(timm_imagenet_like(), repo / "snapshots" / "0123abcd" / "model.safetensors")

    path = weights_file(IMAGENET, TIMM_MODEL)
    report = load_weights(create_model(5, TIMM_MODEL), path, name=TIMM_MODEL)

    assert path == repo / "snapshots" / "0123abcd" / "model.safetensors" and no_network == []
    assert sorted(report.skipped_shape) == ["fc.bias", "fc.weight"] and not report.missing


def test_offline_timm_weights_fail_at_once_with_the_url_to_fetch(hf_cache, no_network):
    started = time.monotonic()
    with pytest.raises(UserError) as caught:
        weights_file(IMAGENET, TIMM_MODEL)
    message = str(caught.value)
    assert message.startswith(f"cannot download timm's pretrained weights for {TIMM_MODEL} (no network?")
    assert f"fetch https://huggingface.co/{TIMM_REPO}/resolve/main/model.safetensors and give it as --weights FILE" in (
        message
    )
    assert "\n" not in message and time.monotonic() - started < 5  # one try, not huggingface_hub's 5 retries
    assert set(no_network) == {"huggingface.co"} and not any(hf_cache.rglob("*.safetensors"))


def test_a_timm_model_without_pretrained_weights_says_so(no_network):
    with pytest.raises(UserError, match="timm has no pretrained weights for --model timm/test_mambaout"):
        weights_file(IMAGENET, "timm/test_mambaout")

"""What a run needs beyond Python, checked before anything is loaded (issue 57): torch.compile's compiler (a C++
compiler on the CPU; Triton and its C compiler on a GPU) and a tracker's server. Where one is missing, the fallback
is said in one warning (eager instead of compiled; untracked) and the run trains as it would without the flag.
Each absence is made, not assumed: a PATH without a compiler, Triton's lookup answering no, a port nobody listens
on. (export.py's onnxscript and onnxruntime: tests/test_export.py; a spawn's MASTER_PORT: tests/test_bad_input.py.)"""

import importlib

import pytest
import torch
from conftest import REFERENCE_FLAGS, final_weights
from test_tracking import mlflow_settings
from torch._inductor.cpp_builder import cpp_compiler_search

from multi_train_utils.spawn_utils import find_free_port
from run import plan
from run.config import Config
from run.plan import compile_needs, compiled_if_it_can
from run.tracking import reachable_tracker


@pytest.fixture
def path_of(tmp_path, monkeypatch):
    """PATH set to a folder holding only the programs named (each a script answering as a compiler does), no CC or CXX;
    inductor's lookup of the C++ compiler, which it keeps for the process, looked up anew then and after."""

    def set_path(*programs: str):
        folder = tmp_path / "-".join(["bin", *programs])
        folder.mkdir(exist_ok=True)
        for program in programs:
            (folder / program).write_text("#!/bin/sh\necho 'fake 1.0'\n")
            (folder / program).chmod(0o755)
        monkeypatch.setenv("PATH", str(folder))
        for name in ("CC", "CXX"):
            monkeypatch.delenv(name, raising=False)
        cpp_compiler_search.cache_clear()

    yield set_path
    cpp_compiler_search.cache_clear()


@pytest.fixture
def triton_found(monkeypatch):
    """Triton's lookup (torch.utils._triton.has_triton, which torch.compile asks) answering as the test says."""
    import torch.utils._triton

    return lambda found: monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: found)


@pytest.mark.fast
def test_on_the_cpu_a_compiler_on_the_path_is_all_compile_needs_and_without_one_it_is_named(path_of):
    path_of("g++")
    assert compile_needs("cpu") is None
    path_of()  # none
    assert compile_needs("cpu").startswith("a C++ compiler on the CPU (No working C++ compiler found")


@pytest.mark.fast
def test_on_a_gpu_compile_needs_triton_and_a_c_compiler_for_it(path_of, triton_found):
    path_of("gcc")
    triton_found(True)
    assert compile_needs("cuda") is None
    triton_found(False)
    assert compile_needs("cuda") == "Triton on a GPU, which torch does not find here: pip install triton"
    triton_found(True)
    path_of()  # Triton, and no C compiler to build its launchers
    assert compile_needs("cuda").startswith("a C compiler for Triton on a GPU, and none is found")


@pytest.mark.fast
def test_compile_on_a_gpu_without_triton_falls_back_to_eager_in_one_warning(triton_found, monkeypatch, capsys):
    triton_found(False)
    monkeypatch.setattr(plan, "resolve_device", lambda name: torch.device("cuda", 0))  # a GPU, faked
    config = compiled_if_it_can(Config(compile=True, device="cuda"))
    assert not config.compile and config.device == "cuda"
    (line,) = capsys.readouterr().err.splitlines()
    assert line == "warning: --compile needs Triton on a GPU, which torch does not find here: pip install triton: " \
        "the run trains uncompiled (eager)"  # fmt: skip
    assert compiled_if_it_can(Config(compile=False, device="cuda")).compile is False and not capsys.readouterr().err


# Trackers whose server cannot be reached, and what the warning says of each
UNREACHABLE = {
    "a closed port": (lambda port: f"http://127.0.0.1:{port}", "Connection refused"),
    "a host that does not exist": (lambda port: "https://mlflow.invalid", "cannot connect to mlflow.invalid: "),
    "a database server on a closed port": (lambda port: f"postgresql+psycopg2://u:pw@127.0.0.1:{port}/db", "refused"),
    "a port that is no number": (lambda port: "http://127.0.0.1:50x0", "Port could not be cast to integer"),
}


@pytest.mark.fast
@pytest.mark.parametrize("tracker", UNREACHABLE)
def test_a_tracker_that_cannot_be_reached_is_left_out_in_one_warning(tracker, capsys):
    make, reason = UNREACHABLE[tracker]
    uri = make(find_free_port())
    with mlflow_settings():
        config = reachable_tracker(Config(tracking_uri=uri, epochs=3))
    assert config.tracking_uri is None and config.epochs == 3
    (line,) = capsys.readouterr().err.splitlines()
    shown = uri.replace(":pw@", ":***@")  # a password never printed
    assert line.startswith(f"warning: MLflow tracking at {shown} failed (cannot connect to ") and reason in line, line
    assert ":pw@" not in line
    assert line.endswith("the run goes on untracked; a resume of the run logs the epochs the tracker missed")


@pytest.mark.fast
def test_a_tracker_that_can_be_reached_or_is_not_a_server_is_kept(taken_port, tmp_path, monkeypatch, capsys):
    served = f"http://127.0.0.1:{taken_port}"  # something listens there
    with mlflow_settings():
        for uri in (served, f"sqlite:///{tmp_path / 'mlflow.db'}", str(tmp_path / "mlruns")):
            assert reachable_tracker(Config(tracking_uri=uri)).tracking_uri == uri
        monkeypatch.setenv("MLFLOW_TRACKING_URI", served)  # MLflow's own variable, where no flag names one
        assert reachable_tracker(Config()).tracking_uri == served
        monkeypatch.setenv("http_proxy", "http://127.0.0.1:3128")  # through a proxy, which this machine may need
        closed = f"http://127.0.0.1:{find_free_port()}"
        assert reachable_tracker(Config(tracking_uri=closed)).tracking_uri == closed
    assert not capsys.readouterr().err


@pytest.mark.fast
def test_what_a_run_lacks_beyond_python_is_said_before_its_data_is_read(path_of, tmp_path, run_main):
    path_of()  # no C++ compiler
    closed = f"http://127.0.0.1:{find_free_port()}"
    flags = ["--compile", "--device", "cpu", "--tracking-uri", closed, "--data-path", tmp_path / "missing"]
    with mlflow_settings():
        result = run_main("train_single_gpu.py", *flags)
    assert result.returncode == 2
    assert [line.split(" ")[:3] for line in result.stderr.splitlines()] == [
        ["warning:", "--compile", "needs"],
        ["warning:", "MLflow", "tracking"],
        ["error:", "data", "path"],  # read after them
    ], result.stderr


def test_a_run_without_a_compiler_or_its_tracker_trains_as_one_without_compile_or_tracking(
    path_of, tiny_data, tmp_path, reference_run, capsys
):
    path_of()
    closed = f"http://127.0.0.1:{find_free_port()}"  # nothing listens there
    out = tmp_path / "run"
    flags = ("--data-path", tiny_data, *REFERENCE_FLAGS, "--output-dir", out, "--compile", "--tracking-uri", closed)
    with mlflow_settings():
        importlib.import_module("train_single_gpu").main([str(flag) for flag in flags])  # returns: exit status 0
    printed = capsys.readouterr()
    warnings = [line for line in printed.err.splitlines() if "warning:" in line or "Traceback" in line]
    assert len(warnings) == 2 and warnings[0].startswith("warning: --compile needs a C++ compiler on the CPU")
    assert "Compile: off (--compile given, but it needs a C++ compiler on the CPU (" in printed.out  # not auto's
    assert warnings[1].startswith(f"warning: MLflow tracking at {closed} failed"), warnings
    expected, weights = final_weights(reference_run), final_weights(out)
    assert all(torch.equal(expected[key], weights[key]) for key in expected)

"""The guarantees hold on the other kind of CPU too.

Where this CPU has more than AVX2 (AVX-512, AMX), the tests marked `guarantee` run again in a fresh pytest with
torch capped to the kernels an AVX2-only CPU uses (an AMD EPYC, most laptops): a change made and tested on one
kind of machine cannot break the other unnoticed. On an AVX2 CPU those tests have just run on that kind.

Left out: the guarantees marked `across_launchers`, which compare two launch arrangements of one computation
(torchrun against spawn, two nodes against one) that run the same kernels on both sides, so the kernels cannot
make them differ; they are half of this rerun's time, and the suite must stay within 10 minutes on 2 cores.
"""

import os
import subprocess
import sys

import pytest
from conftest import ROOT

from machine import AVX2_CAPS, torch_cpu_isa


@pytest.mark.skipif(torch_cpu_isa() != "AVX512", reason=f"torch computes with {torch_cpu_isa()} kernels here already")
def test_the_guarantees_hold_with_torch_capped_to_avx2_kernels():
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "guarantee and not across_launchers",
        "-n",
        "0",
        "-p",
        "no:cacheprovider",
        "tests",
    ]
    result = subprocess.run(
        command, cwd=ROOT, env={**os.environ, **AVX2_CAPS}, capture_output=True, text=True, timeout=1800
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in summary and "failed" not in summary and "skipped" not in summary, summary

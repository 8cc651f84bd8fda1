"""Every kernel code path compiles to PTX for sm_80 and sm_90.

The simulator accepts code that NVVM rejects, so this runs kernels_numba.ptx_check in a fresh process
without NUMBA_ENABLE_CUDASIM (compile_ptx needs numba-cuda's cu12/cu13 extra, not a GPU). One test per
kernel family and compute capability, so pytest-xdist spreads the compiles over the workers; each compiles
one representative per code path (`python -m kernels_numba.ptx_check --full` compiles every variant).
"""

import os
import subprocess
import sys

import pytest

from kernels_numba.ptx_check import FAMILIES


@pytest.mark.parametrize("cc", ["80", "90"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_compiles_to_ptx(family, cc):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    run = subprocess.run([sys.executable, "-m", "kernels_numba.ptx_check", "--cc", cc, "--family", family], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert f"all kernels compiled for sm_{cc}" in run.stdout
    assert run.stdout.count(" ok ") >= 3, run.stdout

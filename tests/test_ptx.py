"""Every kernel variant compiles to PTX for sm_80 and sm_90.

The simulator accepts code that NVVM rejects, so this runs kernels_numba.ptx_check in a fresh process
without NUMBA_ENABLE_CUDASIM (compile_ptx needs numba-cuda's cu12/cu13 extra, not a GPU).
"""

import os
import subprocess
import sys


def test_all_kernels_compile_to_ptx_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    run = subprocess.run([sys.executable, "-m", "kernels_numba.ptx_check", "--cc", "80", "90"], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "all kernels compiled for sm_80, sm_90" in run.stdout
    assert run.stdout.count(" ok ") >= 20, run.stdout

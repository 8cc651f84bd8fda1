"""Compile a small kernel that calls inline-PTX intrinsics, for real, without a GPU: in a fresh process without the
CUDA simulator, numba-cuda compiles it to PTX for each compute capability, ptxas assembles it and nvdisasm prints
the machine code, whose opcodes the test then reads (`opcodes`). Needs numba-cuda's NVVM and the CUDA toolkit
wheels (ptxas, nvdisasm, the `test` extra); the test skips without the tools.

Numba's start-up is most of the cost (a few seconds), so each test file groups its intrinsics in one kernel.
"""

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

_PRELUDE = """
import json, os, subprocess, tempfile
from collections import Counter
from numba import cuda, types
from kernels_numba import ptx_check
from cacheattn.lab import sass

ptx_check._allow_device_functions_without_gpu()
"""

_EPILOGUE = """
try:
    tools = sass._nvidia_binary("ptxas"), sass._nvidia_binary("nvdisasm")
except sass.ToolMissing as missing:
    print("MISSING " + str(missing))
    raise SystemExit(0)
out = {}
for cc in CCS:
    ptx_check._target_cc[0] = cc
    kernel, argtypes = build(cc)
    ptx, _ = cuda.compile_ptx(kernel, argtypes, cc=cc)
    with tempfile.TemporaryDirectory() as tmp:
        source, cubin = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
        with open(source, "w") as f:
            f.write(ptx)
        run = subprocess.run([tools[0], f"-arch=sm_{cc[0]}{cc[1]}", source, "-o", cubin], capture_output=True,
                             text=True)
        if run.returncode:
            raise SystemExit(f"ptxas sm_{cc[0]}{cc[1]}: {run.stderr}")
        listing = subprocess.run([tools[1], "-c", cubin], capture_output=True, text=True, check=True).stdout
    opcodes = Counter(sass.opcode(text) for _, text, _ in sass.parse_sass(listing))
    out[f"sm_{cc[0]}{cc[1]}"] = dict(ptx=ptx, opcodes=opcodes)
print("RESULT " + json.dumps(out))
"""


def compile_kernels(script: str, ccs=((8, 0), (9, 0))) -> dict:
    """{'sm_80': {'ptx': text, 'opcodes': Counter}, ...} for the kernel that `script`'s `build(cc)` returns as
    (python function, argument types)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    source = _PRELUDE + script + f"\nCCS = {tuple(ccs)!r}\n" + _EPILOGUE
    run = subprocess.run([sys.executable, "-c", source], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    if run.stdout.startswith("MISSING"):
        pytest.skip(run.stdout.strip())
    result = json.loads(run.stdout.split("RESULT ", 1)[1])
    return {cc: dict(ptx=r["ptx"], opcodes=Counter(r["opcodes"])) for cc, r in result.items()}


def count(opcodes: Counter, prefix: str) -> int:
    """How many instructions have an opcode starting with `prefix` ('LDSM.16.MT88' counts LDSM.16.MT88.4)."""
    return sum(n for op, n in opcodes.items() if op == prefix or op.startswith(prefix + "."))

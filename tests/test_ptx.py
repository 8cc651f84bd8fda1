"""Every kernel code path compiles to PTX.

The simulator accepts code that NVVM rejects, so this runs kernels_numba.ptx_check in a fresh process
without NUMBA_ENABLE_CUDASIM (compile_ptx needs numba-cuda's cu12/cu13 extra, not a GPU). One test per
group of kernel families and compute capability, so pytest-xdist spreads the compiles over the workers; each
compiles one representative per code path (`python -m kernels_numba.ptx_check --full` compiles every variant).

Compiles cost seconds each, so the suite compiles every family for sm_90 (the Hopper GPUs this project is
measured on) alone: nothing in the kernels is architecture-specific (rung 5's inline-PTX mma.sync and the
float16-pair instructions need sm_80 or later and are the same text on both; a family fails unless every compile
that needs them contains them). CI's deep tier (.ci/run) runs `python -m kernels_numba.ptx_check` for sm_80 and
sm_90 over every variant of the smaller families and a spread of FasterTransformer's and TensorRT-LLM's cross
products (`--full --stride`); CACHEATTN_EXAMPLES >= 2 adds sm_80 for every family here.
"""

import os
import subprocess
import sys

import pytest

from kernels_numba.ptx_check import FAMILIES

LONG_HUNT = int(os.environ.get("CACHEATTN_EXAMPLES", "1")) >= 2
# Families grouped into tests of about a minute's compiles each (a process's start and first compile cost seconds
# of their own); the groups hold every family once.
GROUPS = (("trtllm",), ("rung5", "rung3", "ladder", "convert"), ("onnx", "ft", "rung4", "ppl"), ("rung6",))
# Rung 6's two compiles (about 30 s each, 60 on a busy machine) run in the deep tier only: the quick tier's budget
# is spent. Its sm_90 machine code is committed (docs/kernel-ladder-sass.json, rung6-float16-prefill).
TARGETS = [(families, cc) for cc in ("90", "80")[:2 if LONG_HUNT else 1] for families in GROUPS
           if LONG_HUNT or families != ("rung6",)]


def test_the_groups_hold_every_family_once():
    assert sorted(f for group in GROUPS for f in group) == sorted(FAMILIES)


@pytest.mark.parametrize("families, cc", TARGETS, ids=[f"{'+'.join(g)}-{cc}" for g, cc in TARGETS])
def test_family_compiles_to_ptx(families, cc):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    run = subprocess.run([sys.executable, "-m", "kernels_numba.ptx_check", "--cc", cc, "--family", *families],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert f"all kernels compiled for sm_{cc}" in run.stdout
    assert run.stdout.count(" ok ") >= 3, run.stdout


def test_ft_head_sizes_match_the_public_face():
    """ptx_check keeps its own copy of FasterTransformer's head sizes (the kernels never import cacheattn)."""
    from cacheattn.ft import HEAD_SIZES
    from kernels_numba.ptx_check import FT_HEAD_SIZES

    assert FT_HEAD_SIZES == HEAD_SIZES


def test_a_stride_keeps_every_kernel_and_spreads_over_its_variants():
    from types import SimpleNamespace

    from kernels_numba.ptx_check import spread

    def launch(name, variant):
        kernel = SimpleNamespace(py_func=SimpleNamespace(__qualname__=name))
        return (f"{name} {variant}", kernel, ())

    launches = [launch("attention", v) for v in range(10)] + [launch("combine", v) for v in range(3)]
    labels = [label for label, _, _ in spread(launches, 4)]
    assert labels == ["attention 0", "attention 4", "attention 8", "combine 0"]
    assert spread(launches, 1) == launches

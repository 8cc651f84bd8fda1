"""The rung pages' code-showing helpers: a function as a GPU compiles it, and a diff of chosen regions."""

import pytest

from cacheattn import _docs
from kernels_numba import _vector, _warp


def test_definition_shows_the_gpu_branch_not_the_simulators():
    shown = _docs.definition(_warp, "transpose_sum")
    assert shown.startswith("# kernels_numba/_warp.py:")
    assert "shfl_xor_sync" in shown and "syncthreads" not in shown       # the simulator's version uses barriers
    assert "@intrinsic" in _docs.definition(_vector, "half_from_bits")
    with pytest.raises(ValueError, match="name"):
        _docs.definition(_warp, "no_such_function")


def test_curated_diff_shows_only_the_chosen_regions():
    old = "a = 1\nb = 2\nkeep\nc = 3\nend\ntail = 0\n"
    new = "a = 1\nb = 5\nkeep\nd = 4\nend\ntail = 9\n"
    shown = _docs.curated_diff(old, new, ("middle", ("b =", "end"), ("b =", "end"))).splitlines()
    assert shown == ["@@ middle @@", "-b = 2", "+b = 5", " keep", "-c = 3", "+d = 4", " end"]
    with pytest.raises(ValueError, match="end"):
        _docs.curated_diff(old, new, ("x", ("b =", "nowhere"), ("b =", "end")))

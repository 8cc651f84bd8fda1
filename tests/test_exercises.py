"""cacheattn.exercises: every solution passes its check; for every exercise a planted wrong kernel fails "right" with
a shrunk counterexample, and a planted slow or unsafe one fails "fast" or "safe" naming what to fix; the first
kernel page's kernels match the operator and count as the page says."""

import os

import numpy as np
import pytest
from numba import cuda

import cacheattn
from cacheattn import exercises, lab
from cacheattn.exercises import first_kernel, mistakes, skeletons, solutions

pytestmark = pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1",
                                reason="the checks count in numba's CUDA simulator")

KERNELS = {1: "copy_head", 2: "tile_scores", 3: "online_softmax", 4: "gather_pages", 5: "dequantize_int8",
           6: "gqa_values", 7: "combine_splits"}
# The planted slow or unsafe kernel of each exercise, the verdict it must fail, and a word of the fix it must name.
PLANTED = {1: ("_slow", "fast", "lane pick the dimension"), 2: ("_slow", "fast", "rows of 33 words"),
           3: ("_slow", "fast", "exp(old maximum - new maximum)"), 4: ("_unsafe", "safe", "out_of_bounds on k_cache"),
           5: ("_slow", "fast", "lane on the dimension"), 6: ("_slow", "fast", "each value row once"),
           7: ("_slow", "fast", "running maximum")}


def test_seven_exercises_each_with_skeleton_solution_and_plants():
    assert sorted(exercises.EXERCISES) == list(range(1, 8))
    for n, name in KERNELS.items():
        assert exercises.EXERCISES[n].skeleton is getattr(skeletons, name)
        assert f"Exercise {n}" in exercises.show(n) and "def " + name in exercises.show(n)


@pytest.mark.parametrize("n", sorted(KERNELS))
def test_solution_passes_all_three(n):
    result = exercises.check(n, getattr(solutions, KERNELS[n]))
    assert result.passed, str(result)
    assert "3 of 3 verdicts pass" in str(result)


@pytest.mark.parametrize("n", sorted(KERNELS))
def test_planted_wrong_kernel_fails_right_with_a_smaller_counterexample(n):
    kernel = getattr(mistakes, KERNELS[n] + "_wrong")
    result = exercises.check(n, kernel)
    assert not result.right.passed and not result.passed
    sizes = result.counterexample
    defaults = exercises.EXERCISES[n].sizes
    assert set(sizes) == set(defaults) and all(sizes[k] <= defaults[k] for k in sizes)
    assert "differ" in result.right.message and f"exercises.inputs({n}, seed=0, " in result.right.message
    # The counterexample it names fails again when made with exercises.inputs.
    x = exercises.inputs(n, **sizes)
    exercises.EXERCISES[n].launch_kernel(kernel, x)
    assert exercises._difference(exercises.EXERCISES[n], x) is not None


@pytest.mark.parametrize("n", sorted(KERNELS))
def test_planted_slow_or_unsafe_kernel_fails_with_the_fix(n):
    suffix, verdict, fix = PLANTED[n]
    result = exercises.check(n, getattr(mistakes, KERNELS[n] + suffix))
    failed = getattr(result, verdict)
    assert not failed.passed and fix in failed.message, str(result)
    assert result.right.passed, str(result)       # slow or unsafe, but its outputs are right


def test_missing_barrier_is_a_race_and_the_skeleton_is_not_right():
    result = exercises.check(2, mistakes.tile_scores_unsafe)
    assert not result.safe.passed and "race on tile" in result.safe.message
    assert "cuda.syncthreads()" in result.safe.message
    skeleton = exercises.check(1, skeletons.copy_head)
    assert not skeleton.right.passed and "outputs start as NaN" in skeleton.right.message
    assert not skeleton.fast.passed and "nothing to count" in skeleton.fast.message


def test_a_kernel_that_raises_is_a_verdict_not_an_error():
    @cuda.jit
    def reads_past_the_end(k_cache, head, out):
        lane = cuda.threadIdx.x
        out[0, lane] = k_cache[out.shape[0] + 5, head, lane]

    result = exercises.check(1, reads_past_the_end)
    assert not result.right.passed and "raised IndexError" in result.right.message
    assert not result.fast.passed and "launch failed" in result.fast.message
    assert not result.safe.passed and "out_of_bounds on k_cache" in result.safe.message


def test_bad_use_of_check_is_a_clear_error():
    with pytest.raises(ValueError, match="n must be one of the exercises"):
        exercises.check(8, solutions.copy_head)
    with pytest.raises(TypeError, match="n must be an exercise number"):
        exercises.check("1", solutions.copy_head)
    with pytest.raises(TypeError, match="kernel must be a numba.cuda.jit kernel"):
        exercises.check(1, solutions.copy_head.py_func)
    with pytest.raises(ValueError, match="sizes must be ints at least"):
        exercises.inputs(1, tokens=0)
    with pytest.raises(ValueError, match="sizes of exercise 1 are"):
        exercises.inputs(1, heads=2)
    with pytest.raises(ValueError, match="sizes must be at most"):
        exercises.inputs(2, keys=33)


def _paged_decode_case(rng, kvlens, num_heads=4, num_kv_heads=2, page_size=8):
    """A decode step through cacheattn.multi_head_cache_attention (OpenPPL, paged cache_mode 1, layout 2): its
    output, and the cache it left, which holds each sequence's new token."""
    batch, head_dim = len(kvlens), 32
    pages = -(-max(kvlens) // page_size)
    max_t = (batch * pages + 1) * page_size
    order = rng.permutation(max_t // page_size) * page_size
    cachestarts = np.full((batch, pages), -1, np.int64)
    for b, kvlen in enumerate(kvlens):
        used = -(-kvlen // page_size)
        cachestarts[b, :used] = order[b * pages:b * pages + used]
    cache = rng.standard_normal((1, 2, max_t, num_kv_heads, head_dim)).astype(np.float16)
    query = rng.standard_normal((batch, num_heads, head_dim)).astype(np.float16)
    current = [rng.standard_normal((batch, num_kv_heads, head_dim)).astype(np.float16) for _ in range(2)]
    kvlens = np.array(kvlens)
    ref = cacheattn.multi_head_cache_attention(
        query, *current, np.arange(batch + 1), np.concatenate([[0], np.cumsum(kvlens)]), cachestarts, kvlens - 1,
        batch, 1, int(kvlens.max()), cache, None, None, num_heads=num_heads, head_dim=head_dim, is_causal=True,
        num_kv_heads=num_kv_heads, cache_mode=1, cache_layout=2, page_size=page_size)
    return (query, cache[0, 0], cache[0, 1], cachestarts, kvlens, page_size), ref


def test_first_kernel_matches_the_operator_and_counts_its_flaw():
    args, ref = _paged_decode_case(np.random.default_rng(1), [35, 9])
    expected = ref.astype(np.float64)
    line = "first_kernel.py:"
    with lab.record() as naive:
        out = first_kernel.run(first_kernel.decode_attention, *args)
    # The operator's output is float16: the kernel's float32 agrees to float16's rounding.
    np.testing.assert_allclose(out, expected, rtol=2e-3, atol=2e-3)
    k_line = [f for name, f in naive.lines.items() if name.startswith(line) and f["global_ld_requests"]
              and f["global_ld_sectors"] > 4 * f["global_ld_requests"]]
    assert len(k_line) == 1                         # the key load, and only it, touches more than 4 sectors
    counts = {}
    for width in (32, 33):
        with lab.record() as rec:
            tiled = first_kernel.run(first_kernel.tiled_decode_attention(width), *args)
        np.testing.assert_allclose(tiled, expected, rtol=2e-3, atol=2e-3)
        assert not rec.hazards
        counts[width] = rec.metrics["l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"]
        assert rec.metrics["l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum"] < \
            naive.metrics["l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum"] / 2
    assert counts[32] > 0 and counts[33] == 0
    with pytest.raises(ValueError, match="head_dim must be 32"):
        first_kernel.run(first_kernel.decode_attention, args[0][..., :16], *args[1:])

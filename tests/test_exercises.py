"""cacheattn.exercises: every solution passes its check; for every exercise a planted wrong kernel fails "right" with
a shrunk counterexample, and planted slow or unsafe ones fail "fast" or "safe" naming what to fix; a failing launch
is a verdict naming the kernel's line, and "safe" looks also at the sizes where "right" failed; the first kernel
page's kernels match the operator and count as the page says."""

import os
import re

import numpy as np
import pytest
from numba import cuda, float32

import cacheattn
from cacheattn import exercises, lab
from cacheattn.exercises import _shuffle, first_kernel, mistakes, skeletons, solutions

pytestmark = pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1",
                                reason="the checks count in numba's CUDA simulator")

KERNELS = {1: "copy_head", 2: "tile_scores", 3: "online_softmax", 4: "gather_pages", 5: "dequantize_int8",
           6: "gqa_values", 7: "combine_splits", 8: "warp_sum", 9: "unpack_halves", 11: "warp_scores",
           12: "split_partials"}
# The planted slow or unsafe kernels of each exercise, the verdict each must fail, a word of the fix it must name,
# and whether it is right all the same (exercise 8's unsafe kernel races, so its outputs vary from run to run;
# exercise 9's reads a row past the end, which NumPy refuses: wrong too).
PLANTED = [(1, "_slow", "fast", "lane pick the dimension", True), (2, "_slow", "fast", "rows of 33 words", True),
           (3, "_slow", "fast", "exp(old maximum - new maximum)", True),
           (4, "_unsafe", "safe", "out_of_bounds on k_cache", True),
           (5, "_slow", "fast", "lane on the dimension", True),
           (6, "_slow", "fast", "each value row once", True), (7, "_slow", "fast", "running maximum", True),
           (8, "_slow", "fast", "cuda.shfl_xor_sync(0xFFFFFFFF, v, offset)", True),
           (8, "_unsafe", "safe", "race on buf", None), (9, "_slow", "fast", "one load16(k[t], 8 * j)", True),
           (9, "_unsafe", "safe", "out_of_bounds on k at mistakes.py", False),
           (11, "_slow", "fast", "lane pick the dimension d of key j", True),
           (11, "_unsafe", "safe", "race on buf", None), (12, "_slow", "fast", "read each score once", True),
           (12, "_unsafe", "safe", "out_of_bounds on scores at mistakes.py", False)]


def test_twelve_exercises_each_with_skeleton_solution_and_plants():
    assert sorted(exercises.EXERCISES) == list(range(1, 13))
    for n, name in {**KERNELS, 10: "c_position"}.items():
        assert exercises.EXERCISES[n].skeleton is getattr(skeletons, name)
        assert f"Exercise {n}" in exercises.show(n) and "def " + name in exercises.show(n)
        assert callable(getattr(solutions, name)) and callable(getattr(mistakes, name + "_wrong"))
    assert "checked for right only" in exercises.show(10)


@pytest.mark.parametrize("n", sorted(KERNELS))
def test_solution_passes_all_three(n):
    result = exercises.check(n, getattr(solutions, KERNELS[n]))
    assert result.passed, str(result)
    assert "3 of 3 verdicts pass" in str(result) and not result.hazards


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


@pytest.mark.parametrize("n, suffix, verdict, fix, right", PLANTED, ids=[f"{p[0]}{p[1]}" for p in PLANTED])
def test_planted_slow_or_unsafe_kernel_fails_with_the_fix(n, suffix, verdict, fix, right):
    result = exercises.check(n, getattr(mistakes, KERNELS[n] + suffix))
    failed = getattr(result, verdict)
    assert failed.status == "FAIL" and fix in failed.message, str(result)
    if right is not None:
        assert result.right.passed == right, str(result)


def test_mma_fragment_position_is_checked_for_right_only():
    from kernels_numba import _mma

    assert all(solutions.c_position(lane, e) == _mma.c_position(lane, e) for lane in range(32) for e in range(4))
    good = exercises.check(10, solutions.c_position)
    assert good.passed and good.fast.status == good.safe.status == "n/a" and "1 of 1 verdicts pass" in str(good)
    wrong = exercises.check(10, mistakes.c_position_wrong)
    assert not wrong.passed and "c_position_wrong(0, 1) is (8, 0), the layout has (0, 1)" in wrong.right.message
    assert "64 of 128 positions differ" in wrong.right.message
    skeleton = exercises.check(10, skeletons.c_position)
    assert not skeleton.right.passed and "127 of 128" in skeleton.right.message


def test_missing_barrier_is_a_race_and_the_skeleton_is_not_right():
    result = exercises.check(2, mistakes.tile_scores_unsafe)
    assert not result.safe.passed and "race on tile" in result.safe.message
    assert "cuda.syncthreads()" in result.safe.message
    race = next(h for h in result.hazards if h.kind == "race")
    assert race.sources == ("tile[j, lane] = k[j, lane]", "s += q[d] * tile[lane, d]")    # in source order
    skeleton = exercises.check(1, skeletons.copy_head)
    assert not skeleton.right.passed and "outputs start as NaN" in skeleton.right.message
    assert not skeleton.fast.passed and "nothing to count" in skeleton.fast.message


@cuda.jit
def online_softmax_unguarded(scores, values, out):
    r = cuda.threadIdx.x
    keys, rows = scores.shape
    m = float32(-np.inf)
    total = float32(0)
    acc = float32(0)
    for t in range(keys):
        s = scores[t, r]
        if s > m:
            total *= np.exp(m - s)
            acc *= np.exp(m - s)
            m = s
        p = np.exp(s - m)
        total += p
        acc += p * values[t, r]
    out[r] = acc / total


def test_safe_looks_where_right_failed_and_names_the_line():
    # Without `if r < rows`, the default sizes (rows = 32 = the lanes) run clean; the least sizes read past the row.
    result = exercises.check(3, online_softmax_unguarded)
    line = "test_exercises.py:"
    assert result.counterexample == {"keys": 1, "rows": 1}
    assert "raised IndexError at " + line in result.right.message
    assert "(`s = scores[t, r]`)" in result.right.message
    assert result.fast.passed                                   # the default sizes ran: their counts stand
    assert result.safe.status == "FAIL" and "out_of_bounds on scores at " + line in result.safe.message
    assert "(`s = scores[t, r]`)" in result.safe.message and "first at keys=1, rows=1" in result.safe.message


def test_a_kernel_that_raises_is_a_verdict_not_an_error():
    @cuda.jit
    def reads_past_the_end(k_cache, head, out):
        lane = cuda.threadIdx.x
        out[0, lane] = k_cache[out.shape[0] + 5, head, lane]

    result = exercises.check(1, reads_past_the_end)
    assert not result.right.passed and "raised IndexError at test_exercises.py:" in result.right.message
    assert result.fast.status == "not run" and "failed" in result.fast.message
    assert not result.safe.passed and "out_of_bounds on k_cache" in result.safe.message


def test_a_failed_launch_leaves_fast_and_safe_not_run():
    @cuda.jit
    def calls_what_is_not_there(k_cache, head, out):
        out[0, cuda.threadIdx.x] = cuda.no_such_function(head)

    result = exercises.check(1, calls_what_is_not_there)
    assert "raised AttributeError at test_exercises.py:" in result.right.message
    assert "(`out[0, cuda.threadIdx.x] = cuda.no_such_function(head)`)" in result.right.message
    for verdict in (result.fast, result.safe):
        assert verdict.status == "not run" and not verdict.passed and "AttributeError" in verdict.message
    assert not result.passed and "0 of 3 verdicts pass" in str(result) and "not run" in str(result)


def test_another_exercises_kernel_gets_a_verdict():
    # Other parameters: not launched, and said so.
    result = exercises.check(4, skeletons.online_softmax)
    assert "is it another exercise's kernel?" in result.right.message and "(scores, values, out)" in \
        result.right.message
    assert result.fast.status == result.safe.status == "not run" and not result.passed
    # The same number of parameters: launched, and it fails where it fails.
    result = exercises.check(3, solutions.copy_head)
    assert result.right.status == "FAIL" and "raised ValueError at solutions.py:" in result.right.message
    assert result.fast.status == "not run"


def test_a_shuffle_not_every_lane_reaches_is_a_verdict(monkeypatch):
    monkeypatch.setattr(_shuffle, "WAIT_S", 5.0)

    @cuda.jit
    def half_warp(x, out):
        lane = cuda.threadIdx.x
        v = x[cuda.blockIdx.x, lane]
        if lane < 16:
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 1)
        out[cuda.blockIdx.x, lane] = v

    result = exercises.check(8, half_warp)
    # The lanes named are those that had ended when the shuffle gave up waiting: some of 16-31, never one that shuffles.
    named = re.search(r"lanes \[([\d, ]+)\] of warp 0 ended without reaching this shuffle", result.right.message)
    assert named, result.right.message
    assert {int(lane) for lane in named.group(1).split(",")} <= set(range(16, 32))
    assert result.fast.status == "not run"


def test_bad_use_of_check_is_a_clear_error():
    with pytest.raises(ValueError, match="n must be one of the exercises"):
        exercises.check(13, solutions.copy_head)
    with pytest.raises(TypeError, match="n must be an exercise number"):
        exercises.check("1", solutions.copy_head)
    with pytest.raises(TypeError, match="kernel must be a numba.cuda.jit kernel.*decorate it with @cuda.jit"):
        exercises.check(1, solutions.copy_head.py_func)
    with pytest.raises(TypeError, match="kernel must be a numba.cuda.jit kernel.*got NoneType"):
        exercises.check(1, None)
    with pytest.raises(TypeError, match="got the device function"):
        exercises.check(1, cuda.jit(device=True)(solutions.copy_head.py_func))
    with pytest.raises(TypeError, match="exercise 10 takes a plain Python function of .lane, e.*got a numba"):
        exercises.check(10, solutions.copy_head)
    with pytest.raises(TypeError, match="exercise 10 takes a plain Python function.*got NoneType"):
        exercises.check(10, None)
    for seed in ("x", 1.5, -1, True):
        with pytest.raises(TypeError, match="seed must be a non-negative int"):
            exercises.check(11, solutions.warp_scores, seed=seed)
    with pytest.raises(TypeError, match="seed must be a non-negative int.*got 1.5"):
        exercises.inputs(12, seed=1.5)
    with pytest.raises(ValueError, match="sizes must be ints at least"):
        exercises.inputs(1, tokens=0)
    with pytest.raises(ValueError, match="sizes of exercise 1 are"):
        exercises.inputs(1, heads=2)
    with pytest.raises(ValueError, match="sizes must be at most"):
        exercises.inputs(2, keys=33)


def test_a_function_that_raises_or_returns_nonsense_is_a_verdict():
    raised = exercises.check(10, lambda lane, e: (lane // 0, e))
    assert "<lambda>(0, 0) raised ZeroDivisionError at test_exercises.py:" in raised.right.message
    nonsense = exercises.check(10, lambda lane, e: "row")
    assert "<lambda>(0, 0) returned 'row': expected a (row, col) pair of ints" in nonsense.right.message
    assert not raised.passed and not nonsense.passed


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


def test_the_rung_exercises_answer_other_kernels_with_verdicts():
    # Another exercise's kernel with other parameters: not launched, and said so.
    result = exercises.check(12, solutions.warp_scores)
    assert "is it another exercise's kernel?" in result.right.message and "(q, k, scores)" in result.right.message
    assert result.fast.status == result.safe.status == "not run"
    # Exercise 2's tile kernel has exercise 11's parameters: it launches, and its 32-row tile fails at 40 keys.
    result = exercises.check(11, solutions.tile_scores)
    assert result.right.status == "FAIL" and "raised IndexError at solutions.py:" in result.right.message
    assert result.fast.status == "not run" and not result.passed
    # Exercise 11's kernel is right for exercise 2, but has no tile whose conflicts exercise 2 counts.
    result = exercises.check(2, solutions.warp_scores)
    assert result.right.passed and result.safe.passed
    assert result.fast.status == "FAIL" and "nothing to count" in result.fast.message
    # Not kernels at all: a clear TypeError before anything runs.
    with pytest.raises(TypeError, match="exercise 12's parameters .scores, values, partial_out.*got str"):
        exercises.check(12, "split_partials")
    with pytest.raises(TypeError, match="decorate it with @cuda.jit"):
        exercises.check(11, solutions.warp_scores.py_func)


def test_a_rung_exercise_kernel_that_fails_at_launch_is_a_verdict():
    @cuda.jit
    def split_partials(scores, values, partial_out, partial_max, partial_sum):
        c, h = cuda.blockIdx.x, cuda.blockIdx.y
        partial_max[c, h] = cuda.no_such_function(scores[h, 0])

    result = exercises.check(12, split_partials)
    assert "raised AttributeError at test_exercises.py:" in result.right.message
    assert result.fast.status == result.safe.status == "not run" and "0 of 3 verdicts pass" in str(result)


def test_an_empty_splits_maximum_agrees_only_with_minus_infinity():
    exercise = exercises.EXERCISES[12]
    x = exercises.inputs(12)                                 # 10 keys in 8 splits of 2: splits 5, 6 and 7 are empty
    expected = exercise.reference(x)
    assert np.isneginf(expected["partial_max"][5:]).all() and (expected["partial_sum"][5:] == 0).all()
    for name in exercise.outputs:
        x[name][...] = expected[name]
    assert exercises._difference(exercise, x) is None
    x["partial_max"][6, 1] = 0                               # an empty split that claims a maximum
    assert exercises._difference(exercise, x).startswith("partial_max[6, 1] is 0, the reference -inf")

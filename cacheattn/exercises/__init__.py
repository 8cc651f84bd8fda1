"""Exercises in writing cache-attention kernels, each checked in numba's CUDA simulator.

Each exercise (`EXERCISES`, from `book`) is a kernel skeleton (`skeletons`) with one idea left out: coalesced loads,
a padded shared tile, online softmax, the page lookup, int8 dequantization, GQA sharing, a split-K combine.
`show(n)` prints an exercise and its skeleton; `check(n, kernel)` runs your `numba.cuda.jit` kernel on the
exercise's inputs under `cacheattn.lab.record()` and gives three verdicts:

- right: its outputs (NaN before the launch) against a float64 reference, at the outputs' dtype's tolerance; when
  wrong, the smallest failing sizes found and the first element that differs;
- fast: the counts the exercise is about (sectors per request, bank conflicts, load requests) against its target;
- safe: races, uninitialized shared reads and out-of-bounds indices.

`solutions` passes every check; `first_kernel` is the whole decode kernel of docs/first-kernel.md.
"""

from __future__ import annotations

import inspect
import textwrap
import warnings
from dataclasses import dataclass

import numpy as np

from .book import EXERCISES, Exercise

__all__ = ["EXERCISES", "Exercise", "Result", "Verdict", "check", "inputs", "show"]

# |got - expected| <= atol + rtol |expected|, by the output's dtype: float32 sums of a few dozen terms of O(1).
TOLERANCE = {np.dtype(np.float32): (1e-5, 1e-5), np.dtype(np.float16): (2e-3, 2e-3)}
SHRINK_RUNS = 12        # the most launches spent looking for a smaller failing input
OTHER_SIZES = 3         # sizes tried beside the default before a kernel is right

HAZARD_FIX = {
    "race": "two threads touch one shared word between two barriers, one of them writing: put a "
            "cuda.syncthreads() between the writes and the reads of other threads' words",
    "uninitialized": "a shared word is read before any thread wrote it: write it first, or read only what was "
                     "written",
    "out_of_bounds": "an index outside its array (a GPU reads some other memory; NumPy wraps negative ones): "
                     "guard the access or compute the index right",
}


@dataclass
class Verdict:
    """One of a check's three verdicts: passed, and what to look at."""
    name: str
    passed: bool
    message: str

    def __str__(self):
        return f"{self.name:<5}  {'ok  ' if self.passed else 'FAIL'}  {self.message}"


@dataclass
class Result:
    """What `check` found: the right, fast and safe verdicts (`passed` when all three pass), and when it is not
    right, the sizes of the smallest failing input found (`exercises.inputs(n, seed=seed, **counterexample)`)."""
    exercise: Exercise
    right: Verdict
    fast: Verdict
    safe: Verdict
    counterexample: dict | None = None

    @property
    def passed(self) -> bool:
        return self.right.passed and self.fast.passed and self.safe.passed

    def __str__(self):
        verdicts = (self.right, self.fast, self.safe)
        head = (f"exercise {self.exercise.number}, {self.exercise.title}: "
                f"{sum(v.passed for v in verdicts)} of 3 verdicts pass")
        return "\n".join([head] + [textwrap.indent(str(v), "  ") for v in verdicts])


def _exercise(n) -> Exercise:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"n must be an exercise number, an int; got {type(n).__name__}")
    if int(n) not in EXERCISES:
        raise ValueError(f"n must be one of the exercises {sorted(EXERCISES)}; got {n}")
    return EXERCISES[int(n)]


def inputs(n: int, seed: int = 0, **sizes) -> dict:
    """Exercise n's inputs (outputs included, as NaN) at its default sizes, or the `sizes` given; `check` prints
    the sizes of a failing input, and this call makes it again."""
    exercise = _exercise(n)
    unknown = set(sizes) - set(exercise.sizes)
    if unknown:
        raise ValueError(f"sizes of exercise {n} are {list(exercise.sizes)}; got {sorted(unknown)}")
    chosen = {**exercise.sizes, **sizes}
    small = {k: v for k, v in chosen.items() if not isinstance(v, int) or v < exercise.smallest[k]}
    if small:
        raise ValueError(f"sizes must be ints at least {exercise.smallest}; got {small}")
    large = {k: v for k, v in chosen.items() if v > exercise.largest.get(k, v)}
    if large:
        raise ValueError(f"sizes must be at most {exercise.largest}; got {large}")
    return exercise.make(chosen, np.random.default_rng(seed))


def show(n: int) -> str:
    """Exercise n as text: its idea, task, inputs, reference, launch and targets, then the skeleton's source."""
    e = _exercise(n)
    source = textwrap.dedent(inspect.getsource(e.skeleton.py_func))
    lines = [f"Exercise {e.number}: {e.title}", "", e.idea, "", f"task:      {e.task}",
             f"inputs:    {e.inputs_text}",
             f"sizes:     {_sizes_text(e.sizes)}; then the least, and {OTHER_SIZES - 1} drawn in between",
             f"reference: {e.reference_text}, in float64; float32 outputs within 1e-5 + 1e-5 x |reference|",
             f"launch:    {e.launch}",
             f"targets:   {'; '.join(f'{t.what} at most {t.limit(e.sizes)}' for t in e.targets)}",
             "", "@cuda.jit", source.split("\n", 1)[1].rstrip()]
    return "\n".join(lines)


def _is_kernel(kernel) -> bool:
    # numba.cuda.jit gives a dispatcher on a GPU and a FakeCUDAKernel in the simulator: both launch as
    # kernel[grid, block](...) and keep the Python function as py_func.
    return callable(getattr(type(kernel), "__getitem__", None)) and callable(getattr(kernel, "py_func", None))


def _launch(exercise, kernel, x):
    """Run the kernel on the inputs x; the exception it raised, or None."""
    try:
        # 0/0 and overflows are the kernel's business, not warnings; the simulator's threads do not see np.errstate
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            exercise.launch_kernel(kernel, x)
    except Exception as exc:                           # the learner's kernel failing is a verdict, not our error
        return exc
    return None


def _difference(exercise, x) -> str | None:
    """Where the outputs of x differ from the float64 reference, or None when they agree."""
    expected = exercise.reference(x)
    for name in exercise.outputs:
        got, want = x[name], expected[name]
        rtol, atol = TOLERANCE[got.dtype]
        bad = ~(np.abs(got.astype(np.float64) - want) <= atol + rtol * np.abs(want))
        if bad.any():
            i = tuple(int(j) for j in np.argwhere(bad)[0])
            where = f"{name}[{', '.join(map(str, i))}]"
            why = " (outputs start as NaN: was it written?)" if np.isnan(got[i]) else ""
            return (f"{where} is {got[i]:.4g}{why}, the reference {want[i]:.4g}; "
                    f"{int(bad.sum())} of {bad.size} elements differ")
    return None


def _failure(exercise, kernel, sizes, seed) -> str | None:
    x = exercise.make(sizes, np.random.default_rng(seed))
    error = _launch(exercise, kernel, x)
    if error is not None:
        return f"the kernel raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return _difference(exercise, x)


def _shrink(exercise, kernel, sizes, failure, seed):
    """Smaller sizes that still fail, one size at a time (its least value, half, one less), within SHRINK_RUNS
    launches: the smallest failing input found."""
    runs = 0
    changed = True
    while changed and runs < SHRINK_RUNS:
        changed = False
        for name, least in exercise.smallest.items():
            for smaller in sorted({least, sizes[name] // 2, sizes[name] - 1}):
                if not least <= smaller < sizes[name] or runs >= SHRINK_RUNS:
                    continue
                runs += 1
                trial = {**sizes, name: smaller}
                found = _failure(exercise, kernel, trial, seed)
                if found is not None:
                    sizes, failure, changed = trial, found, True
                    break
    return sizes, failure


def _other_sizes(exercise, seed) -> list:
    """The least sizes, then OTHER_SIZES - 1 drawn between the least and the default (fixed by the seed)."""
    rng = np.random.default_rng(seed + 1)
    draws = [dict(exercise.smallest)]
    for _ in range(OTHER_SIZES - 1):
        draws.append({k: int(rng.integers(least, exercise.sizes[k] + 1)) for k, least in exercise.smallest.items()})
    return draws


def _sizes_text(sizes) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items())


def check(n: int, kernel, *, seed: int = 0) -> Result:
    """Run `kernel` (a numba.cuda.jit kernel with exercise n's signature) on the exercise's inputs in numba's CUDA
    simulator under `cacheattn.lab.record()`, and say whether it is right, fast and safe (see the module's
    docstring). Never raises on a wrong kernel; raises ValueError for an unknown n, TypeError for a kernel that is
    not a numba.cuda.jit kernel, RuntimeError outside the simulator."""
    exercise = _exercise(n)
    if not _is_kernel(kernel):
        raise TypeError(f"kernel must be a numba.cuda.jit kernel (launched as kernel[grid, block](...)); "
                        f"got {type(kernel).__name__}")
    from .. import lab

    sizes = dict(exercise.sizes)
    x = exercise.make(sizes, np.random.default_rng(seed))
    with lab.record() as rec:
        error = _launch(exercise, kernel, x)

    if error is not None:
        failure = f"the kernel raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    else:
        failure = _difference(exercise, x)
    failing, small = sizes, None
    for other in _other_sizes(exercise, seed):          # a kernel right at one size only is not right
        if failure is not None:
            break
        failing, failure = other, _failure(exercise, kernel, other, seed)
    if failure is None:
        right = Verdict("right", True, f"matches the float64 reference at {_sizes_text(sizes)} and "
                                       f"{OTHER_SIZES} other sizes")
    else:
        small, failure = _shrink(exercise, kernel, failing, failure, seed)
        right = Verdict("right", False, f"at {_sizes_text(small)} (exercises.inputs({exercise.number}, "
                                        f"seed={seed}, {_sizes_text(small)})): {failure}")

    if error is not None:
        fast = Verdict("fast", False, "not counted: the launch failed")
    else:
        over, shown = [], []
        for target in exercise.targets:
            value, limit = target.measure(rec), target.limit(sizes)
            if value is None:
                over.append(f"{target.what}: nothing to count, the kernel does not make those accesses yet")
                continue
            shown.append(f"{target.what}: {value:g} (target at most {limit:g})")
            if value > limit:
                over.append(f"{target.what}: {value:g}, target at most {limit:g}: {target.fix}")
        fast = Verdict("fast", not over, "; ".join(over) if over else "; ".join(shown))

    if rec.hazards:
        found = [f"{h.kind} on {h.array} at {' and '.join(h.lines)} ({h.count} times): {HAZARD_FIX[h.kind]}"
                 for h in rec.hazards]
        safe = Verdict("safe", False, "; ".join(found))
    else:
        safe = Verdict("safe", True, "no races, uninitialized shared reads or out-of-bounds indices")
    return Result(exercise, right, fast, safe, small)

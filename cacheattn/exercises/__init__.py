"""Exercises in writing cache-attention kernels, each checked in numba's CUDA simulator.

Each exercise (`EXERCISES`, from `book`) is a kernel skeleton (`skeletons`) with one idea left out: coalesced loads,
a padded shared tile, online softmax, the page lookup, int8 dequantization, GQA sharing, a split-K combine, a warp
shuffle sum, unpacking a 16-byte chunk, a warp per key, split-K partials; exercise 10 (an mma fragment's position)
is a plain Python function.
`show(n)` prints an exercise and its skeleton; `check(n, kernel)` runs your `numba.cuda.jit` kernel on the
exercise's inputs under `cacheattn.lab.record()` and gives three verdicts:

- right: its outputs (NaN before the launch) against a float64 reference, at the outputs' dtype's tolerance; when
  wrong, the smallest failing sizes found and the first element that differs, or the exception and the kernel's
  line that raised it;
- fast: the counts the exercise is about (sectors per request, bank conflicts, load requests) against its target;
- safe: races, uninitialized shared reads and out-of-bounds indices, over every launch `check` made (the failing
  sizes included), each with its source line.

A verdict is "ok", "FAIL", "not run" (the launch failed: nothing to judge, and not a pass) or "n/a" (nothing of
the kind to judge: exercise 10's fast and safe). In the simulator, `cuda.shfl_xor_sync` works inside `check` and
inside `with shuffles():`.

`solutions` passes every check; `first_kernel` is the whole decode kernel of docs/first-kernel.md.
"""

from __future__ import annotations

import inspect
import operator
import os
import textwrap
import traceback
import warnings
from dataclasses import dataclass, field, replace

import numpy as np

from .book import EXERCISES, Exercise

__all__ = ["EXERCISES", "Exercise", "Result", "Verdict", "check", "inputs", "show", "shuffles"]

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
    """One of a check's three verdicts: its status and what to look at. status is "ok", "FAIL", "not run" (the
    launch failed or never happened, so there was nothing to judge: not a pass) or "n/a" (the exercise has nothing
    of the kind to judge: exercise 10's fast and safe); `passed` for "ok" and "n/a"."""
    name: str
    status: str
    message: str

    @property
    def passed(self) -> bool:
        return self.status in ("ok", "n/a")

    def __str__(self):
        return f"{self.name:<5}  {self.status:<4}  {self.message}"


@dataclass
class Result:
    """What `check` found: the right, fast and safe verdicts (`passed` when all three pass); when it is not right,
    the sizes of the smallest failing input found (`exercises.inputs(n, seed=seed, **counterexample)`); and the
    sanitizer's findings over every launch (`cacheattn.lab.Hazard`s, counts summed, a race's two lines in order)."""
    exercise: Exercise
    right: Verdict
    fast: Verdict
    safe: Verdict
    counterexample: dict | None = None
    hazards: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.right.passed and self.fast.passed and self.safe.passed

    def __str__(self):
        verdicts = (self.right, self.fast, self.safe)
        judged = [v for v in verdicts if v.status != "n/a"]
        head = (f"exercise {self.exercise.number}, {self.exercise.title}: "
                f"{sum(v.passed for v in judged)} of {len(judged)} verdicts pass")
        return "\n".join([head] + [textwrap.indent(str(v), "  ") for v in verdicts])


def shuffles():
    """A context manager: inside it, kernels run in numba's CUDA simulator can call `cuda.shfl_xor_sync`, which the
    simulator lacks (`check` does this itself; this is for your own launches). Each warp's lanes meet at every
    call, as on a GPU."""
    from ._shuffle import installed
    return installed()


def _exercise(n) -> Exercise:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"n must be an exercise number, an int; got {type(n).__name__}")
    if int(n) not in EXERCISES:
        raise ValueError(f"n must be one of the exercises {sorted(EXERCISES)}; got {n}")
    return EXERCISES[int(n)]


def _seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise TypeError(f"seed must be a non-negative int, the seed of the inputs' random numbers; got {seed!r}")
    return int(seed)


def inputs(n: int, seed: int = 0, **sizes) -> dict:
    """Exercise n's inputs (outputs included, as NaN) at its default sizes, or the `sizes` given; `check` prints
    the sizes of a failing input, and this call makes it again."""
    exercise = _exercise(n)
    seed = _seed(seed)
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
    if e.function:
        source = textwrap.dedent(inspect.getsource(e.skeleton)).rstrip()
        sizes = "none: every lane and element"
        reference = e.reference_text
        targets = "none: a plain Python function, checked for right only"
    else:
        source = "@cuda.jit\n" + textwrap.dedent(inspect.getsource(e.skeleton.py_func)).split("\n", 1)[1].rstrip()
        sizes = f"{_sizes_text(e.sizes)}; then the least, and {OTHER_SIZES - 1} drawn in between"
        reference = f"{e.reference_text}, in float64; float32 outputs within 1e-5 + 1e-5 x |reference|"
        targets = "; ".join(f"{t.what} at most {t.limit(e.sizes)}" for t in e.targets)
    lines = [f"Exercise {e.number}: {e.title}", "", e.idea, "", f"task:      {e.task}",
             f"inputs:    {e.inputs_text}", f"sizes:     {sizes}", f"reference: {reference}",
             f"launch:    {e.launch}", f"targets:   {targets}", "", source]
    return "\n".join(lines)


def _is_kernel(kernel) -> bool:
    # numba.cuda.jit gives a dispatcher on a GPU and a FakeCUDAKernel in the simulator: both launch as
    # kernel[grid, block](...) and keep the Python function as py_func.
    return callable(getattr(type(kernel), "__getitem__", None)) and callable(getattr(kernel, "py_func", None))


def _not_a_kernel(kernel) -> str | None:
    """Why `kernel` cannot be launched as an exercise's kernel, or None."""
    if _is_kernel(kernel):
        if getattr(kernel, "_device", False):
            return f"got the device function {_name(kernel)}: a kernel is @cuda.jit without device=True"
        return None
    if inspect.isfunction(kernel):
        return f"got the plain Python function {kernel.__name__}: decorate it with @cuda.jit"
    return f"got {type(kernel).__name__}"


def _name(f) -> str:
    return getattr(getattr(f, "py_func", f), "__name__", type(f).__name__)


def _parameters_mismatch(exercise, kernel) -> str | None:
    """Why the kernel cannot take the exercise's arguments (another exercise's kernel, say), or None."""
    try:
        parameters = list(inspect.signature(kernel.py_func).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind in (p.VAR_POSITIONAL, p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in parameters):
        return f"{_name(kernel)} has a *args or keyword-only parameter: a kernel's parameters are positional"
    if len(parameters) == len(exercise.args):
        return None
    return (f"{_name(kernel)} takes {len(parameters)} parameters ({', '.join(p.name for p in parameters)}), but "
            f"exercise {exercise.number}'s kernel takes {len(exercise.args)} ({', '.join(exercise.args)}): is it "
            f"another exercise's kernel? exercises.show({exercise.number}) shows the skeleton")


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


_LIBRARY = tuple(os.path.dirname(m.__file__) + os.sep for m in (np, inspect))      # NumPy, the standard library


def _where(error, code) -> str:
    """" at file.py:line (`the line`)" for the deepest line of `code`'s file in the error's traceback (the learner's
    kernel or function); failing that, the deepest line outside the libraries; "" when there is none."""
    from ..lab.recorder import source_line

    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if f.filename == code.co_filename]
    if not ours:
        import numba
        from numba import cuda
        here = os.path.dirname(__file__)
        skip = _LIBRARY + tuple(os.path.dirname(path) + os.sep for path in (numba.__file__, cuda.__file__)) + \
            (here + os.sep, os.path.join(os.path.dirname(here), "lab") + os.sep)
        ours = [f for f in frames if not f.filename.startswith(skip)]
    if not ours:
        return ""
    label, text = source_line(ours[-1].filename, ours[-1].lineno)
    return f" at {label} (`{text}`)" if text else f" at {label}"


def _raised(error, f) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    code = getattr(getattr(f, "py_func", f), "__code__", None)
    where = _where(error, code) if code is not None else ""
    return f"the kernel raised {type(error).__name__}{where}: {text}"


def _difference(exercise, x) -> str | None:
    """Where the outputs of x differ from the float64 reference, or None when they agree."""
    expected = exercise.reference(x)
    for name in exercise.outputs:
        got, want = x[name], expected[name]
        rtol, atol = TOLERANCE[got.dtype]
        with np.errstate(invalid="ignore"):         # inf - inf is NaN
            close = np.abs(got.astype(np.float64) - want) <= atol + rtol * np.abs(want)
        # an infinity (an empty split's maximum) agrees only with itself: its tolerance would be infinite
        bad = ~np.where(np.isinf(want), got == want, close)
        if bad.any():
            i = tuple(int(j) for j in np.argwhere(bad)[0])
            where = f"{name}[{', '.join(map(str, i))}]"
            why = " (outputs start as NaN: was it written?)" if np.isnan(got[i]) else ""
            return (f"{where} is {got[i]:.4g}{why}, the reference {want[i]:.4g}; "
                    f"{int(bad.sum())} of {bad.size} elements differ")
    return None


def _run(exercise, kernel, sizes, seed):
    """One recorded launch at `sizes`: (what is wrong with its outputs or None, the error it raised or None, the
    recording)."""
    from .. import lab

    x = exercise.make(sizes, np.random.default_rng(seed))
    with lab.record() as rec:
        error = _launch(exercise, kernel, x)
    failure = _raised(error, kernel) if error is not None else _difference(exercise, x)
    return failure, error, rec


def _shrink(exercise, kernel, sizes, failure, seed, runs):
    """Smaller sizes that still fail, one size at a time (its least value, half, one less), within SHRINK_RUNS
    launches: the smallest failing input found. Every launch's (sizes, recording) joins `runs`."""
    count = 0
    changed = True
    while changed and count < SHRINK_RUNS:
        changed = False
        for name, least in exercise.smallest.items():
            for smaller in sorted({least, sizes[name] // 2, sizes[name] - 1}):
                if not least <= smaller < sizes[name] or count >= SHRINK_RUNS:
                    continue
                count += 1
                trial = {**sizes, name: smaller}
                found, _, rec = _run(exercise, kernel, trial, seed)
                runs.append((trial, rec))
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


_KINDS = ("out_of_bounds", "race", "uninitialized")


def _findings(runs) -> list:
    """The hazards of every run, one per (kind, array, lines), counts summed, with the sizes of the first run that
    found each; a race's two sites in source order (which ran first varies from run to run)."""
    found = {}
    for sizes, rec in runs:
        for h in rec.hazards:
            pairs = sorted(zip(h.lines, h.sources or ("",) * len(h.lines)),
                           key=lambda p: (p[0].rsplit(":", 1)[0], int(p[0].rsplit(":", 1)[1])))
            key = (h.kind, h.array, tuple(line for line, _ in pairs))
            if key in found:
                found[key][0].count += h.count
            else:
                found[key] = (replace(h, lines=key[2], sources=tuple(text for _, text in pairs)), sizes)
    return sorted(found.values(), key=lambda f: (_KINDS.index(f[0].kind), f[0].array, f[0].lines))


def _hazard_text(h, sizes) -> str:
    sites = " and ".join(f"{line} (`{text}`)" if text else line for line, text in zip(h.lines, h.sources))
    return (f"{h.kind} on {h.array} at {sites}, {h.count} times, first at {_sizes_text(sizes)}: "
            f"{HAZARD_FIX[h.kind]}")


def _check_function(exercise, f) -> Result:
    """Exercise 10 and its kind: a plain Python function of (lane, e), against the reference at every pair."""
    if f is None or not callable(f) or _is_kernel(f):
        what = "a numba.cuda.jit kernel" if _is_kernel(f) else type(f).__name__
        raise TypeError(f"exercise {exercise.number} takes a plain Python function of ({', '.join(exercise.args)}), "
                        f"as exercises.show({exercise.number}) shows, not a kernel; got {what}")
    expected = exercise.reference({})[exercise.outputs[0]]
    first, wrong = None, 0
    for lane, e in np.ndindex(*expected.shape[:2]):
        want = tuple(int(v) for v in expected[lane, e])
        try:
            got = f(lane, e)
        except Exception as exc:                      # the learner's function failing is a verdict
            text = _raised(exc, f).replace("the kernel raised", f"{_name(f)}({lane}, {e}) raised")
            right = Verdict("right", "FAIL", text)
            break
        try:
            pair = tuple(operator.index(v) for v in got)
        except TypeError:
            pair = None
        if pair is None or len(pair) != 2:
            right = Verdict("right", "FAIL", f"{_name(f)}({lane}, {e}) returned {got!r}: expected a (row, col) "
                                             "pair of ints")
            break
        if pair != want:
            wrong += 1
            first = first or (lane, e, pair, want)
    else:
        if first is None:
            right = Verdict("right", "ok", f"matches the fragment layout at all {expected.shape[0]} lanes and "
                                           f"{expected.shape[1]} elements")
        else:
            lane, e, pair, want = first
            right = Verdict("right", "FAIL", f"{_name(f)}({lane}, {e}) is {pair}, the layout has {want}; {wrong} "
                                             f"of {expected.shape[0] * expected.shape[1]} positions differ")
    why = "a plain Python function: nothing is launched, so there is nothing to"
    return Result(exercise, right, Verdict("fast", "n/a", f"{why} count"), Verdict("safe", "n/a", f"{why} check"))


def check(n: int, kernel, *, seed: int = 0) -> Result:
    """Run `kernel` (a numba.cuda.jit kernel with exercise n's signature) on the exercise's inputs in numba's CUDA
    simulator under `cacheattn.lab.record()`, and say whether it is right, fast and safe (see the module's
    docstring). Exercise 10 takes a plain Python function instead, and is checked for right only.

    Never raises on a wrong kernel: one that raises, takes another exercise's parameters or fails to launch gets a
    "right" FAIL naming the line, and "fast" and "safe" say "not run" where there was nothing to judge. Raises
    ValueError for an unknown n, TypeError for something that is not a numba.cuda.jit kernel (a plain function,
    None; exercise 10: something that is not a plain function) or a seed that is not a non-negative int,
    RuntimeError outside the simulator."""
    exercise = _exercise(n)
    seed = _seed(seed)
    if exercise.function:
        return _check_function(exercise, kernel)
    why = _not_a_kernel(kernel)
    if why is not None:
        raise TypeError(f"kernel must be a numba.cuda.jit kernel (launched as kernel[grid, block](...)) with exercise "
                        f"{exercise.number}'s parameters ({', '.join(exercise.args)}); {why}")
    mismatch = _parameters_mismatch(exercise, kernel)
    if mismatch is not None:
        not_run = "the kernel was not launched: its parameters are not the exercise's (see right)"
        return Result(exercise, Verdict("right", "FAIL", mismatch), Verdict("fast", "not run", not_run),
                      Verdict("safe", "not run", not_run))

    sizes = dict(exercise.sizes)
    failure, error, rec = _run(exercise, kernel, sizes, seed)
    runs = [(sizes, rec)]
    failing, small = sizes, None
    for other in _other_sizes(exercise, seed):          # a kernel right at one size only is not right
        if failure is not None:
            break
        failing = other
        failure, _, other_rec = _run(exercise, kernel, other, seed)
        runs.append((other, other_rec))
    if failure is None:
        right = Verdict("right", "ok", f"matches the float64 reference at {_sizes_text(sizes)} and "
                                       f"{OTHER_SIZES} other sizes")
    else:
        small, failure = _shrink(exercise, kernel, failing, failure, seed, runs)
        right = Verdict("right", "FAIL", f"at {_sizes_text(small)} (exercises.inputs({exercise.number}, "
                                         f"seed={seed}, {_sizes_text(small)})): {failure}")

    if error is not None:
        fast = Verdict("fast", "not run", f"the launch at {_sizes_text(sizes)} failed ({type(error).__name__}, see "
                                          "right): its counts are not the kernel's")
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
        fast = Verdict("fast", "FAIL" if over else "ok", "; ".join(over) if over else "; ".join(shown))

    findings = _findings(runs)
    if findings:
        safe = Verdict("safe", "FAIL", "; ".join(_hazard_text(h, at) for h, at in findings))
    elif error is not None:
        safe = Verdict("safe", "not run", f"the launch at {_sizes_text(sizes)} failed ({type(error).__name__}, see "
                                          "right) before its accesses could all be checked")
    else:
        safe = Verdict("safe", "ok", "no races, uninitialized shared reads or out-of-bounds indices")
    return Result(exercise, right, fast, safe, small, [h for h, _ in findings])

"""python -m cacheattn gpu-session --out DIR: everything a GPU session should run, in one command.

It is built for a GPU that is borrowed for a short time: commands of at most 10 minutes each, and a folder of
results of at most 8 files. So the session runs its steps in order, each under its own time limit and all
under one budget (`--budget-s`, default 570 s, inside one 10-minute command); a step that fails or runs out
of time is recorded and the next one starts; a step the budget no longer fits is skipped and named, so the
next command can run it with `--steps`. DIR receives at most seven files:

  summary.md, summary.json   every step's status, time and findings (pytest counts, sanitizer error counts),
                             the environment record and the bench tables
  bench.md, bench.json       `python -m cacheattn bench` (timings against ceilings and peers)
  host.md, host.json         `python -m cacheattn bench --host` (host overhead per decode call)
  logs.tar.gz                every step's full output

The steps (`--dry-run` lists them with their commands and runs nothing):
  env            GPU, driver, CUDA, compute-sanitizer and package versions (numba, numba-cuda, cupy, torch, ...)
  gpu-tests      CACHEATTN_TEST_GPU=1 pytest -x -q -m gpu
  bench, host    the benchmark harness and the host-overhead table
  memcheck, racecheck, initcheck, synccheck
                 compute-sanitizer over the GPU-marked tests (a few small calls of every operator, so each
                 tool stays under 3 minutes). Python runs under the tool as any program does:
                 `compute-sanitizer --tool T --target-processes all --print-limit 20 python -m pytest ...`
                 (`--target-processes all`: pytest's child processes are checked too). CuPy's memory pool is
                 switched off for these runs (CACHEATTN_CUPY_POOL=0, read by tests/conftest.py): memcheck sees
                 allocations, and a pooled buffer is a piece of a larger one, so a stray write would land in
                 memory the tool counts as valid. tests/test_guard_bands.py covers what a pool hides.
  kernel-tests   the kernel tests on CuPy arrays (CACHEATTN_TEST_GPU=1, 4 pytest workers)
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

BUDGET_S = 570              # one device command may run 600 s
RESERVE_S = 15              # kept back for the summary and the log archive
SANITIZERS = ("memcheck", "racecheck", "initcheck", "synccheck")
# What the sanitizers run: the GPU-marked tests (a handful of small calls of every operator) and the guard-band
# test, whose drawn calls reach every operator's kernels with arrays that end exactly where a bad index would land.
SANITIZED_TESTS = ("tests/test_gpu.py", "tests/test_guard_bands.py", "tests/test_mma.py",
                   "tests/test_ppl_kernels.py::test_cupy_arrays_dispatch_to_kernels_and_come_back_as_cupy",
                   "tests/test_ft_properties.py::test_cupy_in_cupy_out_on_the_callers_stream",
                   "tests/test_torch.py::test_multi_head_cache_attention_cuda_tensors_run_the_kernels_in_place")
KERNEL_TESTS = ("tests/test_ppl_kernels.py", "tests/test_onnx_properties.py", "tests/test_ft_properties.py",
                "tests/test_trtllm_kernels.py", "tests/test_guard_bands.py")
PACKAGES = ("numpy", "numba", "numba-cuda", "cupy-cuda13x", "cupy-cuda12x", "cupy", "torch", "flashinfer-python",
            "flashinfer", "hypothesis", "pytest", "onnx", "onnxruntime")


@dataclass(frozen=True)
class Step:
    name: str
    command: tuple              # argv; "{work}" is replaced by the session's working folder
    timeout_s: int
    env: dict = field(default_factory=dict)
    parse: Callable[[str, Path], dict] | None = None        # (log text, working folder) -> findings
    needs: str | None = None    # an executable that must be on PATH, else the step is skipped
    verdict: Callable[[int, dict], bool] | None = None      # (exit code, findings) -> passed; default rc == 0


# ---------------------------------------------------------------------------------------------- parsers

_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?)")
_PYTEST_END = re.compile(r" in [\d.]+s( \([\d:]+\))?\s*=*\s*$")


def parse_pytest(text: str, work: Path | None = None) -> dict:
    """Counts from pytest's last summary line ("3 passed, 1 skipped in 2.31s", with or without the === banner);
    {"summary": None} when pytest never got there (killed, crashed, did not start)."""
    lines = [line for line in text.splitlines()
             if _PYTEST_END.search(line) and (_PYTEST_COUNT.search(line) or "no tests ran" in line)]
    if not lines:
        return {"summary": None}
    last = lines[-1].strip("= ")
    counts = {}
    for number, word in _PYTEST_COUNT.findall(last):
        key = {"error": "errors", "warning": "warnings"}.get(word, word)
        counts[key] = counts.get(key, 0) + int(number)
    return {"summary": last, **counts}


_ERROR_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
_RACECHECK_SUMMARY = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")


def parse_sanitizer(text: str, work: Path | None = None) -> dict:
    """compute-sanitizer's findings in a log: the sum of every "ERROR SUMMARY: N errors" line (one per checked
    process), racecheck's hazards and warnings, the first reports, and pytest's counts. errors is None when no
    summary line came (the tool refused the device, or was killed): that is no evidence of a clean run."""
    errors = [int(n) for n in _ERROR_SUMMARY.findall(text)]
    races = [tuple(int(n) for n in m) for m in _RACECHECK_SUMMARY.findall(text)]
    found = {"errors": sum(errors) if errors else None, "processes": len(errors)}
    if races:
        found.update(hazards=sum(r[0] for r in races), race_errors=sum(r[1] for r in races),
                     race_warnings=sum(r[2] for r in races))
        if found["errors"] is None:
            found["errors"] = found["race_errors"]
    reports = [line.strip("= ").strip() for line in text.splitlines()
               if line.startswith("=========") and re.search(r"Invalid|Race|hazard|Uninitialized|Barrier|Error:",
                                                                line)]
    found["first_reports"] = reports[:5]
    found["pytest"] = parse_pytest(text)
    return found


def sanitizer_clean(rc: int, found: dict) -> bool:
    """Clean only with a summary saying 0 errors (and no racecheck warnings) and pytest passing: a target that
    crashed can still leave "0 errors" behind, so pytest's own verdict counts too."""
    test = found["pytest"]
    return (found["errors"] == 0 and found.get("race_warnings", 0) == 0 and test.get("summary") is not None
            and not test.get("failed") and not test.get("errors"))


def parse_env(text: str, work: Path | None = None) -> dict:
    """The env step prints one JSON object as its last line."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {}


def _bench_files(*names):
    def parse(text: str, work: Path) -> dict:
        path = work / names[0]
        if not path.exists():
            return {"written": False}
        data = json.loads(path.read_text())
        return {"written": True, "rows": len(data.get("rows", []))}
    return parse


# ---------------------------------------------------------------------------------------------- environment

def environment() -> dict:
    """What the figures ran on: GPU, driver, CUDA toolkit and runtime, tool and package versions."""
    def first_line(argv):
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"unavailable ({type(exc).__name__})"
        lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.strip()]
        return lines[-1].strip() if lines else f"no output (exit {done.returncode})"

    record = {"python": sys.version.split()[0], "executable": sys.executable,
              "gpu": first_line(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap,"
                                 "clocks.max.sm,clocks.max.mem", "--format=csv,noheader"]),
              "nvcc": first_line(["nvcc", "--version"]),
              "compute_sanitizer": first_line(["compute-sanitizer", "--version"])}
    packages = {}
    for name in PACKAGES:
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    record["packages"] = packages
    try:
        import cupy
        runtime = cupy.cuda.runtime
        record.update(cuda_runtime=runtime.runtimeGetVersion(), cuda_driver=runtime.driverGetVersion())
    except Exception as exc:            # no CuPy, or no device: recorded, not fatal
        record["cupy_error"] = f"{type(exc).__name__}: {exc}"
    return record


# ---------------------------------------------------------------------------------------------- the steps

def default_steps(python: str = sys.executable) -> list[Step]:
    """The session's steps in the order they run (most wanted first: the bench table, then the sanitizers)."""
    gpu = {"CACHEATTN_TEST_GPU": "1"}
    pytest = (python, "-m", "pytest", "-q", "-p", "no:cacheprovider")
    steps = [
        Step("env", (python, "-m", "cacheattn", "gpu-session", "--env"), 60, parse=parse_env),
        Step("gpu-tests", (*pytest, "-x", "-m", "gpu or hardware", "tests"), 240, gpu, parse_pytest),
        Step("bench", (python, "-m", "cacheattn", "bench", "--out", "{work}"), 300,
             parse=_bench_files("bench.json")),
        Step("host", (python, "-m", "cacheattn", "bench", "--host", "--out", "{work}"), 120,
             parse=_bench_files("host.json")),
    ]
    for tool in SANITIZERS:
        steps.append(Step(tool, ("compute-sanitizer", "--tool", tool, "--target-processes", "all", "--print-limit",
                                 "20", *pytest, *SANITIZED_TESTS), 180, {**gpu, "CACHEATTN_CUPY_POOL": "0"},
                          parse_sanitizer, needs="compute-sanitizer", verdict=sanitizer_clean))
    steps.append(Step("kernel-tests", (*pytest, "-n", "4", *KERNEL_TESTS), 480, gpu, parse_pytest))
    return steps


def select(steps: list[Step], names: str | None) -> list[Step]:
    if not names:
        return steps
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = {s.name for s in steps}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise ValueError(f"--steps: unknown {', '.join(unknown)}; expected some of {', '.join(sorted(known))}")
    return [s for s in steps if s.name in wanted]


def describe(steps: list[Step], budget_s: int = BUDGET_S) -> str:
    """The dry run: each step with its limit, environment and command."""
    lines = [f"gpu-session: {len(steps)} steps in order, {budget_s} s in all (each step: its own limit or what "
             "the budget has left)"]
    for i, s in enumerate(steps, 1):
        env = " ".join(f"{k}={v}" for k, v in s.env.items())
        lines.append(f"{i}. {s.name} (limit {s.timeout_s} s): {env + ' ' if env else ''}{shlex.join(s.command)}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- running

def _run_one(step: Step, work: Path, limit: float) -> dict:
    log_path = work / f"{step.name}.log"
    command = [a.replace("{work}", str(work)) for a in step.command]
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}     # real GPU, not the simulator
    env.update(PYTHONUNBUFFERED="1", **step.env)
    start = time.monotonic()
    status = None
    with log_path.open("w") as log:
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        try:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        except OSError as exc:
            log.write(f"could not start: {exc}\n")
            return {"status": "error", "seconds": 0.0, "rc": None, "findings": {"error": str(exc)}}
        try:
            rc = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)        # the tool and every python under it
            rc = process.wait()
            status = "timeout"
    seconds = time.monotonic() - start
    text = log_path.read_text(errors="replace")
    findings = step.parse(text, work) if step.parse else {}
    if status is None:
        passed = step.verdict(rc, findings) if step.verdict else rc == 0
        status = "passed" if passed else "failed"
    return {"status": status, "seconds": round(seconds, 1), "rc": rc, "findings": findings}


def run_session(steps: list[Step], out_dir: Path | str, *, budget_s: float = BUDGET_S, report=print) -> dict:
    """Run the steps in order, never stopping at a failure; write DIR's files (module docstring)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + budget_s
    results = {}
    with tempfile.TemporaryDirectory(prefix="gpu-session-") as tmp:
        work = Path(tmp)
        for step in steps:
            left = deadline - time.monotonic() - RESERVE_S
            if step.needs and shutil.which(step.needs) is None:
                results[step.name] = {"status": "skipped", "why": f"{step.needs} not found on PATH"}
            elif left < 10:
                results[step.name] = {"status": "skipped", "why": "budget spent: run it with --steps next time"}
            else:
                results[step.name] = _run_one(step, work, min(step.timeout_s, left))
            report(f"{step.name}: {_line(results[step.name])}")
        for name in ("bench.json", "bench.md", "host.json", "host.md"):
            if (work / name).exists():
                shutil.copy(work / name, out / name)
        with tarfile.open(out / "logs.tar.gz", "w:gz") as archive:
            for log in sorted(work.glob("*.log")):
                archive.add(log, arcname=log.name)
    summary = {"steps": results, "environment": results.get("env", {}).get("findings", {}),
               "budget_s": budget_s}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(summary_markdown(summary, out))
    return summary


def _line(result: dict) -> str:
    status = result["status"]
    if status == "skipped":
        return f"skipped ({result['why']})"
    detail = _detail(result)
    return f"{status} in {result['seconds']} s" + (f": {detail}" if detail else "")


def _detail(result: dict) -> str:
    """What a step found, in a few words: pytest's summary, sanitizer errors, bench rows, the GPU."""
    if result["status"] == "skipped":
        return result["why"]
    found = result.get("findings", {})
    detail = []
    if "errors" in found:
        detail.append(f"sanitizer errors {found['errors'] if found['errors'] is not None else 'no summary'}")
        found = found["pytest"]
    if found.get("summary"):
        detail.append(found["summary"])
    elif "summary" in found:
        detail.append("no pytest summary")
    if "rows" in found:
        detail.append(f"{found['rows']} rows")
    if "gpu" in found:
        detail.append(found["gpu"])
    return "; ".join(detail)


def summary_markdown(summary: dict, out: Path) -> str:
    lines = ["# GPU session", "", "| step | result |", "|---|---|"]
    lines += [f"| {name} | {_line(r)} |" for name, r in summary["steps"].items()]
    env = summary["environment"]
    if env:
        lines += ["", "## Environment", "", "```json", json.dumps(env, indent=2), "```"]
    for name, title in (("bench.md", "Bench"), ("host.md", "Host overhead")):
        if (out / name).exists():
            lines += ["", f"## {title}", "", (out / name).read_text()]
    return "\n".join(lines) + "\n"


def gpu_session(out_dir: str, *, steps: str | None = None, budget_s: float = BUDGET_S, dry_run: bool = False,
                env_only: bool = False) -> int:
    """The CLI: `--env` prints the environment record; `--dry-run` lists the steps; else runs them."""
    if env_only:
        print(json.dumps(environment()))
        return 0
    from .. import _console

    chosen = select(default_steps(), steps)
    if dry_run:
        if _console.current_format() == "text":         # one numbered line per step, commands as a shell takes them
            _console.say(describe(chosen, int(budget_s)), wrap=False)
        else:
            _console.table(f"gpu-session: {len(chosen)} steps in order, {budget_s:g} s in all",
                           (_console.Column("step"), _console.Column("limit s", "limit_s", right=True),
                            _console.Column("env", show=lambda env: " ".join(f"{k}={v}" for k, v in env.items())),
                            _console.Column("command", show=shlex.join)),
                           [(s.name, s.timeout_s, s.env, s.command) for s in chosen])
        return 0
    summary = run_session(chosen, out_dir, budget_s=budget_s, report=_console.say)
    show_summary(summary, Path(out_dir))
    return 0 if all(r["status"] in ("passed", "skipped") for r in summary["steps"].values()) else 1


def show_summary(summary: dict, out: Path) -> None:
    """The session on the console: one row per step, then the bench tables the session brought back."""
    from .. import _console

    _console.table(f"GPU session ({out / 'summary.md'} holds it all, with the environment record)",
                   (_console.Column("step"), _console.Column("status"),
                    _console.Column("s", "seconds", lambda s: "" if s is None else f"{s}", right=True,
                                    means="seconds"),
                    _console.Column("found", "detail", means="pytest's summary, sanitizer errors, bench rows")),
                   [(name, r["status"], r.get("seconds"), _detail(r)) for name, r in summary["steps"].items()])
    if (out / "bench.json").exists():
        from .bench_gpu import tables
        for table in tables(json.loads((out / "bench.json").read_text())):
            _console.print_table(table)
    if (out / "host.json").exists():
        from .bench_host import tables
        host = json.loads((out / "host.json").read_text())
        for table in tables(host["rows"], host["where"]):
            _console.print_table(table)

"""`python -m cacheattn gpu-session` without a GPU: the step list, each step's parser on captured-format text, and
the orchestration (time limits, failures that do not stop the session, the budget, the files it leaves)."""

import json
import sys
import tarfile

from cacheattn.__main__ import main
from cacheattn.lab.gpu_session import (
    RESERVE_S,
    SANITIZERS,
    Step,
    default_steps,
    describe,
    parse_pytest,
    parse_sanitizer,
    run_session,
    sanitizer_clean,
    select,
)


def test_dry_run_lists_every_step_in_order_with_its_command(capsys):
    assert main(["gpu-session", "--dry-run"]) == 0
    out = capsys.readouterr().out
    order = ["env", "gpu-tests", "bench", "host", *SANITIZERS, "kernel-tests"]
    assert [s.name for s in default_steps()] == order
    positions = [out.index(f". {name} (limit") for name in order]
    assert positions == sorted(positions)
    assert "CACHEATTN_TEST_GPU=1" in out and "-x -m 'gpu or hardware' tests" in out and "bench --host" in out
    for tool in SANITIZERS:
        assert f"compute-sanitizer --tool {tool} --target-processes all" in out
    assert "run nothing" not in out and "budget" in out
    chosen = select(default_steps("python"), "memcheck,env")
    assert [s.name for s in chosen] == ["env", "memcheck"]          # the session's order, not the option's
    assert describe(chosen).count("\n") == 2


PYTEST_SAMPLES = {
    "============ 3 passed, 1 skipped in 2.31s ============": {"passed": 3, "skipped": 1},
    "1 failed, 2 passed, 1 warning in 3.00s": {"failed": 1, "passed": 2, "warnings": 1},
    "== 4 passed, 2 errors in 125.03s (0:02:05) ==": {"passed": 4, "errors": 2},
    "no tests ran in 0.01s": {},
}


def test_pytest_summary_parser():
    for line, counts in PYTEST_SAMPLES.items():
        found = parse_pytest(f"collected 4 items\n....F\nFAILED tests/x.py::t - boom\n{line}\n")
        assert {k: v for k, v in found.items() if k != "summary"} == counts, line
        assert found["summary"] == line.strip("= ")
    assert parse_pytest("....\nSegmentation fault (core dumped)\n") == {"summary": None}


# Captured-format samples, written from compute-sanitizer's documented output (every line of the tool starts
# with "========="; one ERROR SUMMARY per checked process; racecheck adds its own summary).
MEMCHECK_CLEAN = """========= COMPUTE-SANITIZER
....
4 passed in 40.12s
========= ERROR SUMMARY: 0 errors
"""
MEMCHECK_TWO_PROCESSES = """========= COMPUTE-SANITIZER
========= Invalid __global__ write of size 2 bytes
=========     at attention_kernel+0x1b30
=========     by thread (5,0,0) in block (0,1,0)
=========     Address 0x7f3a0000a000 is out of bounds
1 failed, 3 passed in 41.50s
========= ERROR SUMMARY: 0 errors
========= ERROR SUMMARY: 3 errors
"""
RACECHECK_HAZARD = """========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at store_kernel+0x3c0
=========     and Read access at store_kernel+0x2f0 [64 hazards]
4 passed in 88.00s
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""
RACECHECK_CLEAN = """4 passed in 60.00s
========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)
"""
REFUSED = """========= COMPUTE-SANITIZER
========= Error: Device not supported. Please refer to the "Supported Devices" section of the sanitizer documentation
"""
CRASHED = """========= COMPUTE-SANITIZER
Fatal Python error: Segmentation fault
========= ERROR SUMMARY: 0 errors
"""


def test_sanitizer_parser_and_verdict():
    clean = parse_sanitizer(MEMCHECK_CLEAN)
    assert clean["errors"] == 0 and clean["processes"] == 1 and clean["pytest"]["passed"] == 4
    assert sanitizer_clean(0, clean)
    two = parse_sanitizer(MEMCHECK_TWO_PROCESSES)
    assert two["errors"] == 3 and two["processes"] == 2
    assert two["first_reports"][0] == "Invalid __global__ write of size 2 bytes" and not sanitizer_clean(0, two)
    race = parse_sanitizer(RACECHECK_HAZARD)
    assert (race["hazards"], race["race_errors"], race["race_warnings"], race["errors"]) == (1, 1, 0, 1)
    assert race["first_reports"][0].startswith("Error: Race reported") and not sanitizer_clean(0, race)
    assert sanitizer_clean(0, parse_sanitizer(RACECHECK_CLEAN))
    refused = parse_sanitizer(REFUSED)
    assert refused["errors"] is None and not sanitizer_clean(1, refused)     # no summary is no evidence
    crashed = parse_sanitizer(CRASHED)
    assert crashed["errors"] == 0 and not sanitizer_clean(0, crashed)       # "0 errors", but pytest never ended


def python(code):
    return (sys.executable, "-c", code)


def test_session_runs_on_after_failures_and_timeouts(tmp_path):
    steps = [
        Step("fails", python("import sys; print('1 failed in 0.01s'); sys.exit(3)"), 30, parse=parse_pytest),
        Step("hangs", python("import time; time.sleep(60)"), 1),
        Step("missing-tool", ("no-such-tool",), 30, needs="no-such-tool"),
        Step("env-var", python("import os, sys; sys.exit(os.environ['STEP_FLAG'] != 'on')"), 30, {"STEP_FLAG": "on"}),
        Step("writes-bench", python("import sys, pathlib; pathlib.Path(sys.argv[1], 'bench.md').write_text('| t |')")
             + ("{work}",), 30),
    ]
    summary = run_session(steps, tmp_path / "out", budget_s=120, report=lambda *_: None)
    status = {name: r["status"] for name, r in summary["steps"].items()}
    assert status == {"fails": "failed", "hangs": "timeout", "missing-tool": "skipped", "env-var": "passed",
                      "writes-bench": "passed"}
    assert summary["steps"]["fails"]["findings"]["failed"] == 1 and summary["steps"]["hangs"]["seconds"] < 10
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["bench.md", "logs.tar.gz", "summary.json", "summary.md"]
    assert json.loads((out / "summary.json").read_text())["steps"]["env-var"]["rc"] == 0
    with tarfile.open(out / "logs.tar.gz") as archive:
        assert sorted(archive.getnames()) == ["env-var.log", "fails.log", "hangs.log", "writes-bench.log"]
    text = (out / "summary.md").read_text()
    assert "| fails | failed" in text and "1 failed in 0.01s" in text and "| t |" in text


def test_steps_past_the_budget_are_skipped_by_name(tmp_path):
    summary = run_session([Step("late", python("pass"), 30)], tmp_path, budget_s=RESERVE_S + 5,
                          report=lambda *_: None)
    assert summary["steps"]["late"] == {"status": "skipped", "why": "budget spent: run it with --steps next time"}

"""python -m cacheattn {tour, docs, conformance, bench, gpu-session, hf, lab} [--format text|markdown|json]; --version.

Without a GPU the kernels run in numba's CUDA simulator; that has to be chosen before numba
is imported, so this module decides it first and imports the rest afterwards.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path


def gpu_present() -> bool:
    """A CUDA driver with at least one device, asked directly (numba's mode depends on the answer)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return driver.cuInit(0) == 0 and driver.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("cacheattn")
    except PackageNotFoundError:            # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The command line: every subcommand, its options and their help."""
    from . import _console

    parser = argparse.ArgumentParser(prog="python -m cacheattn", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"cacheattn {_version()}")
    # Every subcommand that prints tables takes --format; files are written only where --out names a folder.
    form = argparse.ArgumentParser(add_help=False)
    form.add_argument("--format", choices=_console.FORMATS, default="text",
                      help="text (default: every column whole at the terminal's width, or 80 piped), markdown, or "
                      "json (one document: every table's rows and the notes)")
    sub = parser.add_subparsers(dest="command", required=True)
    tour = sub.add_parser("tour", parents=[form], help="run every operator on the reference and the kernels; print "
                          "errors vs float64")
    size = tour.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer requests, the first configuration of each operator")
    size.add_argument("--full", action="store_true", help="two layers and the shapes the labels name (slow without "
                      "a GPU)")
    tour.add_argument("--backend", choices=("both", "reference", "numba"), default="both")
    tour.add_argument("--cache", choices=("int8", "int4", "float32"), default="int8",
                      help="the serving loop's OpenPPL paged cache format")
    docs_help = ("run the read-and-run pages in docs/ and check their shown outputs (about two minutes on 2 "
                 "cores, the kernels in the simulator; a progress bar on a terminal)")
    docs = sub.add_parser("docs", parents=[form], help=docs_help, description=docs_help)
    docs.add_argument("--update", action="store_true", help="rewrite the pages' outputs with what the code prints")
    docs.add_argument("pages", nargs="*", type=Path, help="pages to run (default: docs/*.md)")
    conf_help = ("run the onnx node test cases for Attention; print the table (both backends: about 7 minutes on "
                 "2 cores without a GPU, the kernels in the simulator; a progress bar on a terminal)")
    conf = sub.add_parser("conformance", parents=[form], help=conf_help, description=conf_help)
    conf.add_argument("--backend", choices=("reference", "numba", "both"), default="both",
                      help="reference: seconds; numba or both: the kernels, about 7 minutes in the simulator")
    bench = sub.add_parser("bench", parents=[form], help="time the kernels against peers measured in the same run "
                           "(GPU)")
    bench.add_argument("--repeat", type=int, default=20)
    bench.add_argument("--cpu", action="store_true", help="the NumPy references against onnx's evaluator, then "
                       "every reference at serving shapes, instead")
    bench.add_argument("--tiny", action="store_true", help="the GPU harness in the simulator on tiny shapes")
    bench.add_argument("--host", action="store_true", help="host time, launches and kernel parameters per decode "
                       "call, launches recorded instead of run (CPU figures without a GPU)")
    bench.add_argument("--hf", action="store_true", help="the engine (cacheattn.hf) on each operator against "
                       "transformers' eager attention, time per decode step of a random Llama (needs the hf extra)")
    bench.add_argument("--batch", type=int, default=64, help="--host: requests per decode call (default 64)")
    bench.add_argument("--out", help="folder to write bench.json and bench.md (--host: host.json and host.md) "
                       "into; without it nothing is written")
    session = sub.add_parser("gpu-session", parents=[form], help="on a GPU machine: environment, GPU tests, bench, "
                             "compute-sanitizer and kernel tests in one command, each under a time limit; a summary "
                             "in --out")
    session.add_argument("--out", help="folder for the summary, bench tables and logs (needed to run the steps)")
    session.add_argument("--steps", help="comma-separated subset, in the session's order (see --dry-run)")
    session.add_argument("--budget-s", type=float, default=570, help="seconds for all steps (default 570: inside "
                         "a 10-minute limit on one command)")
    session.add_argument("--dry-run", action="store_true", help="list the steps and their commands; run nothing")
    session.add_argument("--env", action="store_true", help="print the environment record (JSON) and stop")
    from .hf.cli import add_parser as add_hf  # torch-free: the command says so if the hf extra is missing
    add_hf(sub, parents=[form])
    lab_help = ("counters and lower bounds of every kernel-ladder rung per bench case, counted in the simulator "
                "(about 8 minutes on 2 idle cores, more under load; --quick: under a minute; a progress bar on a "
                "terminal) (--sanitize: race / initcheck / memcheck over every kernel family, about two minutes)")
    lab = sub.add_parser("lab", parents=[form], help=lab_help, description=lab_help)
    lab.add_argument("--sanitize", action="store_true", help="one representative call of every kernel family under "
                     "the recorder, a table row each; ends with the number of findings")
    lab.add_argument("--full", action="store_true", help="with --sanitize: more cases per family (slow)")
    lab.add_argument("--case", action="append", choices=LAB_CASES,
                     help="a bench case to count (repeatable; default: all of them)")
    lab.add_argument("--write", type=Path, help="also write the whole result as JSON to this file (the ladder page "
                     "reads docs/kernel-ladder-counts.json)")
    lab.add_argument("--rung", action="append", type=int, choices=range(1, 7),
                     help="a rung to count (repeatable; default: every rung the case offers)")
    lab.add_argument("--update", type=Path, metavar="JSON", help="put what this run counts in place of the same "
                     "cases and rungs in that written file, make its derivations again and write it back (after a "
                     "kernel change: recount the rungs it touched, keep the rest)")
    lab.add_argument("--rederive", type=Path, metavar="JSON", help="count nothing: make that file's derived ratios "
                     "and bounds again from its full-launch figures, and write it back (after a change to the bound "
                     "model or to docs/kernel-ladder-sass.json)")
    lab.add_argument("--jobs", type=int, help="processes counting side by side (default: 2 where there are 2 cores)")
    lab.add_argument("--quick", action="store_true", help="the float16 decode alone at head_dim 64, counted at 64 "
                     "and 128 keys (the test suite runs it)")
    return parser


# The lab's bench cases by their command-line names (cacheattn.lab.counters.CASE_NAMES, which needs the kernels to
# import; a test keeps the two the same).
LAB_CASES = ("decode", "decode-int8", "decode-int4", "decode-32k", "prefill-4k", "trtllm-decode", "trtllm-decode-int8",
             "trtllm-decode-fp8", "trtllm-context", "onnx-decode", "ft-cross")


def main(argv=None) -> int:
    from . import _console

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "gpu-session" and args.out is None and not (args.dry_run or args.env):
        parser.error("gpu-session: --out DIR is needed (the session leaves its summary, tables and logs there)")
    # `gpu-session --env` prints its JSON record as is (the session's env step reads it back).
    with _console.output("text" if args.command == "gpu-session" and args.env else args.format):
        return _run(args)


def _run(args) -> int:
    from . import _console

    if args.command == "gpu-session":       # decides nothing about the simulator: its steps are processes
        from .lab.gpu_session import gpu_session
        return gpu_session(args.out, steps=args.steps, budget_s=args.budget_s, dry_run=args.dry_run,
                           env_only=args.env)

    if not gpu_present():
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        _console.say("No CUDA GPU here: kernels run in numba's CUDA simulator (slow, small shapes).")
        _console.say()

    if args.command == "tour":
        from .tour import tour
        backends = ("reference", "numba") if args.backend == "both" else (args.backend,)
        return tour(quick=args.quick, full=args.full, backends=backends,
                    cache_bits={"int8": 8, "int4": 4, "float32": 0}[args.cache])
    if args.command == "docs":
        from . import _docs
        pages = args.pages or _docs.pages(Path.cwd())
        if args.update:
            with _console.progress(sum(_docs.count_blocks(page) for page in pages), "docs blocks") as step:
                rewritten = [(str(page), _docs.update(page, on_block=step)) for page in pages]
            _console.table(None, ("page", "blocks rewritten"), rewritten, right=("blocks rewritten",))
            return 0
        with _console.progress(sum(_docs.count_blocks(page) for page in pages), "docs blocks") as step:
            checked = [(page, _docs.check(page, on_block=step)) for page in pages]
        _console.table(None, ("page", "result"), [(str(page), f"{len(problems)} blocks differ" if problems else "ok")
                                                  for page, problems in checked])
        for _, problems in checked:
            for p in problems:
                _console.say(p, wrap=False)         # a diff of printed text: shown as printed
        return 1 if any(problems for _, problems in checked) else 0
    if args.command == "conformance":
        from .onnx_conformance import conformance
        backends = ("reference", "numba") if args.backend == "both" else (args.backend,)
        return 1 if conformance(backends) else 0
    if args.command == "hf":
        from .hf.cli import run
        return run(args)
    if args.command == "bench" and args.hf:
        from .hf.cli import require_extra
        require_extra()
        from .hf.bench import bench_hf
        bench_hf(tiny=args.tiny, rounds=max(1, min(args.repeat, 20) // 10))
        return 0
    if args.command == "lab":
        if gpu_present():
            _console.say("python -m cacheattn lab counts in numba's CUDA simulator: run it with NUMBA_ENABLE_CUDASIM=1")
            return 2
        if args.sanitize:
            from .lab.sanitize import sanitize
            return 1 if sanitize(full=args.full) else 0
        from .lab.counters import main as counters
        return counters(quick=args.quick, cases=args.case, rungs=args.rung, jobs=args.jobs, write=args.write,
                        rederive_file=args.rederive, update=args.update)
    if args.command == "bench" and args.cpu:
        from .lab.bench_cpu import bench_cpu
        from .lab.bench_reference import bench_reference
        status = bench_cpu(repeat=args.repeat)
        print()
        bench_reference(repeat=max(3, args.repeat // 3))
        return status
    if args.command == "bench" and args.host:
        from .lab.bench_host import host_overhead
        host_overhead(gpu=gpu_present(), repeat=args.repeat, batch=args.batch, out_dir=args.out)
        return 0
    if args.command == "bench":
        from .lab.bench import bench
        return bench(repeat=args.repeat, tiny=args.tiny, out_dir=args.out)
    return 2


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:                 # `... | head`: the reader has gone; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)

"""python -m cacheattn hf: serve a model through an operator and compare every request with transformers.

A family name (random weights, seeded) or a local checkpoint directory; prompts as token ids ("3,14,15") or
text (with the checkpoint's tokenizer). Prints per request the tokens, whether they are transformers' greedy
tokens, the largest logit error (relative to max(1, |logit|)) and the time per token of each side.
A mistake on the command line (a missing directory, text for a family, a token id outside the vocabulary, an
engine option that does not exist) prints one line, `error: ...`, saying what to pass instead, and exits with
status 2; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
import time

from .. import _console
from .models import compare, hf_generate, load, logit_bound

DEFAULT_PROMPTS = ("3,14,15,9,2,6", "6,5,35,8,9,7,9,3,2", "38,4")


# Files one of which a checkpoint directory holds when it carries a tokenizer (fast, sentencepiece, BPE, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "vocab.txt")
# What a user can get wrong on the command line: reported as one line, exit status 2. Anything else is a bug and
# keeps its traceback.
USER_ERRORS = (ValueError, TypeError, FileNotFoundError)


def parse_prompts(texts, path_or_family):
    """Token ids ("3,14,15" or "3 14 15") as they are; anything else through the checkpoint's tokenizer."""
    from pathlib import Path
    prompts = []
    tokenizer = None
    for text in texts:
        parts = text.replace(",", " ").split()
        if parts and all(p.lstrip("-").isdigit() for p in parts):
            prompts.append([int(p) for p in parts])
            continue
        if tokenizer is None:
            directory = Path(path_or_family)
            if not directory.is_dir():
                raise ValueError(f"--prompt {text!r}: text needs a checkpoint directory with a tokenizer; a family "
                                 f"({path_or_family}) takes token ids, e.g. --prompt 3,14,15")
            if not any((directory / name).is_file() for name in TOKENIZER_FILES):
                raise FileNotFoundError(f"--prompt {text!r}: text needs the checkpoint's tokenizer, and "
                                        f"{path_or_family} has none ({', '.join(TOKENIZER_FILES)}); pass token ids "
                                        f"instead, e.g. --prompt 3,14,15")
            from transformers import AutoTokenizer
            try:
                tokenizer = AutoTokenizer.from_pretrained(path_or_family, local_files_only=True)
            except (OSError, ValueError, ImportError) as error:
                reason = " ".join(str(error).split())
                raise ValueError(f"--prompt {text!r}: the tokenizer in {path_or_family} does not load ({reason}); "
                                 f"pass token ids instead, e.g. --prompt 3,14,15") from error
        ids = tokenizer(text)["input_ids"]
        if not ids:
            raise ValueError(f"--prompt {text!r}: the checkpoint's tokenizer gives no tokens for it")
        prompts.append(ids)
    return prompts


def parse_arrivals(text, count):
    """--arrivals "0,0,2" -> [0, 0, 2]; None -> None."""
    if text is None:
        return None
    parts = text.replace(",", " ").split()
    if not all(p.isdigit() for p in parts):
        raise ValueError(f"--arrivals: expected one step >= 0 per prompt, like '0,0,2', got {text!r}")
    if len(parts) != count:
        raise ValueError(f"--arrivals: expected one step per prompt ({count}), got {len(parts)} in {text!r}")
    return [int(p) for p in parts]


def agreement_rows(res, want, kv_cache_dtype="float32", num_layers=1, times=None):
    """Per request: tokens, agreement with transformers, max logit error, and (times given) ms per token of the
    engine and of transformers. float32 must be identical within 1e-4; other formats within logit_bound."""
    bound = 1e-4 if kv_cache_dtype == "float32" else logit_bound(kv_cache_dtype, num_layers)
    rows = []
    for i, (tokens, logits) in enumerate(want):
        same, agreement, err = compare(res.tokens[i], res.logits[i], tokens, logits)
        shown = " ".join(map(str, res.tokens[i]))
        shown = shown if len(shown) <= 24 else shown[:21] + "..."
        row = [i, shown, "identical" if same else f"{agreement:.0%}", "yes" if err <= bound else f"NO ({err:.1e})"]
        if times is not None:
            ms, hf_ms = times[i]
            row += [f"{ms:.1f}", f"{hf_ms:.1f}"]
        rows.append(row)
    return rows, bound


def require_extra() -> None:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as missing:
        raise SystemExit(f"this command needs the hf extra (torch, transformers): pip install -e '.[hf]' "
                         f"({missing})") from None


# Engine's parameter names as this command's options, for its messages.
OPTIONS = {"prompts": "--prompt", "max_new_tokens": "--max-new-tokens", "arrivals": "--arrivals",
           "operator": "--operator", "cache": "--cache", "kv_cache_dtype": "--kv-cache-dtype", "backend": "--backend",
           "page_size": "--page-size", "quant_group": "--quant-group"}


def command_line_message(error) -> str:
    """The error on one line, a leading Engine parameter name given as the option that sets it."""
    text = " ".join(str(error).split())
    name, colon, rest = text.partition(":")
    return f"{OPTIONS[name]}:{rest}" if colon and name in OPTIONS else text


def prepare(args):
    """(model, prompts, arrivals, engine) from the command line, every argument checked; raises USER_ERRORS."""
    from .engine import Engine
    if args.layers is not None and args.layers < 1:
        raise ValueError(f"--layers: expected >= 1, got {args.layers}")
    model = load(args.model, seed=args.seed, **({} if args.layers is None else {"layers": args.layers}))
    prompts = parse_prompts(args.prompt or DEFAULT_PROMPTS, args.model)
    arrivals = parse_arrivals(args.arrivals, len(prompts))
    with _console.status("loading the engine"):
        engine = Engine(model, operator=args.operator, cache=args.cache, kv_cache_dtype=args.kv_cache_dtype,
                        page_size=args.page_size, quant_group=args.quant_group, backend=args.backend)
    engine.check_requests(prompts, args.max_new_tokens, arrivals)
    return model, prompts, arrivals, engine


def run(args) -> int:
    require_extra()
    import torch

    torch.set_num_threads(max(1, args.threads))
    try:
        model, prompts, arrivals, engine = prepare(args)
    except USER_ERRORS as error:
        print(f"error: {command_line_message(error)}", file=sys.stderr)
        return 2
    with _console.progress(len(prompts) + max(arrivals or [0]) + args.max_new_tokens, "engine steps") as step:
        res = engine.generate(prompts, args.max_new_tokens, arrivals=arrivals, on_step=lambda s, d: step(d))
    want, hf_ms = [], []
    with _console.progress(len(prompts), "transformers generate") as step:
        for p in prompts:
            start = time.perf_counter()
            want.append(hf_generate(model, p, args.max_new_tokens))
            hf_ms.append((time.perf_counter() - start) * 1e3 / args.max_new_tokens)
            step()
    times = [(res.request_seconds[i] * 1e3 / args.max_new_tokens, hf_ms[i]) for i in range(len(prompts))]
    rows, bound = agreement_rows(res, want, engine.kv_cache_dtype, len(engine.layers), times)
    title = f"{type(model).__name__}, {engine.operator} ({engine.cache}, {engine.kv_cache_dtype}, {args.backend})"
    _console.table(title, ["req", "new tokens", "vs transformers", f"err <= {bound:.0e}", "ms/tok", "hf ms/tok"],
                   rows, right=("req", "ms/tok", "hf ms/tok"))
    _console.say(f"{res.steps} engine steps in {res.seconds:.2f} s. ms/tok: the time of the steps a request\n"
                 "took part in (shared with its batch) over its tokens; hf: transformers alone.")
    ok = all(r[3] == "yes" for r in rows) and (engine.kv_cache_dtype != "float32" or all(r[2] == "identical"
                                                                                         for r in rows))
    return 0 if ok else 1


def add_parser(sub, parents=()) -> None:
    from .engine import OPERATORS
    from .models import FAMILIES
    p = sub.add_parser("hf", parents=list(parents), help="serve a transformers model (family or local checkpoint) "
                       "through an operator; compare every request with transformers' greedy generate")
    p.add_argument("model", nargs="?", default="llama", help=f"a family ({', '.join(sorted(FAMILIES))}) with random "
                   "weights, or a local checkpoint directory (default: llama)")
    p.add_argument("--prompt", action="append", help="token ids ('3,14,15') or text (checkpoint tokenizer); "
                   "repeat for more requests")
    p.add_argument("--operator", choices=OPERATORS, default="multi_head_cache_attention")
    p.add_argument("--cache", help="paged / offset (OpenPPL), paged / contiguous (gpt_attention), contiguous (ONNX)")
    p.add_argument("--kv-cache-dtype", help="float16, bfloat16, int8, int4, fp8 (as the operator has them)")
    p.add_argument("--backend", choices=("reference", "numba", "auto"), default="reference")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--quant-group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--arrivals", help="the step each prompt joins at, e.g. '0,0,2' (default: all at 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, help="layers of a random-weight family (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the tiny models gain nothing)")


__all__ = ["add_parser", "agreement_rows", "parse_arrivals", "parse_prompts", "prepare", "run"]

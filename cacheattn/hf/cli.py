"""python -m cacheattn hf: serve a model through an operator and compare every request with transformers.

A family name (random weights, seeded) or a local checkpoint directory; prompts as token ids ("3,14,15") or
text (with the checkpoint's tokenizer). Prints per request the tokens, whether they are transformers' greedy
tokens, the largest logit error (relative to max(1, |logit|)) and the time per token of each side.
"""

from __future__ import annotations

import time

from .. import _console
from .models import compare, hf_generate, load, logit_bound

DEFAULT_PROMPTS = ("3,14,15,9,2,6", "6,5,35,8,9,7,9,3,2", "38,4")


def parse_prompts(texts, path_or_family):
    """Token ids ("3,14,15" or "3 14 15") as they are; anything else through the checkpoint's tokenizer."""
    prompts = []
    tokenizer = None
    for text in texts:
        parts = text.replace(",", " ").split()
        if parts and all(p.lstrip("-").isdigit() for p in parts):
            prompts.append([int(p) for p in parts])
            continue
        if tokenizer is None:
            from pathlib import Path
            if not Path(path_or_family).is_dir():
                raise SystemExit(f"prompt {text!r}: text needs a checkpoint directory with a tokenizer; a family "
                                 f"({path_or_family}) takes token ids")
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(path_or_family, local_files_only=True)
        prompts.append(tokenizer(text)["input_ids"])
    return prompts


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


def run(args) -> int:
    require_extra()
    import torch

    from .engine import Engine
    torch.set_num_threads(max(1, args.threads))
    model = load(args.model, seed=args.seed, **({} if args.layers is None else {"layers": args.layers}))
    prompts = parse_prompts(args.prompt or DEFAULT_PROMPTS, args.model)
    arrivals = [int(a) for a in args.arrivals.replace(",", " ").split()] if args.arrivals else None
    with _console.status("loading the engine"):
        engine = Engine(model, operator=args.operator, cache=args.cache, kv_cache_dtype=args.kv_cache_dtype,
                        page_size=args.page_size, quant_group=args.quant_group, backend=args.backend)
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


__all__ = ["add_parser", "agreement_rows", "run"]

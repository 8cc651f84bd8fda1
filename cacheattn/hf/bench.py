"""python -m cacheattn bench --hf: time per decode step of the engine on each operator (reference backend, float32
cache) against transformers' eager attention on the same model, measured side by side in one run.

The model: a random Llama, 4 layers, d_model 512, 8 heads of 64 with 2 kv heads; 8 requests with 512-token
prompts arrive together, then 32 decode steps. transformers runs the same batch with its own DynamicCache and
attn_implementation="eager" (a prefill of 8 x 512, then 32 steps of 8 x 1). The two sides alternate, round after
round, so load on a shared machine falls on both; each step's time is kept, and the table gives the median, the
spread (min - max over every step of every round) and the ratios of medians and of minima.
"""

from __future__ import annotations

import time

import numpy as np

from .. import _console

FULL = dict(layers=4, hidden=512, heads=8, kv_heads=2, requests=8, prompt=512, steps=32, vocab=32000)
TINY = dict(layers=1, hidden=32, heads=4, kv_heads=2, requests=2, prompt=8, steps=3, vocab=97)


def _model(shape, seed=0):
    import torch
    import transformers

    from .models import redraw_weights
    config = transformers.LlamaConfig(hidden_size=shape["hidden"], intermediate_size=4 * shape["hidden"],
                                      num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                                      num_key_value_heads=shape["kv_heads"], vocab_size=shape["vocab"],
                                      max_position_embeddings=4096, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    redraw_weights(model, seed)
    return model.eval()


def cache_keyword(model) -> str:
    """The name model.forward takes its KV cache by: `cache` in current transformers, `past_key_values` before
    (still accepted there with a FutureWarning)."""
    import inspect
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _transformers_eager(model, prompts, steps):
    """Decode-step seconds of transformers' own loop (eager attention, DynamicCache), greedy."""
    import torch
    from transformers import DynamicCache
    model.set_attn_implementation("eager")
    ids = torch.tensor(prompts)
    times = []
    with torch.no_grad():
        cache = {cache_keyword(model): DynamicCache(config=model.config)}
        out = model(input_ids=ids, **cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(steps):
            start = time.perf_counter()
            out = model(input_ids=token, **cache, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - start)
    return times


def bench_hf(tiny: bool = False, rounds: int = 2, operators=None) -> list:
    """Run the comparison; print the table; return its rows (name, median ms, min ms, max ms, median ratio to
    transformers eager, min ratio)."""
    from .engine import OPERATORS, Engine
    shape = TINY if tiny else FULL
    operators = operators or OPERATORS
    model = _model(shape)
    rng = np.random.default_rng(0)
    prompts = rng.integers(2, shape["vocab"], (shape["requests"], shape["prompt"])).tolist()
    samples = {name: [] for name in ("transformers eager", *operators)}
    engines = {op: Engine(model, operator=op, page_size=16, backend="reference") for op in operators}
    with _console.progress(rounds * (1 + len(operators)), "bench --hf") as tick:
        for _ in range(rounds):
            samples["transformers eager"] += _transformers_eager(model, prompts, shape["steps"])
            tick("transformers eager")
            for op in operators:
                res = engines[op].generate(prompts, shape["steps"] + 1)         # one prefill, then `steps` decodes
                samples[op] += res.decode_step_seconds
                tick(op)
    base = float(np.median(samples["transformers eager"]))
    fastest = float(np.min(samples["transformers eager"]))
    rows = []
    for name, times in samples.items():
        ms = np.asarray(times) * 1e3
        rows.append((name, float(np.median(ms)), float(ms.min()), float(ms.max()), float(np.median(times)) / base,
                     float(np.min(times)) / fastest))
    title = (f"Time per decode step: random Llama, {shape['layers']} layers, d_model {shape['hidden']},\n"
             f"{shape['heads']} heads / {shape['kv_heads']} kv, {shape['requests']} requests x "
             f"{shape['prompt']}-token prompts,\n{shape['steps']} steps x {rounds} rounds "
             "(float32 cache, reference backend)")
    _console.say(title)
    # On a shared machine the minimum is the step least disturbed by others: its ratio is the steadier one.
    _console.say("x med, x min: the median and the minimum over transformers eager's")
    _console.table(None, ["attention", "median ms", "min ms", "max ms", "x med", "x min"],
                   [(n, f"{m:.1f}", f"{lo:.1f}", f"{hi:.1f}", f"{r:.2f}", f"{rm:.2f}") for n, m, lo, hi, r, rm in rows],
                   right=("median ms", "min ms", "max ms", "x med", "x min"))
    return rows

"""A tiny LLM server loop: what these operators are for, run end to end.

A decoder-only model with seeded random weights (a few layers, GQA, RoPE, RMSNorm, a SwiGLU MLP) serves
several prompts of different lengths with in-flight batching: requests arrive on later steps and join the
batch with their whole prompt (a prefill) while others decode one token each; a request that has produced
its tokens leaves, and its cache pages go back to the free list for the next arrival. Every layer's
attention runs through one operator on one paged cache that holds all layers, checked against a float64
evaluation of the reference:
  - `multi_head_cache_attention` (OpenPPL) on a paged int8 cache (`layer_idx` picks the slab; decoding
    requests first, as `decoding_batches` wants; RoPE applied by the model before the call);
  - `gpt_attention` (TensorRT-LLM) on a paged pool addressed through `kv_cache_block_offsets` the way its
    KV cache manager writes them (context requests first; the operator applies GPT-NeoX RoPE itself).
Run once with backend="reference" and once with backend="numba" (the kernels; the simulator without a
GPU), the greedy tokens of the two runs are compared.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

import cacheattn
import reference


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 48
    d_model: int = 32
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    rope_base: float = 10000.0
    seed: int = 0


@dataclass(frozen=True)
class Request:
    prompt: tuple
    max_new_tokens: int
    arrival_step: int


@dataclass(frozen=True)
class ServeConfig:
    page_size: int = 4
    num_pages: int = 24              # the pool; pages return to the free list when a request finishes
    quant_bit: int = 8
    quant_group: int = 4


DEFAULT_REQUESTS = (Request((3, 14, 15, 9, 2), 5, 0), Request((6, 5, 35, 8, 9, 7, 9, 3, 2), 3, 0),
                    Request((38, 4), 6, 2), Request((6, 2, 6, 4, 33, 8), 4, 4))
QUICK_REQUESTS = (Request((3, 14, 15), 3, 0), Request((6, 5, 35, 8, 9), 2, 0), Request((38, 4), 3, 2))


class TinyModel:
    """Seeded random weights; float32 everywhere except the int8 cache."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        rng = np.random.default_rng(cfg.seed)
        d, hq, hkv, dh = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

        def w(*shape):
            return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

        self.embed = rng.standard_normal((cfg.vocab, d)).astype(np.float32)
        self.lm_head = w(d, cfg.vocab)          # untied: a tied head mostly predicts the token it was given
        self.layers = [dict(wq=w(d, hq * dh), wk=w(d, hkv * dh), wv=w(d, hkv * dh), wo=w(hq * dh, d),
                            w_gate=w(d, 2 * d), w_up=w(d, 2 * d), w_down=w(2 * d, d)) for _ in range(cfg.num_layers)]
        half = dh // 2
        self.inv_freq = 1.0 / cfg.rope_base ** (np.arange(half) * 2.0 / dh)

    def rope(self, x, positions):
        """GPT-NeoX rotation of (tokens, heads, head_dim) at the tokens' positions."""
        half = self.cfg.head_dim // 2
        angle = positions[:, None, None] * self.inv_freq[None, None, :]          # (T, 1, half)
        cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _rms_norm(x):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)


@dataclass
class _Live:
    request: Request
    tokens: list                     # prompt + generated so far
    cached: int = 0                  # tokens already in the cache
    pages: list = field(default_factory=list)


@dataclass
class ServeResult:
    backend: str
    generated: list                  # per request, its greedy tokens
    steps: int
    tokens_processed: int
    peak_pages: int
    max_error: float                 # attention output vs float64, over every layer and step
    seconds: float


class PagePool:
    """A free list of page numbers; a request takes pages as its tokens need them and returns them all."""

    def __init__(self, num_pages: int):
        self.free = list(range(num_pages))
        self.in_use = 0
        self.peak = 0

    def take(self) -> int:
        if not self.free:
            raise RuntimeError("the page pool is exhausted: raise ServeConfig.num_pages")
        self.in_use += 1
        self.peak = max(self.peak, self.in_use)
        return self.free.pop(0)

    def give_back(self, pages: list) -> None:
        self.free[:0] = pages            # reused first, as a server's allocator hands out recently freed pages
        self.in_use -= len(pages)


class PPLPath:
    """multi_head_cache_attention on a paged int8 cache; the model applies RoPE before the call."""
    operator = "multi_head_cache_attention"
    decoding_first = True

    def __init__(self, model: TinyModel, cfg: ServeConfig):
        m = model.cfg
        self.model, self.cfg = model, cfg
        stored = m.head_dim // 2 if cfg.quant_bit == 4 else m.head_dim            # int4: two values a byte
        shape = (cfg.num_pages * cfg.page_size, m.num_layers, 2, m.num_kv_heads)
        self.cache = np.zeros((*shape, stored), np.int8 if cfg.quant_bit else np.float32)
        self.scale = np.zeros((*shape, m.head_dim // cfg.quant_group), np.float32) if cfg.quant_bit else None

    def batch(self, states, seqlens, past):
        cfg, m = self.cfg, self.model.cfg
        table = np.full((len(states), max(len(s.pages) for s in states)), -1, np.int64)
        for b, s in enumerate(states):
            table[b, :len(s.pages)] = np.array(s.pages) * cfg.page_size           # token offsets of the pages
        self.args = (_starts(seqlens), _starts(past + seqlens), table, past, int(np.sum(past > 0)),
                     int(seqlens.max()), int((past + seqlens).max()))
        self.positions = np.concatenate([np.arange(p, p + n) for p, n in zip(past, seqlens)])
        self.attrs = dict(num_heads=m.num_heads, head_dim=m.head_dim, is_causal=True, num_kv_heads=m.num_kv_heads,
                          num_layer=m.num_layers, quant_bit=cfg.quant_bit, quant_group=cfg.quant_group, cache_mode=1,
                          page_size=cfg.page_size)

    def attend(self, h, w, layer_idx, backend, threads):
        m = self.model.cfg
        q = self.model.rope((h @ w["wq"]).reshape(-1, m.num_heads, m.head_dim), self.positions)
        k = self.model.rope((h @ w["wk"]).reshape(-1, m.num_kv_heads, m.head_dim), self.positions)
        v = (h @ w["wv"]).reshape(-1, m.num_kv_heads, m.head_dim)
        seqstarts, kvstarts, table, past, decoding, max_seqlen, max_kvlen = self.args
        before = (self.cache.copy(), None if self.scale is None else self.scale.copy())
        out = cacheattn.multi_head_cache_attention(
            q, k, v, seqstarts, kvstarts, table, past, decoding, max_seqlen, max_kvlen, self.cache, self.scale,
            layer_idx=layer_idx, **self.attrs, backend=backend, **({"threads": threads} if backend == "numba" else {}))
        # float64: the reference's store on a copy of the cache before the call gives the K/V the call wrote
        # (quantization is specified to the bit), then float64 attention over them.
        key, value = reference.dynamic_key_value_cache(
            k, v, seqstarts, kvstarts, table, past, max_seqlen, max_kvlen, *before, num_layer=m.num_layers,
            layer_idx=layer_idx, quant_bit=self.cfg.quant_bit, quant_group=self.cfg.quant_group, cache_mode=1,
            page_size=self.cfg.page_size)
        f64 = np.float64
        want = reference.dynamic_multi_head_attention(
            q.astype(f64), key.astype(f64), value.astype(f64), seqstarts, kvstarts, decoding, max_seqlen, max_kvlen,
            num_heads=m.num_heads, head_dim=m.head_dim, is_causal=True, num_kv_heads=m.num_kv_heads)
        return out.reshape(len(h), -1), float(np.max(np.abs(np.asarray(out, f64) - want)))


class GptPath:
    """gpt_attention on a paged float32 pool; the operator applies GPT-NeoX RoPE; a float64 shadow pool, written
    by the reference from the same qkv, gives the exact evaluation."""
    operator = "gpt_attention"
    decoding_first = False

    def __init__(self, model: TinyModel, cfg: ServeConfig):
        m = model.cfg
        self.model, self.cfg = model, cfg
        shape = (cfg.num_pages, m.num_layers, 2, m.num_kv_heads, cfg.page_size, m.head_dim)
        self.pool, self.shadow = np.zeros(shape, np.float32), np.zeros(shape, np.float64)

    def batch(self, states, seqlens, past):
        m, cfg = self.model.cfg, self.cfg
        entries = len(states)
        capacity = cfg.num_pages * cfg.page_size
        offsets = np.zeros((1, entries, 2, max(len(s.pages) for s in states)), np.int32)
        for e, s in enumerate(states):                    # the manager's offsets: block * num_layers * 2 + kv
            for kv in range(2):
                offsets[0, e, kv, :len(s.pages)] = np.array(s.pages) * m.num_layers * 2 + kv
        generation = past > 0
        self.args = dict(
            past_key_value=None, sequence_length=(past + seqlens).astype(np.int32),
            host_past_key_value_lengths=past.astype(np.int32),
            host_max_attention_window_sizes=np.full(m.num_layers, capacity, np.int32),
            host_sink_token_length=np.zeros(1, np.int32),
            context_lengths=np.where(generation, [len(s.request.prompt) for s in states], seqlens).astype(np.int32),
            cache_indirection=np.zeros((entries, 1, capacity), np.int32),
            host_request_types=generation.astype(np.int32), num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
            hidden_size_per_head=m.head_dim, q_scaling=1.0, rotary_embedding_dim=m.head_dim,
            rotary_embedding_base=m.rope_base, position_embedding_type=cacheattn.PositionEmbeddingType.rope_gpt_neox,
            kv_cache_block_offsets=offsets, paged_kv_cache=True, tokens_per_block=cfg.page_size)

    def attend(self, h, w, layer_idx, backend, threads):
        qkv = np.concatenate([h @ w["wq"], h @ w["wk"], h @ w["wv"]], axis=1)        # (tokens, (H + 2 Hkv) Dh)
        out, _ = cacheattn.gpt_attention(qkv=qkv, layer_idx=layer_idx, kv_cache_pool=self.pool, **self.args,
                                         backend=backend, threads=threads)
        want, _ = cacheattn.gpt_attention(qkv=qkv.astype(np.float64), layer_idx=layer_idx, kv_cache_pool=self.shadow,
                                          **self.args, backend="reference")
        return out, float(np.max(np.abs(np.asarray(out, np.float64) - want)))


PATHS = {"multi_head_cache_attention": PPLPath, "gpt_attention": GptPath}


@dataclass(frozen=True)
class Handoff:
    """Before step `step`, another engine takes over: a fresh `operator` path and page pool;
    move(old_path, new_path, states, new_pool) fills the new path's cache with every live request's cached tokens
    and sets each state's pages (taken from new_pool). cacheattn.convert.handoff.move is one."""
    step: int
    operator: str
    move: Callable


def _starts(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def steps_to_serve(requests) -> int:
    """How many steps `serve` takes: a request joins on its arrival step and leaves on the step that gives it its
    last token (one token a step, the first from its prefill), so the last to leave sets the count."""
    return max((r.arrival_step + r.max_new_tokens for r in requests), default=0)


def serve(model: TinyModel, requests=DEFAULT_REQUESTS, cfg: ServeConfig = ServeConfig(), *, backend="reference",
          operator="multi_head_cache_attention", threads: int = 128, on_step=None,
          handoff: Handoff | None = None) -> ServeResult:
    """Serve the requests to completion; on_step(step, batch_description) is called after each of the
    `steps_to_serve(requests)` steps; `handoff` hands the live caches to another operator on the way."""
    path = PATHS[operator](model, cfg)
    pool = PagePool(cfg.num_pages)
    waiting = sorted(range(len(requests)), key=lambda r: requests[r].arrival_step)
    live: dict[int, _Live] = {}
    generated = {r: [] for r in range(len(requests))}
    step, processed, worst = 0, 0, 0.0
    start = time.perf_counter()
    while waiting or live:
        while waiting and requests[waiting[0]].arrival_step <= step:          # arrivals join this step
            r = waiting.pop(0)
            live[r] = _Live(requests[r], list(requests[r].prompt))
        if handoff is not None and step == handoff.step:                      # another engine takes over
            path, old_path, pool = PATHS[handoff.operator](model, cfg), path, PagePool(cfg.num_pages)
            handoff.move(old_path, path, [s for s in live.values() if s.cached], pool)
        # OpenPPL wants its decoding batches first, TensorRT-LLM its context requests first.
        order = sorted(live, key=lambda r: (live[r].cached == 0) == path.decoding_first)
        if not order:                                                        # nobody has arrived yet
            if on_step:
                on_step(step, "idle")
            step += 1
            continue
        new = [live[r].tokens[live[r].cached:] for r in order]                 # one token, or the prompt
        for r in order:                                                      # pages for every token of this step
            need = -(-len(live[r].tokens) // cfg.page_size)
            live[r].pages += [pool.take() for _ in range(need - len(live[r].pages))]
        logits, err = _forward(model, path, [live[r] for r in order], new, backend, threads)
        worst = max(worst, err)
        processed += sum(len(t) for t in new)
        for r, row in zip(order, logits):
            state = live[r]
            state.cached = len(state.tokens)
            token = int(np.argmax(row))
            state.tokens.append(token)
            generated[r].append(token)
            if len(generated[r]) == state.request.max_new_tokens:           # done: leave, pages back to the pool
                pool.give_back(state.pages)
                del live[r]
        if on_step:
            on_step(step, f"{sum(1 for t in new if len(t) == 1)} decoding, {sum(1 for t in new if len(t) > 1)} prefill")
        step += 1
    return ServeResult(backend, [generated[r] for r in range(len(requests))], step, processed, pool.peak, worst,
                       time.perf_counter() - start)


def _forward(model: TinyModel, path, states, new_tokens, backend, threads):
    """One step for the batch; returns (last-token logits per request, max attention error vs float64)."""
    seqlens = np.array([len(t) for t in new_tokens])
    past = np.array([s.cached for s in states])
    path.batch(states, seqlens, past)
    x = model.embed[np.concatenate(new_tokens)]                                      # (tokens, d_model)
    worst = 0.0
    for layer_idx, w in enumerate(model.layers):
        out, err = path.attend(_rms_norm(x), w, layer_idx, backend, threads)
        worst = max(worst, err)
        x = x + out @ w["wo"]
        h = _rms_norm(x)
        gate = h @ w["w_gate"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w["w_up"])) @ w["w_down"]
    last = _starts(seqlens)[1:] - 1
    return _rms_norm(x[last]) @ model.lm_head, worst

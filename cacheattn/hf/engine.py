"""The engine: a transformers model served with in-flight batching, every attention layer through one operator.

How a step runs. The requests active at a step are packed into one sequence (batch 1, T tokens, each with its
own position id, as vLLM's Transformers backend packs them) and the model's own forward runs on it: HF's
modules compute embeddings, norms, projections, RoPE and MLPs. transformers' attention interface hands each
attention layer's Q, K, V to `_attention` (registered as attn_implementation="cacheattn"); it calls the operator
with the engine's cache and the step's index tensors, and returns the operator's output. With no cache passed
to the model (use_cache=False) and a custom implementation name, transformers builds no mask and K/V are only
this step's tokens: everything about the past lives in the operator's cache.

RoPE with gpt_attention: transformers applies it (the model's own rotary module, before the interface is called),
and gpt_attention runs with position_embedding_type=learned_absolute, i.e. rotates nothing. The interface hands
over Q and K already rotated, so the operator could only rotate them again; and HF's side is the one that knows
each family's variant (partial rotary in GPT-NeoX and Phi, llama3 / linear / dynamic scaling, Gemma's), so the
cache holds the post-RoPE keys transformers computes, which is what TensorRT-LLM's cache holds too (StreamingLLM
aside).

Scaling: gpt_attention takes q_scaling = 1 / (scaling sqrt(Dh)), onnx_attention takes `scale`, and OpenPPL's fixed
1/sqrt(Dh) is served by multiplying Q by scaling sqrt(Dh) first: bit-exact when that factor is a power of two
(1 for the 1/sqrt(d) families, 8 for T5 with d_kv 64), otherwise one more float32 rounding of Q (relative 2^-24,
the size of the rounding transformers' own `* scaling` makes).
Sliding windows: gpt_attention per layer through host_max_attention_window_sizes (a cyclic cache), ONNX through
opset 25's left_window_size = W - 1, OpenPPL through its additive attn_mask (-inf outside the window: exact).
T5's relative position bias: transformers' own table (`compute_bias`) as OpenPPL's per-head attn_mask, ONNX's
additive attn_mask, and gpt_attention's relative_attention_bias (H, L, L). Logit softcapping: ONNX `softcap`,
gpt_attention attn_logit_softcapping_scale; OpenPPL has none, so such a model is refused before it runs.

Encoder-decoder models: the encoder runs in transformers (its own attention) once per request; the decoder's
self-attention goes through the operator and its cross attention through FasterTransformer's `cross_attention`:
the cross-attention modules' forward is replaced, for the engine's steps, by a call that gives FasterTransformer
the hidden state and the encoder output; at the request's first decoder step it projects the encoder output into
the request's K/V cache (step 1), later steps read that cache.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import numpy as np

import cacheattn
from cacheattn._arrays import BACKENDS
from cacheattn._validate import check_int

from .blocks import PagedKVManager, SlotKVManager

NAME = "cacheattn"
OPERATORS = ("multi_head_cache_attention", "gpt_attention", "onnx_attention")
CACHE_KINDS = {"multi_head_cache_attention": ("paged", "offset"), "gpt_attention": ("paged", "contiguous"),
               "onnx_attention": ("contiguous",)}
KV_DTYPES = {"multi_head_cache_attention": ("float32", "float16", "int8", "int4"),
             "gpt_attention": ("float32", "float16", "bfloat16", "int8", "fp8"),
             "onnx_attention": ("float32", "float16", "bfloat16")}
# Features a model's attention may need, and the operators whose arguments express them.
FEATURES = {"softcap": ("onnx_attention", "gpt_attention")}
# Keyword arguments transformers passes to attention functions that change nothing here (the batch layout and
# the cache are the engine's; sliding_window, softcap and position_bias are read as features).
IGNORED_KWARGS = {"position_ids", "cache_position", "output_attentions", "use_cache", "past_key_values",
                  "is_causal", "sliding_window", "softcap", "position_bias", "dropout", "scaling", "query_length",
                  "return_dict", "output_hidden_states", "layer_head_mask", "head_mask", "attention_mask"}
CROSS_MODULE_NAMES = ("encoder_attn", "EncDecAttention")

_ACTIVE: list = []          # the engine whose step is running (the interface function finds it here)


def _dtype_name(kv_cache_dtype) -> str:
    """A cache dtype's name: strings as given, NumPy dtypes and types (np.float16) by their name."""
    if isinstance(kv_cache_dtype, str):
        return kv_cache_dtype
    try:
        return np.dtype(kv_cache_dtype).name
    except TypeError:
        return repr(kv_cache_dtype)


def register() -> None:
    """Register `_attention` as transformers' attn_implementation "cacheattn" (idempotent)."""
    from transformers import AttentionInterface
    AttentionInterface.register(NAME, _attention)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: query (1, Hq, T, D), key/value (1, Hkv, T, D) of this step's packed
    tokens -> ((1, T, Hq, D), None). Only inside an Engine's step: there is no other cache to attend over."""
    if not _ACTIVE:
        raise RuntimeError('attn_implementation="cacheattn" runs only inside cacheattn.hf.Engine.generate')
    return _ACTIVE[-1]._attend(module, query, key, value, scaling, kwargs), None


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_sequence(x) -> bool:
    return hasattr(x, "__len__") and hasattr(x, "__getitem__")


def _brief(x) -> str:
    """A value as an error message shows it: short text quoted, anything else by its type."""
    if isinstance(x, str):
        return repr(x if len(x) <= 20 else x[:17] + "...")
    if _is_int(x) or isinstance(x, float):
        return f"{type(x).__name__} {x!r}"
    return type(x).__name__


def _token_ids(prompt, i: int) -> list:
    """prompts[i] as a list of int token ids: a list or tuple of ints, or an integer NumPy array or torch tensor."""
    if isinstance(prompt, (str, bytes)):
        raise TypeError(f"prompts: prompts[{i}] is text ({_brief(prompt)}); the engine takes token ids: tokenize "
                        f"it first, e.g. tokenizer(text)['input_ids']")
    if hasattr(prompt, "numpy") and hasattr(prompt, "dtype"):          # a torch tensor
        prompt = prompt.detach().cpu().numpy()
    if isinstance(prompt, np.ndarray):
        if prompt.dtype.kind not in "iu":
            raise TypeError(f"prompts: prompts[{i}] must hold integer token ids, got dtype {prompt.dtype.name}")
        if prompt.ndim != 1:
            raise ValueError(f"prompts: prompts[{i}] must be 1-D (one request's token ids), got shape {prompt.shape}")
        return [int(t) for t in prompt]
    if not _is_sequence(prompt):
        raise TypeError(f"prompts: prompts[{i}] must be a list of token ids, got {_brief(prompt)}")
    for j, t in enumerate(prompt):
        if not _is_int(t):
            raise TypeError(f"prompts: prompts[{i}][{j}] must be an int token id, got {_brief(t)}")
    return [int(t) for t in prompt]


@dataclass
class LayerInfo:
    """What one self-attention layer needs, read from what the model passes the interface (a probe run)."""
    index: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None
    softcap: float | None
    position_bias: bool            # T5: the relative bias table of the first layer serves every layer
    is_causal: bool
    value_dim: int
    unknown: tuple = ()


@dataclass
class GenerateResult:
    """tokens[i]: the new token ids of prompt i; logits[i]: float32 (new tokens, vocab), each token's logits.
    steps: engine steps run; seconds: wall time of the steps; step_seconds: per step (for time per token)."""
    tokens: list
    logits: list
    steps: int = 0
    seconds: float = 0.0
    step_seconds: list = field(default_factory=list)
    decode_step_seconds: list = field(default_factory=list)   # steps in which no request ran its prompt
    request_seconds: list = field(default_factory=list)       # per request: the steps it took part in
    saturated: int = 0              # gpt_attention int8/fp8: K/V elements beyond the scale's range (clipped)


@dataclass
class _Request:
    rid: int
    prompt: list
    tokens: list = field(default_factory=list)      # generated
    logits: list = field(default_factory=list)
    fed: list = field(default_factory=list)         # decoder tokens fed so far (what the cache holds)
    step: int = 0                                   # decoder steps run (FasterTransformer's step - 1)
    encoder_output: object = None


class Engine:
    """Serve a transformers model through one cacheattn operator, in-flight, greedy.

    Parameters
    ----------
    model : transformers PreTrainedModel
        A causal LM (AutoModelForCausalLM) or an encoder-decoder LM (AutoModelForSeq2SeqLM), float32 weights for
        the exact checks. The engine switches its attention implementation only while it runs a step.
    operator : {"multi_head_cache_attention", "gpt_attention", "onnx_attention"}
        OpenPPL's, TensorRT-LLM's or ONNX's attention, with the decoder self-attention's cache in its format.
    cache : str, optional
        "paged" (default) or "offset" for OpenPPL; "paged" (default) or "contiguous" for gpt_attention;
        "contiguous" (past/present, the default and only kind) for ONNX.
    kv_cache_dtype : str, optional
        None (float32), "float16"; OpenPPL "int8" / "int4" (group scales, its rule); gpt_attention "bfloat16",
        "int8" / "fp8" (per-tensor scales, one per layer); ONNX "bfloat16".
    page_size : int
        Tokens per page (OpenPPL page_size, TensorRT-LLM tokens_per_block: a power of two there).
    quant_group : int
        OpenPPL's quantization group (elements of head_dim sharing one scale).
    backend : str
        Passed to every operator call: "reference", "numba" or "auto".
    kv_scales : float or sequence of float, optional
        gpt_attention INT8/FP8: the per-tensor dequantization scale s (kv_quant_orig_scale) of every layer, or one
        per layer. None: calibrated on the prompts of each generate call (`calibrate`).
    num_pages : int, optional
        Pages in the pool of a paged cache (default: enough for every request of a generate call at once);
        finished requests give theirs back, so fewer serve requests that do not all overlap.

    Raises
    ------
    ValueError
        Before any prompt runs, for an operator, cache kind, dtype or backend that does not exist, a page_size,
        quant_group or num_pages below 1, kv_scales that are not one positive scale (or one per layer), and for
        a feature the model's attention needs that the operator's arguments cannot express (named, with the
        operators that have it).
    TypeError
        A model that is not a transformers model, a non-int page_size, quant_group or num_pages.
    """

    def __init__(self, model, operator="multi_head_cache_attention", cache=None, kv_cache_dtype=None, page_size=16,
                 quant_group=8, backend="reference", kv_scales=None, num_pages=None):
        if not (hasattr(model, "config") and hasattr(model, "set_attn_implementation")):
            raise TypeError(f"model: expected a transformers PreTrainedModel (AutoModelForCausalLM or "
                            f"AutoModelForSeq2SeqLM), got {type(model).__name__}")
        if operator not in OPERATORS:
            raise ValueError(f"operator: expected one of {OPERATORS}, got {operator!r}")
        kinds = CACHE_KINDS[operator]
        cache = kinds[0] if cache is None else cache
        if cache not in kinds:
            raise ValueError(f"cache: {operator} keeps a {' or '.join(map(repr, kinds))} cache, got {cache!r}")
        dtype = "float32" if kv_cache_dtype is None else _dtype_name(kv_cache_dtype)
        if dtype not in KV_DTYPES[operator]:
            having = [op for op in OPERATORS if dtype in KV_DTYPES[op]]
            raise ValueError(f"kv_cache_dtype: {operator} has no {dtype!r} cache (it has {KV_DTYPES[operator]}); "
                             f"operators that have it: {having or 'none'}")
        page_size = check_int("page_size", page_size, low=1)
        quant_group = check_int("quant_group", quant_group, low=1)
        if operator == "gpt_attention" and cache == "paged" and page_size & (page_size - 1):
            raise ValueError(f"page_size: TensorRT-LLM's tokens_per_block must be a power of two, got {page_size}")
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        if kv_scales is not None and not (operator == "gpt_attention" and dtype in ("int8", "fp8")):
            raise ValueError(f"kv_scales: per-tensor scales belong to gpt_attention's int8/fp8 caches, got operator "
                             f"{operator} with a {dtype} cache")
        if num_pages is not None:
            num_pages = check_int("num_pages", num_pages, low=1)
        self.model, self.operator, self.cache, self.kv_cache_dtype = model, operator, cache, dtype
        self.page_size, self.quant_group, self.backend = page_size, quant_group, backend
        self.num_pages = num_pages
        self.encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
        register()
        model.eval()
        self.layers, self.cross_modules = self._probe()
        self._check_features()
        self.kv_scales = None if kv_scales is None else self._check_scales(kv_scales)
        self._record = None                         # calibration: layer -> amax of the K/V it stored

    def _check_scales(self, kv_scales) -> list:
        """kv_scales as one positive finite float per layer (one value serves every layer)."""
        try:
            scales = np.asarray(kv_scales, np.float64)
        except (TypeError, ValueError):
            raise TypeError(f"kv_scales: expected a float or one float per layer, got {kv_scales!r}") from None
        if scales.ndim > 1 or scales.size not in (1, len(self.layers)):
            raise ValueError(f"kv_scales: expected one scale or one per layer ({len(self.layers)}), got shape "
                             f"{scales.shape}")
        if not (np.isfinite(scales) & (scales > 0)).all():
            raise ValueError(f"kv_scales: expected finite scales > 0, got {kv_scales!r}")
        return [float(s) for s in np.broadcast_to(scales.reshape(-1), (len(self.layers),))]

    # ------------------------------------------------------------------ what the model needs, before any prompt
    def _probe(self):
        """Run the model once on two tokens with a recording attention (zeros out) to learn each layer's heads,
        scaling, window, softcap, bias and any unknown argument; find the cross-attention modules."""
        import torch
        seen: dict = {}

        def record(module, query, key, value, scaling, kwargs):
            if id(module) not in seen:
                window = kwargs.get("sliding_window")
                softcap = kwargs.get("softcap")
                unknown = tuple(sorted(k for k, v in kwargs.items() if k not in IGNORED_KWARGS and v is not None))
                seen[id(module)] = LayerInfo(
                    len(seen), int(query.shape[1]), int(key.shape[1]), int(query.shape[3]),
                    float(query.shape[3] ** -0.5 if scaling is None else scaling), None if window is None
                    else int(window), None if not softcap else float(softcap),
                    kwargs.get("position_bias") is not None,
                    bool(kwargs.get("is_causal", getattr(module, "is_causal", True))), int(value.shape[3]), unknown)
            return torch.zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[3], dtype=query.dtype)

        cross = []
        if self.encoder_decoder:
            decoder = self.model.get_decoder()
            cross = [m for name, m in decoder.named_modules() if name.split(".")[-1] in CROSS_MODULE_NAMES]
            if not cross:
                raise ValueError(f"{type(self.model).__name__}: no cross-attention modules "
                                 f"({' or '.join(CROSS_MODULE_NAMES)}) found in the decoder")
        with self._running(record, probe_cross=cross):
            ids = torch.tensor([[1, 2]])
            self._forward(ids, torch.tensor([[0, 1]]), logits_rows=torch.tensor([1]))
        if not seen:
            raise ValueError(f"{type(self.model).__name__}: no attention layer called the attention interface")
        return sorted(seen.values(), key=lambda info: info.index), cross

    def _check_features(self):
        op = self.operator
        for info in self.layers:
            if info.unknown:
                raise ValueError(f"layer {info.index}: the model's attention passes {list(info.unknown)}, which no "
                                 f"cacheattn operator's arguments express")
            if not info.is_causal:
                raise ValueError(f"layer {info.index}: bidirectional decoder self-attention; the engine serves "
                                 f"causal decoders only")
            if info.value_dim != info.head_dim:
                raise ValueError(f"layer {info.index}: value head size {info.value_dim} != query/key head size "
                                 f"{info.head_dim}; no operator here has separate sizes with a cache")
            if info.softcap and op not in FEATURES["softcap"]:
                raise ValueError(f"attention logit softcapping (softcap={info.softcap:g}, layer {info.index}): "
                                 f"{op} cannot express it; operators that have it: {list(FEATURES['softcap'])}")
        first = self.layers[0]
        if any((i.num_heads, i.num_kv_heads, i.head_dim) != (first.num_heads, first.num_kv_heads, first.head_dim)
               for i in self.layers):
            raise ValueError("layers: heads or head size differ between layers; the engine keeps one cache format "
                             "for all layers")
        if self.operator == "multi_head_cache_attention" and self.kv_cache_dtype in ("int8", "int4"):
            dh = self.layers[0].head_dim
            if dh % self.quant_group or (self.kv_cache_dtype == "int4" and dh % 2):
                raise ValueError(f"quant_group: expected a divisor of head_dim ({dh}), got {self.quant_group}")
        if self.cross_modules:
            from cacheattn.ft import HEAD_SIZES
            dh = self._cross_dims(self.cross_modules[0])[1]
            if dh not in HEAD_SIZES:
                raise ValueError(f"cross attention head size {dh}: FasterTransformer's cross_attention serves head "
                                 f"sizes {HEAD_SIZES}")

    # ------------------------------------------------------------------ the interface and the model's forward
    @contextlib.contextmanager
    def _running(self, attend, probe_cross=(), cross=None, positions=None):
        """Within: transformers' attention goes to `attend`, cross-attention modules to `cross` (or zeros for the
        probe), and the BART-style learned decoder positions are this step's. Restores the model after."""
        import torch
        model = self.model
        before = model.config._attn_implementation
        self._attend = attend
        patched = []

        def zeros_cross(module):
            def forward(hidden_states, *args, **kwargs):
                out = torch.zeros_like(hidden_states)
                return (out, None, None) if type(module).__name__.startswith("T5") else (out, None)
            return forward

        for module in probe_cross:
            module.forward = zeros_cross(module)
            patched.append(module)
        for module in (self.cross_modules if cross is not None else ()):
            module.forward = cross(module)
            patched.append(module)
        if self.encoder_decoder and positions is not None:
            embed = getattr(self.model.get_decoder(), "embed_positions", None)
            if embed is not None:
                original = type(embed).forward
                embed.forward = lambda input_ids, *a, **k: original(embed, input_ids, position_ids=positions)
                patched.append(embed)
        model.set_attn_implementation(NAME)
        if model.config._attn_implementation != NAME:         # transformers only warns when it cannot switch
            model.set_attn_implementation(before)
            raise ValueError(f"{type(model).__name__}: its attention does not go through transformers' attention "
                             "interface, so no operator can serve it here")
        _ACTIVE.append(self)
        try:
            with torch.no_grad():
                yield
        finally:
            _ACTIVE.pop()
            model.set_attn_implementation(before)
            for module in patched:
                del module.forward

    def _forward(self, ids, positions, logits_rows, encoder_rows=1):
        """The model on packed tokens ids (1, T) at positions (1, T); logits of the rows logits_rows -> (B, V)."""
        import torch
        if self.encoder_decoder:
            from transformers.modeling_outputs import BaseModelOutput
            d_model = self.model.config.d_model
            dummy = torch.zeros(1, encoder_rows, d_model)       # cross attention reads the engine's own copy
            out = self.model(encoder_outputs=BaseModelOutput(last_hidden_state=dummy), decoder_input_ids=ids,
                             use_cache=False)
            return out.logits[0, logits_rows]
        out = self.model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=logits_rows)
        return out.logits[0]

    def _attend(self, module, query, key, value, scaling, kwargs):      # replaced per run by _running
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ serving
    def generate(self, prompts, max_new_tokens=16, arrivals=None, on_step=None) -> GenerateResult:
        """Greedy generation of max_new_tokens tokens for every prompt, in-flight.

        Parameters
        ----------
        prompts : list of list of int
            Token ids in [0, vocabulary size) (the encoder's input for an encoder-decoder model); each prompt may
            also be a 1-D integer NumPy array or torch tensor. Text must be tokenized first.
        max_new_tokens : int
            Tokens every request produces (no stop at EOS), >= 1.
        arrivals : list of int, optional
            arrivals[i] >= 0 is the step at which prompt i joins (default: all at step 0).
        on_step : callable, optional
            on_step(step, description) after each step (progress).

        Returns
        -------
        GenerateResult

        Raises
        ------
        TypeError, ValueError
            Before any step runs (`check_requests`), naming the argument: text or floats where token ids belong,
            an id outside the vocabulary, an empty prompt, more positions than a learned position table holds,
            arrivals that are not one int >= 0 per prompt.
        """
        import torch
        prompts, max_new_tokens, arrivals = self.check_requests(prompts, max_new_tokens, arrivals)
        if on_step is not None and not callable(on_step):
            raise TypeError(f"on_step: expected a callable on_step(step, description) or None, got "
                            f"{type(on_step).__name__}")
        scales = self._scales(prompts) if self.kv_cache_dtype in ("int8", "fp8") and \
            self.operator == "gpt_attention" else None
        state = _Serving(self, prompts, max_new_tokens, scales)
        requests = [_Request(i, p) for i, p in enumerate(prompts)]
        waiting = sorted(range(len(prompts)), key=lambda i: arrivals[i])
        live: list = []
        result = GenerateResult([None] * len(prompts), [None] * len(prompts),
                                request_seconds=[0.0] * len(prompts))
        step = 0
        start = time.perf_counter()
        while waiting or live:
            while waiting and arrivals[waiting[0]] <= step:
                request = requests[waiting.pop(0)]
                if self.encoder_decoder:
                    with torch.no_grad():
                        request.encoder_output = self.model.get_encoder()(
                            input_ids=torch.tensor([request.prompt])).last_hidden_state[0].numpy()
                live.append(request)
            if not live:
                step += 1
                continue
            tick = time.perf_counter()
            context = [r for r in live if not r.fed]
            logits = state.step(live)
            for request, row in zip(state.order, logits):
                request.tokens.append(int(np.argmax(row)))
                request.logits.append(row)
            for request in [r for r in live if len(r.tokens) == max_new_tokens]:
                live.remove(request)
                state.release(request)
                result.tokens[request.rid] = request.tokens
                result.logits[request.rid] = np.stack(request.logits).astype(np.float32)
            seconds = time.perf_counter() - tick
            result.step_seconds.append(seconds)
            for request in state.order:
                result.request_seconds[request.rid] += seconds
            if not context:
                result.decode_step_seconds.append(seconds)
            if on_step:
                on_step(step, f"{len(state.order) - len(context)} decoding, {len(context)} prefill")
            step += 1
        result.steps, result.seconds = step, time.perf_counter() - start
        result.saturated = state.saturated
        return result

    def check_requests(self, prompts, max_new_tokens=16, arrivals=None) -> tuple[list, int, list]:
        """generate's arguments checked before anything runs, as (prompts as lists of int, max_new_tokens,
        arrivals as a list of int). Raises TypeError / ValueError naming the argument: text where token ids belong,
        ids outside the model's vocabulary, an empty prompt, a request longer than the model's learned positions,
        arrivals that are not one step >= 0 per prompt."""
        if isinstance(prompts, (str, bytes)) or not _is_sequence(prompts):
            raise TypeError(f"prompts: expected a list of token-id lists, got {_brief(prompts)}")
        if len(prompts) == 0:
            raise ValueError("prompts: expected at least one prompt, got an empty list")
        prompts = [_token_ids(p, i) for i, p in enumerate(prompts)]
        vocab = self.vocab_size()
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompts: prompts[{i}] is empty; every request needs at least one token id")
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                j = p.index(bad[0])
                raise ValueError(f"prompts: token id {bad[0]} (prompts[{i}][{j}]) is outside the model's vocabulary "
                                 f"[0, {vocab})")
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, low=1)
        limit = self.position_limit()
        if limit is not None:
            # A decoder-only request feeds its prompt and every new token but the last; a decoder of an
            # encoder-decoder model feeds the start token and every new token but the last (its prompt goes to the
            # encoder, which has as many positions).
            longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
            prompt_len = len(prompts[longest])
            if prompt_len > limit:
                raise ValueError(f"prompts: prompts[{longest}] has {prompt_len} tokens, more than the model's "
                                 f"{limit} learned positions")
            fed = max_new_tokens + (0 if self.encoder_decoder else prompt_len - 1)
            if fed > limit:
                raise ValueError(f"max_new_tokens: {max_new_tokens} new tokens after a {prompt_len}-token prompt "
                                 f"need {fed} positions, more than the model's {limit} learned positions; expected "
                                 f"max_new_tokens <= {limit - fed + max_new_tokens}")
        if arrivals is None:
            return prompts, max_new_tokens, [0] * len(prompts)
        if isinstance(arrivals, (str, bytes)) or not _is_sequence(arrivals):
            raise TypeError(f"arrivals: expected a list of steps, one per prompt, got {_brief(arrivals)}")
        arrivals = list(arrivals)
        if len(arrivals) != len(prompts):
            raise ValueError(f"arrivals: expected one step per prompt ({len(prompts)}), got {len(arrivals)}")
        for i, a in enumerate(arrivals):
            if not _is_int(a):
                raise TypeError(f"arrivals: expected int steps, got {_brief(a)} at arrivals[{i}]")
            if a < 0:
                raise ValueError(f"arrivals: expected steps >= 0, got {int(a)} at arrivals[{i}]")
        return prompts, max_new_tokens, [int(a) for a in arrivals]

    def vocab_size(self) -> int:
        """Token ids the model's input embedding has rows for."""
        embedding = self.model.get_input_embeddings()
        rows = getattr(embedding, "num_embeddings", None)
        return int(rows if rows is not None else self.model.config.vocab_size)

    def position_limit(self) -> int | None:
        """How many positions the model's learned absolute position table holds (GPT-2's wpe, BART's
        embed_positions), or None for a model without one (RoPE, T5's relative bias)."""
        learned = any(name.split(".")[-1] in ("wpe", "embed_positions") for name, _ in self.model.named_modules())
        config = self.model.config
        limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
        return int(limit) if learned and limit else None

    # ------------------------------------------------------------------ TensorRT-LLM's per-tensor scales
    def _scales(self, prompts):
        return self.calibrate(prompts) if self.kv_scales is None else self.kv_scales

    def calibrate(self, prompts) -> list:
        """Per-layer scales s (kv_quant_orig_scale) for gpt_attention's INT8/FP8 cache, from the prompts' K/V.

        Each prompt's context step runs through the same operator on a float32 cache; for each layer the largest
        |K| or |V| the cache stores (post-RoPE K) over all prompts is amax, and s = amax / 127 (INT8) or
        amax / 448 (FP8 e4m3's largest finite value), so the prompts' values fill the format's range without
        saturating. Generated tokens whose K/V exceed amax saturate, as in TensorRT-LLM (GenerateResult.saturated
        counts the clipped elements; a saturated run is outside `logit_bound`'s assumptions).
        """
        calib = Engine(self.model, operator="gpt_attention", cache=self.cache, page_size=self.page_size,
                       backend="reference")
        calib._record = np.zeros(len(self.layers))
        calib.generate(prompts, max_new_tokens=1)
        top = 127.0 if self.kv_cache_dtype == "int8" else 448.0
        return [float(max(a, 1e-6) / top) for a in calib._record]

    def _cross_dims(self, module):
        """(heads, head size) of a cross-attention module (BART: num_heads/head_dim; T5: n_heads/key_value_proj_dim)."""
        heads = getattr(module, "num_heads", None) or module.n_heads
        dh = getattr(module, "head_dim", None) or module.key_value_proj_dim
        return int(heads), int(dh)


class _Serving:
    """One generate call's cache and step state for the engine's operator."""

    def __init__(self, engine: Engine, prompts, max_new_tokens, scales):
        self.engine, self.scales = engine, scales
        self.saturated = 0
        self.top = {"int8": 127.0, "fp8": 448.0}.get(engine.kv_cache_dtype)
        op, layers = engine.operator, engine.layers
        self.num_layers = len(layers)
        info = layers[0]
        self.hq, self.hkv, self.dh = info.num_heads, info.num_kv_heads, info.head_dim
        longest = max(len(p) for p in prompts) + max_new_tokens if not engine.encoder_decoder else max_new_tokens
        self.capacity = longest
        ps = engine.page_size
        if engine.cache == "paged":
            pages = engine.num_pages or len(prompts) * -(-longest // ps)
            self.manager = PagedKVManager(pages, ps)
            self.max_tokens = pages * ps
        else:
            self.manager = SlotKVManager(len(prompts), longest)
            self.max_tokens = len(prompts) * longest
        self.bias_table = self._t5_bias(longest)
        self.op = {"multi_head_cache_attention": _PPL, "gpt_attention": _GPT, "onnx_attention": _ONNX}[op](self)
        self.cross = _Cross(self) if engine.encoder_decoder else None

    def _t5_bias(self, length):
        """(H, L, L) float32: T5's relative position bias of query position i and key j, from transformers'
        own table and bucketing (the first decoder layer's compute_bias), for the layers that take it."""
        if not any(i.position_bias for i in self.engine.layers):
            return None
        import torch
        owner = next((m for m in self.engine.model.get_decoder().modules()
                      if getattr(m, "has_relative_attention_bias", False)), None)
        if owner is None:
            raise ValueError("position_bias: the model passes a position bias but has no relative_attention_bias")
        with torch.no_grad():
            return owner.compute_bias(length, length)[0].float().numpy()

    def step(self, live):
        import torch
        engine = self.engine
        order = self.op.order(live)
        self.order = order
        if engine.encoder_decoder:
            new = [[engine.model.config.decoder_start_token_id] if not r.fed else [r.tokens[-1]] for r in order]
        else:
            new = [list(r.prompt) if not r.fed else [r.tokens[-1]] for r in order]
        for r, tokens in zip(order, new):
            if not r.fed:
                self.manager.add(r.rid, len(tokens))
            self.manager.reserve(r.rid, len(r.fed) + len(tokens))
        seqlens = [len(t) for t in new]
        self.layout = self.manager.layout([r.rid for r in order], seqlens)
        positions = np.concatenate([np.arange(len(r.fed), len(r.fed) + n) for r, n in zip(order, seqlens)])
        self.positions = positions
        self.op.begin(order, self.layout)
        ids = torch.from_numpy(np.concatenate(new).astype(np.int64)[None])
        pos = torch.tensor(positions[None])
        last = torch.tensor(np.cumsum(seqlens) - 1)
        cross = self.cross.forward if self.cross is not None else None
        if self.cross is not None:
            self.cross.begin(order)
        self.calls = 0
        with engine._running(self._attend, cross=cross, positions=pos[0]):
            logits = engine._forward(ids, pos, last).float().numpy()
        if self.calls != self.num_layers:                  # every layer of every step went through the operator
            raise RuntimeError(f"{self.calls} attention calls in a step of a {self.num_layers}-layer model")
        self.manager.advance([r.rid for r in order], seqlens)
        for r, tokens in zip(order, new):
            r.fed += tokens
            r.step += 1
        return logits

    def _attend(self, module, query, key, value, scaling, kwargs):
        import torch
        info = self.engine.layers[self._layer_of(module)]
        self.calls += 1
        q = query[0].transpose(0, 1).float().contiguous().numpy()        # (T, Hq, D)
        k = key[0].transpose(0, 1).float().contiguous().numpy()          # (T, Hkv, D)
        v = value[0].transpose(0, 1).float().contiguous().numpy()
        if self.engine._record is not None:
            self.engine._record[info.index] = max(self.engine._record[info.index], np.abs(k).max(), np.abs(v).max())
        if self.scales is not None:         # the logit bound assumes nothing clipped: count what the format clips
            limit = self.top * self.scales[info.index] * (1 + 1e-6)      # amax itself maps onto the top value
            self.saturated += int((np.abs(k) > limit).sum() + (np.abs(v) > limit).sum())
        out = self.op.attend(info, q, k, v)
        return torch.from_numpy(np.ascontiguousarray(out, np.float32))[None].to(query.dtype)   # (1, T, Hq, D)

    def _layer_of(self, module):
        index = getattr(self, "_layer_ids", None)
        if index is None:
            index = self._layer_ids = {}
        if id(module) not in index:
            index[id(module)] = len(index)
        return index[id(module)]

    def release(self, request):
        self.manager.release(request.rid)
        self.op.release(request)
        if self.cross is not None:
            self.cross.release(request)

    # --- helpers the operators share
    def window_and_bias_mask(self, info, dtype, layout):
        """OpenPPL's additive attn_mask for a sliding window and/or T5's bias: (H, sum seqlen, sum kvlen) or
        (sum seqlen, sum kvlen), each request's block at (seqstarts[b], kvstarts[b]); None when not needed."""
        if info.sliding_window is None and not info.position_bias:
            return None
        rows, cols = layout.seqstarts, layout.kvstarts
        heads = (self.hq,) if info.position_bias else ()
        mask = np.zeros(heads + (rows[-1], cols[-1]), np.float32)
        for b in range(len(layout.seqlens)):
            mask[..., rows[b]:rows[b + 1], cols[b]:cols[b + 1]] = self.request_bias(
                info, int(layout.past[b]), int(layout.seqlens[b]))
        return mask.astype(dtype)

    def request_bias(self, info, past, seqlen):
        """Additive bias (H or 1, seqlen, past + seqlen) of one request's queries at positions past..past+seqlen-1:
        T5's relative bias and -inf outside a sliding window (keys j <= p - W); causal is the operator's."""
        kvlen = past + seqlen
        p = np.arange(past, kvlen)[:, None]
        j = np.arange(kvlen)[None, :]
        bias = np.zeros((1, seqlen, kvlen), np.float32)
        if info.position_bias:
            bias = self.bias_table[:, past:kvlen, :kvlen].astype(np.float32)
        if info.sliding_window is not None:
            bias = np.where(j <= p - info.sliding_window, np.float32(-np.inf), bias)
        return bias

    def cast(self, x):
        name = self.engine.kv_cache_dtype
        if name in ("float16",):
            return x.astype(np.float16)
        if name == "bfloat16":
            import ml_dtypes
            return x.astype(ml_dtypes.bfloat16)
        return x


class _PPL:
    """OpenPPL multi_head_cache_attention: one cache (MaxT, num_layer, 2, Hkv, Dh) for every layer (layout 0),
    paged (cache_mode 1) or one slot per request (cache_mode 0); decoding requests first."""

    def __init__(self, s: _Serving):
        self.s = s
        e = s.engine
        bits = {"int8": 8, "int4": 4}.get(e.kv_cache_dtype, 0)
        dtype = np.float16 if e.kv_cache_dtype == "float16" else np.float32
        stored = s.dh // 2 if bits == 4 else s.dh
        shape = (s.max_tokens, s.num_layers, 2, s.hkv)
        self.cache = np.zeros((*shape, stored), np.int8 if bits else dtype)
        self.scale = np.zeros((*shape, s.dh // e.quant_group), dtype) if bits else None
        self.dtype = dtype
        self.attrs = dict(num_heads=s.hq, head_dim=s.dh, is_causal=True, num_kv_heads=s.hkv, num_layer=s.num_layers,
                          quant_bit=bits, quant_group=e.quant_group, cache_mode=1 if e.cache == "paged" else 0,
                          page_size=e.page_size, backend=e.backend)

    def order(self, live):
        return sorted(live, key=lambda r: (not r.fed, r.rid))            # decoding (already fed) first

    def begin(self, order, layout):
        self.layout = layout
        self.args = (layout.seqstarts, layout.kvstarts, layout.cachestarts(), layout.start_pos,
                     layout.decoding_batches, layout.max_seqlen, layout.max_kvlen)
        self.masks = {}

    def attend(self, info, q, k, v):
        factor = info.scaling * np.sqrt(self.s.dh)             # the operator divides by sqrt(Dh); the model wants
        if factor != 1.0:                                      # `scaling`: pre-scale Q
            q = q * np.float32(factor)
        key = (info.sliding_window, info.position_bias)
        if key not in self.masks:
            self.masks[key] = self.s.window_and_bias_mask(info, self.dtype, self.layout)
        out = cacheattn.multi_head_cache_attention(
            q.astype(self.dtype), k.astype(self.dtype), v.astype(self.dtype), *self.args, self.cache, self.scale,
            self.masks[key], layer_idx=info.index, **self.attrs)
        return np.asarray(out, np.float32)

    def release(self, request):
        pass


class _GPT:
    """TensorRT-LLM gpt_attention: the paged pool (num_pages, num_layers, 2, Hkv, tokens_per_block, Dh) addressed
    by kv_cache_block_offsets, or one contiguous past_key_value (slots, 2, Hkv, capacity, Dh) per layer; context
    requests first; RoPE already applied by the model (learned_absolute here)."""

    def __init__(self, s: _Serving):
        self.s = s
        e = s.engine
        quant = e.kv_cache_dtype in ("int8", "fp8")
        self.qdtype = np.dtype(np.float32) if quant else np.dtype(s.cast(np.zeros(0, np.float32)).dtype)
        from reference.trtllm_gpt_attention import fp8_e4m3
        store = {"int8": np.dtype(np.int8), "fp8": fp8_e4m3()}.get(e.kv_cache_dtype, self.qdtype)
        self.capacity = s.capacity if e.cache != "paged" else -(-s.capacity // e.page_size) * e.page_size
        if e.cache == "paged":
            self.pool = np.zeros((s.max_tokens // e.page_size, s.num_layers, 2, s.hkv, e.page_size, s.dh), store)
        else:
            self.past = [np.zeros((len(s.manager.free), 2, s.hkv, self.capacity, s.dh), store)
                         for _ in range(s.num_layers)]
        windows = [self.capacity if i.sliding_window is None else min(i.sliding_window, self.capacity)
                   for i in e.layers]
        self.fixed = dict(host_max_attention_window_sizes=np.array(windows, np.int32),
                          host_sink_token_length=np.zeros(1, np.int32), num_heads=s.hq, num_kv_heads=s.hkv,
                          hidden_size_per_head=s.dh, paged_kv_cache=e.cache == "paged", tokens_per_block=e.page_size,
                          backend=e.backend)
        if quant:
            self.fixed["kv_cache_quant_mode"] = cacheattn.QuantMode.INT8_KV_CACHE if e.kv_cache_dtype == "int8" \
                else cacheattn.QuantMode.FP8_KV_CACHE

    def order(self, live):
        return sorted(live, key=lambda r: (bool(r.fed), r.rid))         # context requests first

    def begin(self, order, layout):
        e, s = self.s.engine, self.s
        layout.check_context_first()
        E = len(order)
        self.rows = layout.slots
        args = dict(sequence_length=layout.sequence_length,
                    host_past_key_value_lengths=layout.host_past_key_value_lengths,
                    context_lengths=layout.context_lengths, host_request_types=layout.host_request_types,
                    cache_indirection=np.zeros((E, 1, self.capacity), np.int32))
        if e.cache == "paged":
            args.update(kv_cache_block_offsets=layout.kv_cache_block_offsets(s.num_layers), kv_cache_pool=self.pool,
                        past_key_value=None)
        self.args = args

    def attend(self, info, q, k, v):
        T = q.shape[0]
        s = self.s
        qkv = np.concatenate([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], axis=1).astype(self.qdtype)
        extra = {}
        if info.softcap:
            extra["attn_logit_softcapping_scale"] = info.softcap
        if info.position_bias:
            extra.update(position_embedding_type=cacheattn.PositionEmbeddingType.relative,
                         relative_attention_bias=s.bias_table.astype(self.qdtype))
        if s.scales is not None:
            scale = s.scales[info.index]
            extra.update(kv_quant_orig_scale=np.array([scale], np.float32),
                         kv_orig_quant_scale=np.array([1.0 / scale], np.float32))
        past = None
        if s.engine.cache != "paged":
            whole = self.past[info.index]
            contiguous = np.array_equal(self.rows, np.arange(len(self.rows)))
            past = whole[:len(self.rows)] if contiguous else whole[self.rows]      # rows in call order
            extra["past_key_value"] = past
        out, _ = cacheattn.gpt_attention(qkv=qkv, layer_idx=info.index, q_scaling=1.0 / (info.scaling * np.sqrt(s.dh)),
                                         **self.args, **self.fixed, **extra)
        if past is not None and not contiguous:
            whole[self.rows] = past                                                  # the call wrote in place
        return np.asarray(out, np.float32).reshape(T, s.hq, s.dh)

    def release(self, request):
        pass


class _ONNX:
    """ONNX Attention with past/present: each request's cache is its present_key/present_value of the last step
    (1, Hkv, tokens, Dh) per layer; one call per request (ONNX's batch shares one past length)."""

    def __init__(self, s: _Serving):
        self.s = s
        self.present: dict = {}        # (rid, layer) -> (key, value)

    def order(self, live):
        return sorted(live, key=lambda r: r.rid)

    def begin(self, order, layout):
        self.order_ = order
        self.layout = layout

    def attend(self, info, q, k, v):
        s, layout = self.s, self.layout
        starts = layout.seqstarts
        out = np.empty(q.shape, np.float32)
        window = {} if info.sliding_window is None else dict(left_window_size=info.sliding_window - 1, opset=25)
        for b, r in enumerate(self.order_):
            rows = slice(starts[b], starts[b + 1])
            past_key, past_value = self.present.get((r.rid, info.index), (None, None))
            mask = None
            if info.position_bias:
                mask = s.request_bias(info, int(layout.past[b]), int(layout.seqlens[b]))[None]
                mask = s.cast(np.ascontiguousarray(mask))
            y, pk, pv, _ = cacheattn.onnx_attention(
                s.cast(q[rows].transpose(1, 0, 2)[None]), s.cast(k[rows].transpose(1, 0, 2)[None]),
                s.cast(v[rows].transpose(1, 0, 2)[None]), mask, past_key, past_value, is_causal=1,
                scale=info.scaling, softcap=info.softcap or 0.0, backend=s.engine.backend, **window)
            self.present[(r.rid, info.index)] = (pk, pv)
            out[rows] = np.asarray(y, np.float32)[0].transpose(1, 0, 2)
        return out

    def release(self, request):
        for layer in range(self.s.num_layers):
            self.present.pop((request.rid, layer), None)


class _Cross:
    """FasterTransformer's cross attention for each decoder cross-attention module: per request and layer its
    batch-major K [1, H, Dh/x, L, x] and V [1, H, L, Dh] caches, filled at the request's step 1. Requests at the
    same decoder step share one call (FasterTransformer's `step` is one value for the batch)."""

    def __init__(self, s: _Serving):
        self.s = s
        e = s.engine
        self.layer_of = {id(m): i for i, m in enumerate(e.cross_modules)}
        self.weights = [self._weights(m) for m in e.cross_modules]
        self.caches: dict = {}         # (rid, layer) -> (key_cache, value_cache)

    def _weights(self, module):
        def dense(linear):
            if linear is None:
                return None
            w = linear.weight.detach().float().numpy().T.copy()      # FasterTransformer's kernel is [in, out]
            b = None if linear.bias is None else linear.bias.detach().float().numpy().copy()
            return cacheattn.DenseWeight(w, b)
        names = ("q_proj", "k_proj", "v_proj", "out_proj") if hasattr(module, "q_proj") else ("q", "k", "v", "o")
        q, k, v, o = (getattr(module, n) for n in names)
        heads, dh = self.s.engine._cross_dims(module)
        return cacheattn.AttentionWeight(dense(q), dense(k), dense(v), dense(o)), heads, dh, \
            None if o.bias is None else o.bias.detach().float().numpy()

    def begin(self, order):
        self.order = order

    def forward(self, module):
        import torch
        t5 = type(module).__name__.startswith("T5")
        layer = self.layer_of[id(module)]
        weights, heads, dh, out_bias = self.weights[layer]
        x = 16 // 4                                                   # float32: 4 elements per 16 bytes

        def call(hidden_states, *args, **kwargs):
            h = hidden_states[0].float().numpy()                      # (T, d_model): one token per request
            out = np.empty_like(h)
            groups: dict = {}
            for b, r in enumerate(self.order):
                groups.setdefault(r.step + 1, []).append(b)           # FasterTransformer's step counts from 1
            for step, rows in groups.items():
                reqs = [self.order[b] for b in rows]
                enc = [r.encoder_output for r in reqs]
                longest = max(len(e) for e in enc)
                encoder_output = np.zeros((len(reqs), longest, enc[0].shape[1]), np.float32)
                for i, e in enumerate(enc):
                    encoder_output[i, :len(e)] = e
                lengths = np.array([len(e) for e in enc], np.int32)
                if step == 1:
                    kc = np.zeros((len(reqs), heads, dh // x, longest, x), np.float32)
                    vc = np.zeros((len(reqs), heads, longest, dh), np.float32)
                else:
                    kc = np.concatenate([self.caches[(r.rid, layer)][0] for r in reqs])
                    vc = np.concatenate([self.caches[(r.rid, layer)][1] for r in reqs])
                res = cacheattn.cross_attention(
                    h[rows], encoder_output, lengths, step, kc, vc, weights=weights, head_num=heads,
                    size_per_head=dh, q_scaling=1.0 / (module.scaling * np.sqrt(dh)) if hasattr(module, "scaling")
                    else 1.0, backend=self.s.engine.backend)
                if step == 1:
                    for i, r in enumerate(reqs):
                        self.caches[(r.rid, layer)] = (kc[i:i + 1].copy(), vc[i:i + 1].copy())
                out[rows] = np.asarray(res.hidden_features, np.float32)
            if out_bias is not None:
                out = out + out_bias                                  # FasterTransformer leaves it to the caller
            result = torch.from_numpy(out)[None].to(hidden_states.dtype)
            return (result, None, None) if t5 else (result, None)
        return call

    def release(self, request):
        for layer in range(len(self.weights)):
            self.caches.pop((request.rid, layer), None)

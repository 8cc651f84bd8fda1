"""Tiny seeded random-weight models of each family (nothing downloads), local checkpoints, and transformers' own
greedy generation to compare the engine with.

Weights are redrawn at a scale where logits are O(1) and the greedy choice has a margin: transformers' default
initialisation (std 0.02) gives near-flat logits whose argmax any rounding could flip.
"""

from __future__ import annotations

import numpy as np

# family -> (config class name, config keywords, seq2seq). Tiny: 2 layers, hidden 32 (64 where FasterTransformer's
# cross attention needs head size 32), each family's own attention features switched on.
FAMILIES = {
    "llama": ("LlamaConfig", dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                  rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                                                       low_freq_factor=1.0, high_freq_factor=4.0,
                                                       original_max_position_embeddings=8)), False),
    "mistral": ("MistralConfig", dict(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, sliding_window=4), False),
    "qwen2": ("Qwen2Config", dict(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                  num_key_value_heads=2), False),
    "gemma2": ("Gemma2Config", dict(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=32,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=30.0, sliding_window=4,
                                    layer_types=["sliding_attention", "full_attention"]), False),
    "gpt2": ("GPT2Config", dict(n_embd=32, n_head=4, n_positions=64), False),
    "gpt_neox": ("GPTNeoXConfig", dict(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                       rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                            partial_rotary_factor=0.5)), False),
    "phi": ("PhiConfig", dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
                              partial_rotary_factor=0.5), False),
    "bart": ("BartConfig", dict(d_model=64, encoder_attention_heads=2, decoder_attention_heads=2,
                                encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64), True),
    "t5": ("T5Config", dict(d_model=64, d_kv=32, num_heads=2, d_ff=64, relative_attention_num_buckets=8,
                            relative_attention_max_distance=16, decoder_start_token_id=0), True),
}
LAYER_KEYS = {"gpt2": "n_layer", "bart": ("encoder_layers", "decoder_layers"), "t5": ("num_layers",
                                                                                     "num_decoder_layers")}


def tiny_model(family: str, seed: int = 0, layers: int = 2, vocab: int = 97, **overrides):
    """A float32 random-weight model of `family` (a key of FAMILIES), seeded; overrides go to the config."""
    import torch
    import transformers
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {sorted(FAMILIES)}, got {family!r}")
    cls_name, kwargs, seq2seq = FAMILIES[family]
    kwargs = dict(kwargs, vocab_size=vocab, **overrides)
    keys = LAYER_KEYS.get(family, "num_hidden_layers")
    for key in (keys if isinstance(keys, tuple) else (keys,)):
        kwargs.setdefault(key, layers)
    if "layer_types" in kwargs and "layer_types" not in overrides:     # Gemma 2's alternation, one entry a layer
        pattern = kwargs["layer_types"]
        kwargs["layer_types"] = [pattern[i % len(pattern)] for i in range(kwargs[keys])]
    kwargs.setdefault("bos_token_id", 0)                 # inside the tiny vocabulary (GPT-2's default is 50256)
    kwargs.setdefault("eos_token_id", 1)
    if family in ("bart", "t5"):
        kwargs.update(pad_token_id=0, forced_eos_token_id=None)
    config = getattr(transformers, cls_name)(**kwargs)
    auto = transformers.AutoModelForSeq2SeqLM if seq2seq else transformers.AutoModelForCausalLM
    torch.manual_seed(seed)
    model = auto.from_config(config, dtype=torch.float32)
    redraw_weights(model, seed)
    return model.eval()


def redraw_weights(model, seed: int) -> None:
    """Matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1), biases ~ N(0, 0.1^2), norm scales 1 + N(0, 0.1^2)."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                fan_in = p.shape[1] if "embed" not in name and "wte" not in name and "wpe" not in name \
                    and "shared" not in name and "relative_attention_bias" not in name else 1
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(fan_in))
            elif "norm" in name or "ln" in name or "layer_norm" in name:
                base = 0.0 if type(model).__name__.startswith("Gemma") else 1.0     # Gemma scales by 1 + w
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def load(path_or_family: str, seed: int = 0, **overrides):
    """A local checkpoint directory (from_pretrained, no download) or a family name (tiny_model).

    Raises FileNotFoundError for a path that is no directory, or a directory without config.json, and
    ValueError for a name that is neither a family nor a directory; each lists the families."""
    from pathlib import Path
    families = ", ".join(sorted(FAMILIES))
    path = Path(path_or_family)
    if path_or_family not in FAMILIES and not path.is_dir():
        if path.exists():
            raise FileNotFoundError(f"{path_or_family!r} is a file; expected a checkpoint directory (config.json "
                                    f"and weights) or a family: {families}")
        if any(sep in path_or_family for sep in ("/", "\\")) or path_or_family.startswith(("~", ".")):
            raise FileNotFoundError(f"no such checkpoint directory {path_or_family!r}; expected an existing "
                                    f"directory (config.json and weights) or a family: {families}")
        raise ValueError(f"{path_or_family!r} is neither a family nor a checkpoint directory; expected a family "
                         f"({families}) or a local directory (config.json and weights)")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path_or_family!r} has no config.json: not a transformers checkpoint "
                                    f"(save one with model.save_pretrained(directory))")
        import transformers
        config = transformers.AutoConfig.from_pretrained(path_or_family, local_files_only=True)
        auto = transformers.AutoModelForSeq2SeqLM if config.is_encoder_decoder else \
            transformers.AutoModelForCausalLM
        return auto.from_pretrained(path_or_family, local_files_only=True).float().eval()
    return tiny_model(path_or_family, seed=seed, **overrides)


def hf_generate(model, prompt, max_new_tokens):
    """transformers' own greedy generate with the model's default attention, one prompt alone, no stop at EOS and
    no logits processors. Returns (new token ids, float32 logits (new tokens, vocab))."""
    import torch
    from transformers import GenerationConfig
    config = model.config
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, eos_token_id=None,
                           pad_token_id=config.pad_token_id if config.pad_token_id is not None else 0,
                           decoder_start_token_id=getattr(config, "decoder_start_token_id", None),
                           bos_token_id=config.bos_token_id, output_logits=True, return_dict_in_generate=True)
    # generate() fills what a given config leaves None from model.generation_config (its eos_token_id, BART's
    # forced_eos_token_id, ...): the clean config stands in for the model's own while generate runs.
    own = model.generation_config
    model.generation_config = gen
    try:
        with torch.no_grad():
            ids = torch.tensor([list(prompt)])
            # Every prompt token counts, the pad id too (generate would infer a mask that hides it).
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    finally:
        model.generation_config = own
    skip = 1 if config.is_encoder_decoder else len(prompt)
    tokens = out.sequences[0, skip:].tolist()
    logits = torch.stack(out.logits)[:, 0].float().numpy()
    return tokens, logits


def compare(res_tokens, res_logits, want_tokens, want_logits):
    """(tokens identical, agreement, max logit error relative to max(1, |logit|)) of one request. Logits are
    compared over the common prefix and the first differing position (later positions saw different inputs)."""
    same = [a == b for a, b in zip(res_tokens, want_tokens)]
    upto = same.index(False) + 1 if False in same else len(same)
    got, want = np.asarray(res_logits[:upto], np.float64), np.asarray(want_logits[:upto], np.float64)
    err = float(np.max(np.abs(got - want) / np.maximum(1.0, np.abs(want))))
    return all(same), float(np.mean(same)), err


# The error one stored element carries, relative to the range its scale or exponent covers: half an ulp of the
# float formats (float16 2^-11, bfloat16 2^-8, e4m3 2^-4), half a step of the integer grids over amax (int8
# 1/254, int4 1/14; OpenPPL's per group, TensorRT-LLM's per tensor).
UNIT_ERROR = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "int8": 1 / 254, "int4": 1 / 14,
              "fp8": 2.0 ** -4}


def logit_bound(kv_cache_dtype: str, num_layers: int) -> float:
    """Largest logit error, relative to max(1, |logit|), a cache format may cause against the float32 run.

    First order, per layer: V's error moves the output by u max|V|; K's (and for half caches Q's) moves each
    score by at most u |q| |k| scaling, and softmax turns a score error e into at most 2e of probability mass,
    so the layer's output moves by a few u relative to its size. The residual stream carries each layer's error
    to the logits unamplified to first order (the norms rescale it), so errors add over layers: 8 u per layer
    covers Q, K, V and the factor 2 with room (the models here show at most 3.5 u per layer).
    """
    return 8.0 * num_layers * UNIT_ERROR[kv_cache_dtype]


def margin_violations(tokens, logits, base_tokens, base_logits, bound):
    """Positions (within the common prefix and the first difference) where the float32 run's top-1 leads its
    runner-up by more than 2 bound max(1, |logit|) yet the tokens differ: a logit error within `bound` cannot
    flip such a choice, so any is a defect."""
    bad = []
    for t, (a, b) in enumerate(zip(tokens, base_tokens)):
        row = np.sort(np.asarray(base_logits[t], np.float64))
        margin = row[-1] - row[-2]
        if a != b:
            if margin > 2 * bound * max(1.0, abs(row[-1])):
                bad.append(t)
            break
    return bad

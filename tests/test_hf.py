"""cacheattn.hf: transformers models served through every operator, token for token against transformers.

Skipped cleanly without the `hf` extra (torch, transformers); CI installs it. CACHEATTN_EXAMPLES >= 2 widens the
matrix (more prompts, tokens and seeds) and the property test's examples.
"""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
# The models are tiny: torch's intra-op threads only contend with the other pytest worker (several times slower).
torch.set_num_threads(1)

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import cacheattn  # noqa: E402
from cacheattn.hf import Engine  # noqa: E402
from cacheattn.hf.engine import CACHE_KINDS, KV_DTYPES  # noqa: E402
from cacheattn.hf.models import (  # noqa: E402
    FAMILIES,
    compare,
    hf_generate,
    logit_bound,
    margin_violations,
    tiny_model,
)

from strategies import deep_only  # noqa: E402

# The suite's own calls use transformers' current API (a model's cache keyword is `cache`, no longer
# `past_key_values`): its deprecation warning fails the test that triggers it.
pytestmark = pytest.mark.filterwarnings("error:.*past_key_values.*:FutureWarning")

WIDE = int(os.environ.get("CACHEATTN_EXAMPLES", "1")) >= 2
PROMPTS = [[3, 14, 15, 9, 2, 6], [6, 5, 35, 8, 9, 7, 9, 3, 2], [38, 4]]
ARRIVALS = [0, 0, 2]                 # the third joins while the first two decode
NEW = 6 if WIDE else 4
SEEDS = (0, 1) if WIDE else (0,)
PAIRS = [(op, cache) for op, kinds in CACHE_KINDS.items() for cache in kinds]


def needs(family, operator):
    """The operator can express what the family's attention needs (OpenPPL has no logit softcapping)."""
    return not (family == "gemma2" and operator == "multi_head_cache_attention")


@pytest.fixture(scope="module")
def served():
    """family -> (model, transformers' greedy tokens and logits per prompt), built once."""
    cache = {}

    def get(family, seed=0):
        if (family, seed) not in cache:
            model = tiny_model(family, seed=seed)
            cache[family, seed] = model, [hf_generate(model, p, NEW) for p in PROMPTS]
        return cache[family, seed]
    return get


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("operator,cache", PAIRS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_float32_tokens_and_logits_match_transformers(served, family, operator, cache, seed):
    if not needs(family, operator):
        pytest.skip("refused by design: test_a_feature_the_operator_lacks_is_refused_before_any_prompt")
    model, want = served(family, seed)
    res = Engine(model, operator=operator, cache=cache, page_size=4).generate(PROMPTS, NEW, arrivals=ARRIVALS)
    for i, (tokens, logits) in enumerate(want):
        assert res.tokens[i] == tokens, f"prompt {i}: {res.tokens[i]} != transformers' {tokens}"
        assert res.logits[i].dtype == np.float32 and res.logits[i].shape == logits.shape
        err = np.abs(res.logits[i].astype(np.float64) - logits) / np.maximum(1.0, np.abs(logits))
        assert err.max() <= 1e-4, f"prompt {i}: logit error {err.max():.3g} (relative to max(1, |logit|))"


def test_every_layer_of_every_step_goes_through_the_operator(monkeypatch):
    """Calls = layers x steps, and transformers' own attention functions are never reached."""
    from transformers.integrations import sdpa_attention
    from transformers.models.llama import modeling_llama

    def forbidden(*args, **kwargs):
        raise AssertionError("transformers' own attention ran inside the engine")
    model = tiny_model("llama")
    engine = Engine(model, operator="gpt_attention")
    layers = []
    original = cacheattn.gpt_attention
    monkeypatch.setattr(cacheattn, "gpt_attention", lambda **kw: (layers.append(kw["layer_idx"]), original(**kw))[1])
    monkeypatch.setattr(modeling_llama, "eager_attention_forward", forbidden)
    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", forbidden)
    res = engine.generate([[1, 2, 3], [4, 5]], 3, arrivals=[0, 1])
    assert res.steps == 4 and layers == [0, 1] * res.steps
    assert model.config._attn_implementation != "cacheattn"          # restored after the run


def test_a_feature_the_operator_lacks_is_refused_before_any_prompt(monkeypatch):
    model = tiny_model("gemma2")
    monkeypatch.setattr(cacheattn, "multi_head_cache_attention", None)     # nothing may call it
    with pytest.raises(ValueError, match=r"softcapping.*multi_head_cache_attention.*'onnx_attention', "
                                         r"'gpt_attention'"):
        Engine(model, operator="multi_head_cache_attention")


@pytest.mark.parametrize("kwargs,match", [
    (dict(operator="flash"), "operator: expected one of"),
    (dict(operator="onnx_attention", cache="paged"), "cache: onnx_attention keeps a 'contiguous' cache"),
    (dict(operator="multi_head_cache_attention", kv_cache_dtype="fp8"), r"no 'fp8' cache.*\['gpt_attention'\]"),
    (dict(operator="onnx_attention", kv_cache_dtype="int8"), r"operators that have it: \['multi_head_cache"),
    (dict(operator="gpt_attention", page_size=12), "tokens_per_block must be a power of two"),
    (dict(operator="multi_head_cache_attention", kv_cache_dtype="int8", quant_group=3), "quant_group"),
    (dict(operator="gpt_attention", kv_scales=0.1), "kv_scales: per-tensor scales belong to"),
    (dict(operator="gpt_attention", kv_cache_dtype="int8", kv_scales=[0.1, 0.2]), r"kv_scales: .*one per layer "
                                                                                  r"\(1\)"),
    (dict(operator="gpt_attention", kv_cache_dtype="fp8", kv_scales=float("nan")), "kv_scales: expected finite"),
    (dict(page_size=0), "page_size: expected an int >= 1"),
    (dict(operator="multi_head_cache_attention", kv_cache_dtype="int8", quant_group=0), "quant_group"),
    (dict(num_pages=0), "num_pages: expected an int >= 1"),
    (dict(backend="cuda"), "backend: expected one of"),
])
def test_bad_engine_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Engine(tiny_model("llama", layers=1), **kwargs)


def test_engine_takes_numpy_dtypes_and_refuses_what_is_no_model():
    assert Engine(tiny_model("llama", layers=1), operator="gpt_attention", kv_cache_dtype=np.float16).kv_cache_dtype \
        == "float16"
    with pytest.raises(TypeError, match="^model: expected a transformers PreTrainedModel"):
        Engine("llama")
    with pytest.raises(TypeError, match="^page_size: expected an int"):
        Engine(tiny_model("llama", layers=1), page_size=4.0)


@pytest.fixture(scope="module")
def small_engine():
    return Engine(tiny_model("llama", layers=1), operator="onnx_attention")


@pytest.mark.parametrize("prompts,kwargs,error,match", [
    # text where token ids belong, whole or as one prompt: say to tokenize it
    (["hello"], {}, TypeError, r"^prompts: prompts\[0\] is text \('hello'\); the engine takes token ids: "
                               r"tokenize it first"),
    ("hello", {}, TypeError, r"^prompts: expected a list of token-id lists, got 'hello'"),
    ([[1, 2], [3, 97]], {}, ValueError, r"^prompts: token id 97 \(prompts\[1\]\[1\]\) is outside the model's "
                                        r"vocabulary \[0, 97\)"),
    ([[-1]], {}, ValueError, r"^prompts: token id -1 .*vocabulary \[0, 97\)"),
    ([[1, 2.0]], {}, TypeError, r"^prompts: prompts\[0\]\[1\] must be an int token id, got float 2.0"),
    ([[1], []], {}, ValueError, r"^prompts: prompts\[1\] is empty"),
    ([], {}, ValueError, "^prompts: expected at least one prompt"),
    ([np.array([1.0, 2.0])], {}, TypeError, r"^prompts: prompts\[0\] must hold integer token ids"),
    ([[1]], dict(max_new_tokens=0), ValueError, "^max_new_tokens: expected an int >= 1, got 0"),
    ([[1]], dict(max_new_tokens=2.5), TypeError, "^max_new_tokens: expected an int"),
    ([[1], [2]], dict(arrivals=[0]), ValueError, r"^arrivals: expected one step per prompt \(2\), got 1"),
    ([[1], [2]], dict(arrivals=[0, -1]), ValueError, r"^arrivals: expected steps >= 0, got -1 at arrivals\[1\]"),
    ([[1]], dict(arrivals=[0.5]), TypeError, r"^arrivals: expected int steps"),
    ([[1]], dict(on_step=3), TypeError, "^on_step: expected a callable"),
])
def test_bad_generate_arguments_say_what_to_pass(small_engine, prompts, kwargs, error, match):
    with pytest.raises(error, match=match):
        small_engine.generate(prompts, **kwargs)


def test_numpy_and_torch_prompts_are_token_ids(small_engine):
    want = small_engine.generate([[3, 14, 15]], 2).tokens
    assert small_engine.generate([np.array([3, 14, 15])], 2).tokens == want
    assert small_engine.generate([torch.tensor([3, 14, 15])], 2).tokens == want


def test_learned_positions_bound_the_request():
    """GPT-2 has n_positions learned positions (64 here): a request that would feed more is refused by name,
    before any step, instead of failing inside torch's embedding lookup."""
    engine = Engine(tiny_model("gpt2", layers=1), operator="onnx_attention")
    assert engine.position_limit() == 64 and Engine(tiny_model("llama", layers=1)).position_limit() is None
    engine.check_requests([list(range(60))], 5)                       # positions 0..63: the whole table
    with pytest.raises(ValueError, match=r"^max_new_tokens: 6 new tokens after a 60-token prompt need 65 positions"
                                         r", more than the model's 64 learned positions; expected max_new_tokens "
                                         r"<= 5"):
        engine.generate([list(range(60))], 6)
    with pytest.raises(ValueError, match=r"^prompts: prompts\[0\] has 65 tokens"):
        engine.generate([[1] * 65], 1)


def run_command(capsys, *argv):
    """`python -m cacheattn hf ...` in this process: (exit status, stdout, stderr)."""
    from cacheattn.__main__ import main
    status = main(["hf", *argv])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("argv,message", [
    (["/no/such/dir"], "error: no such checkpoint directory '/no/such/dir'; expected an existing directory "
                       "(config.json and weights) or a family: bart, gemma2, gpt2, gpt_neox, llama, mistral, phi, "
                       "qwen2, t5"),
    (["lama"], "error: 'lama' is neither a family nor a checkpoint directory; expected a family (bart, gemma2, "),
    (["llama", "--prompt", "hello there"], "error: --prompt 'hello there': text needs a checkpoint directory with "
                                           "a tokenizer; a family (llama) takes token ids, e.g. --prompt 3,14,15"),
    (["llama", "--prompt", "1,2,500"], "error: --prompt: token id 500 (prompts[0][2]) is outside the model's "
                                       "vocabulary [0, 97)"),
    (["llama", "--arrivals", "0,x"], "error: --arrivals: expected one step >= 0 per prompt, like '0,0,2', got "
                                     "'0,x'"),
    (["llama", "--arrivals", "0,1"], "error: --arrivals: expected one step per prompt (3), got 2"),
    (["llama", "--page-size", "0"], "error: --page-size: expected an int >= 1, got 0"),
    (["llama", "--max-new-tokens", "0"], "error: --max-new-tokens: expected an int >= 1, got 0"),
    (["llama", "--operator", "onnx_attention", "--kv-cache-dtype", "int8"], "error: --kv-cache-dtype: "
                                                                            "onnx_attention has no 'int8' cache"),
    (["gemma2"], "error: attention logit softcapping (softcap=2, layer 0): multi_head_cache_attention cannot"),
])
def test_command_line_mistakes_are_one_line_and_exit_2(capsys, argv, message):
    status, out, err = run_command(capsys, *argv, "--layers", "1")
    assert status == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), lines


def test_a_checkpoint_without_a_tokenizer_asks_for_token_ids(tmp_path, capsys):
    tiny_model("phi", layers=1).save_pretrained(tmp_path)             # weights and config, no tokenizer
    status, _, err = run_command(capsys, str(tmp_path), "--prompt", "hello there")
    last = err.strip().splitlines()[-1]                 # after transformers' progress bars
    assert status == 2 and "Traceback" not in err
    assert last.startswith(f"error: --prompt 'hello there': text needs the checkpoint's tokenizer, and {tmp_path} "
                           f"has none (tokenizer.json, ")
    assert last.endswith("pass token ids instead, e.g. --prompt 3,14,15")
    (tmp_path / "config.json").unlink()
    status, _, err = run_command(capsys, str(tmp_path))
    assert status == 2 and err.strip().splitlines()[-1].startswith(
        f"error: '{tmp_path}' has no config.json: not a transformers checkpoint")


def test_a_bug_keeps_its_traceback(monkeypatch):
    """Only the user's mistakes become one line: an exception of another kind leaves the command as it is."""
    from cacheattn.__main__ import main
    from cacheattn.hf import engine

    def broken(self, *args, **kwargs):
        raise IndexError("a bug")
    monkeypatch.setattr(engine.Engine, "generate", broken)
    with pytest.raises(IndexError, match="a bug"):
        main(["hf", "llama", "--layers", "1"])


# Half and quantized caches against the float32 run of the same engine: the logit error within the derived
# bound (cacheattn.hf.models.logit_bound) and no top-1 flip where the float32 margin exceeds twice the bound.
LOW = [("llama", op, dt) for op in KV_DTYPES for dt in KV_DTYPES[op][1:]] + \
      [("gemma2", "gpt_attention", "int8"), ("gemma2", "onnx_attention", "bfloat16"),
       ("t5", "multi_head_cache_attention", "int4"), ("t5", "gpt_attention", "fp8")]


@pytest.mark.parametrize("family,operator,dtype", LOW)
def test_half_and_quantized_caches_within_the_derived_bound(family, operator, dtype):
    model = tiny_model(family)
    float32 = Engine(model, operator=operator, page_size=4)
    float32._record = np.zeros(len(float32.layers))         # the largest |K|, |V| each layer stores
    base = float32.generate(PROMPTS, NEW, arrivals=ARRIVALS)
    # TensorRT-LLM's per-tensor scales from the whole run's amax, 10% over it (the quantized run's later layers see
    # slightly different inputs): the bound assumes nothing is clipped (scales calibrated on the prompts alone may
    # clip generated tokens: the saturation test below).
    top = {"int8": 127, "fp8": 448}.get(dtype) if operator == "gpt_attention" else None
    scales = list(1.1 * float32._record / top) if top else None
    engine = Engine(model, operator=operator, kv_cache_dtype=dtype, page_size=4, quant_group=4, kv_scales=scales)
    res = engine.generate(PROMPTS, NEW, arrivals=ARRIVALS)
    bound = logit_bound(dtype, len(engine.layers))
    assert res.saturated == 0
    for i in range(len(PROMPTS)):
        _, agreement, err = compare(res.tokens[i], res.logits[i], base.tokens[i], base.logits[i])
        assert err <= bound, f"prompt {i}: logit error {err:.3g} > bound {bound:.3g} ({dtype}, agreement {agreement})"
        assert not margin_violations(res.tokens[i], res.logits[i], base.tokens[i], base.logits[i], bound)
    if dtype != "float32":
        assert any(not np.array_equal(a, b) for a, b in zip(res.logits, base.logits))   # the format took effect


def test_saturation_is_counted_and_whole_run_scales_restore_the_bound():
    """Qwen2's generated tokens carry larger K than its prompts: scales calibrated on the prompts clip them (and
    the logit error leaves the bound); scales from the whole run's amax clip nothing and keep it."""
    model = tiny_model("qwen2")
    full = Engine(model, operator="gpt_attention", page_size=4)
    full._record = np.zeros(len(full.layers))
    base = full.generate(PROMPTS, 6, arrivals=ARRIVALS)
    calibrated = Engine(model, operator="gpt_attention", kv_cache_dtype="int8", page_size=4)
    assert calibrated.generate(PROMPTS, 6, arrivals=ARRIVALS).saturated > 0
    whole = Engine(model, operator="gpt_attention", kv_cache_dtype="int8", page_size=4,
                   kv_scales=list(1.1 * full._record / 127)).generate(PROMPTS, 6, arrivals=ARRIVALS)
    assert whole.saturated == 0
    bound = logit_bound("int8", len(full.layers))
    for i in range(len(PROMPTS)):
        assert compare(whole.tokens[i], whole.logits[i], base.tokens[i], base.logits[i])[2] <= bound


def test_tensorrt_llm_scales_calibrated_on_the_prompts_or_given():
    model = tiny_model("llama")
    engine = Engine(model, operator="gpt_attention", kv_cache_dtype="int8", page_size=4)
    scales = engine.calibrate(PROMPTS)
    # amax / 127 of the K/V each layer stores for the prompts, from the float32 cache's run.
    amax = np.zeros(len(engine.layers))
    probe = Engine(model, operator="gpt_attention", page_size=4)
    probe._record = amax
    probe.generate(PROMPTS, 1)
    assert np.allclose(scales, amax / 127) and (amax > 0).all()
    calibrated = engine.generate(PROMPTS, NEW, arrivals=ARRIVALS)
    given = Engine(model, operator="gpt_attention", kv_cache_dtype="int8", page_size=4, kv_scales=scales)
    again = given.generate(PROMPTS, NEW, arrivals=ARRIVALS)
    assert all(np.array_equal(a, b) for a, b in zip(calibrated.logits, again.logits))
    coarse = Engine(model, operator="gpt_attention", kv_cache_dtype="int8", page_size=4, kv_scales=100 * max(scales))
    assert not np.array_equal(coarse.generate(PROMPTS[:1], 2).logits[0], calibrated.logits[0][:2])
    with pytest.raises(ValueError, match="kv_scales"):
        Engine(model, operator="gpt_attention", kv_cache_dtype="fp8", kv_scales=0.0).generate(PROMPTS, 1)


@pytest.mark.simulator
@pytest.mark.parametrize("family,operator", [("llama", "multi_head_cache_attention"), ("mistral", "gpt_attention"),
                                             ("qwen2", "onnx_attention"), ("bart", "gpt_attention")])
def test_kernels_give_the_reference_tokens(family, operator):
    """backend="numba" (the simulator here): the same tokens as the reference (bart: cross_attention too)."""
    model = tiny_model(family, layers=1)
    prompts, arrivals = [[3, 14, 15, 9, 2], [6, 5]], [0, 1]
    want = Engine(model, operator=operator, page_size=4).generate(prompts, 3, arrivals=arrivals)
    got = Engine(model, operator=operator, page_size=4, backend="numba").generate(prompts, 3, arrivals=arrivals)
    assert got.tokens == want.tokens
    for a, b in zip(got.logits, want.logits):
        assert np.abs(a - b).max() <= 1e-4 * max(1.0, np.abs(b).max())


@deep_only
@pytest.mark.simulator
def test_a_bfloat16_model_is_served_on_the_fast_kernels():
    """A bfloat16 cache at head_dim 32 on the kernels: the prompts' context steps run rung 6 (FlashAttention-2
    tiles, bfloat16 mma), the generated tokens rung 5's decode kernel (bfloat16 mma), and the tokens are the
    reference's, the logits within the bfloat16 bound of it."""
    from cacheattn.lab import recorder

    model = tiny_model("llama", layers=1, hidden_size=64, num_attention_heads=2, num_key_value_heads=1)
    prompts, arrivals = [[3, 14, 15, 9, 2], [6, 5]], [0, 1]
    options = dict(operator="gpt_attention", kv_cache_dtype="bfloat16", page_size=4)
    want = Engine(model, **options).generate(prompts, 3, arrivals=arrivals)
    with recorder.record() as recording:
        got = Engine(model, **options, backend="numba").generate(prompts, 3, arrivals=arrivals)
    kernels = {launch.kernel for launch in recording.launches}
    assert {"flash_attention_kernel", "gqa_decode_attention_kernel"} <= kernels, kernels
    assert got.tokens == want.tokens
    bound = logit_bound("bfloat16", 1)          # one layer
    assert all(np.abs(a - b).max() <= bound for a, b in zip(got.logits, want.logits))


@settings(max_examples=40 if WIDE else 10, deadline=None)
@given(data=st.data())
def test_random_configs_match_transformers(data):
    heads = data.draw(st.sampled_from([2, 4]), "heads")
    kv_heads = data.draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0]), "kv_heads")
    head_dim = data.draw(st.sampled_from([4, 8, 16]), "head_dim")
    # Window >= 2: with sliding_window=1 transformers' cached generate disagrees with its own uncached forward
    # (which the engine matches): its sliding cache keeps W - 1 = 0 past tokens.
    window = data.draw(st.one_of(st.none(), st.integers(2, 6)), "window")
    family = "mistral" if window else "llama"
    extra = dict(sliding_window=window) if window else {}
    model = tiny_model(family, seed=data.draw(st.integers(0, 99), "seed"), layers=data.draw(st.integers(1, 2)),
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                       hidden_size=heads * head_dim, **extra)
    prompts = data.draw(st.lists(st.lists(st.integers(0, 96), min_size=1, max_size=7), min_size=1, max_size=3))
    arrivals = data.draw(st.lists(st.integers(0, 3), min_size=len(prompts), max_size=len(prompts)), "arrivals")
    operator, cache = data.draw(st.sampled_from(PAIRS), "operator")
    page_size = data.draw(st.sampled_from([1, 2, 4]), "page_size")
    res = Engine(model, operator=operator, cache=cache, page_size=page_size).generate(prompts, 3, arrivals=arrivals)
    for i, p in enumerate(prompts):
        tokens, logits = hf_generate(model, p, 3)
        same, _, err = compare(res.tokens[i], res.logits[i], tokens, logits)
        assert same and err <= 1e-4, (i, res.tokens[i], tokens, err)


def test_local_checkpoint_and_text_prompts_through_the_command(tmp_path, capsys):
    """from_pretrained(local dir) serves the same tokens; `python -m cacheattn hf DIR --prompt TEXT` tokenizes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from cacheattn.__main__ import main
    from cacheattn.hf.models import load
    model = tiny_model("phi")          # (a qwen2 config would make AutoTokenizer pick Qwen2's BPE tokenizer class)
    model.save_pretrained(tmp_path)
    words = ["<unk>", "the", "cache", "holds", "keys", "and", "values"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(tmp_path)
    loaded = load(str(tmp_path))
    want = Engine(model, operator="onnx_attention").generate(PROMPTS, 3).tokens
    assert Engine(loaded, operator="onnx_attention").generate(PROMPTS, 3).tokens == want
    assert main(["hf", str(tmp_path), "--prompt", "the cache holds keys", "--prompt", "1,2,3",
                 "--operator", "gpt_attention", "--cache", "contiguous", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "PhiForCausalLM, gpt_attention (contiguous, float32, reference)" in out
    assert out.count("identical") == 2 and max(len(line) for line in out.splitlines()) <= 80


def test_bench_hf_runs_both_sides(capsys):
    from cacheattn.hf.bench import bench_hf
    rows = bench_hf(tiny=True, rounds=1)
    assert [r[0] for r in rows] == ["transformers eager", *CACHE_KINDS]
    assert all(r[2] <= r[1] <= r[3] for r in rows) and rows[0][4] == rows[0][5] == 1.0
    out = capsys.readouterr().out
    assert "x med" in out and max(len(line) for line in out.splitlines()) <= 80


def test_a_model_outside_the_attention_interface_is_refused():
    """BLOOM computes its attention inline (ALiBi), never through the interface: refused, not served by HF."""
    import transformers
    config = transformers.BloomConfig(vocab_size=97, hidden_size=32, n_layer=1, n_head=4)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="attention interface"):
        Engine(model, operator="gpt_attention")


@pytest.mark.parametrize("operator", ["multi_head_cache_attention", "gpt_attention"])
def test_finished_requests_give_their_pages_back(operator):
    """A pool of two pages serves three requests of two pages each, one after another, only if each finished
    request's pages return; the tokens are those each request gets alone."""
    model = tiny_model("llama", layers=1)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15]]
    engine = Engine(model, operator=operator, page_size=4, num_pages=2)
    res = engine.generate(prompts, 2, arrivals=[0, 3, 6])
    alone = [Engine(model, operator=operator, page_size=4).generate([p], 2).tokens[0] for p in prompts]
    assert res.tokens == alone
    with pytest.raises(RuntimeError, match="exhausted"):
        engine.generate(prompts, 2)                      # all three at once need six pages

"""cacheattn.convert's gather and scatter kernels (kernels_numba/convert.py) against its NumPy path, in the
simulator: for every format variant, importing a random sequence writes the same bytes (codes, group scales, and
nothing else), exporting gives the same values (as float32), and re-importing an exported quantized sequence
copies its codes bit for bit. On a real GPU the same runs with CuPy caches."""

from __future__ import annotations

import numpy as np
import pytest
from convert_formats import as_bytes, free_pages, make, random_kv, stored
from hypothesis import given, settings

from cacheattn import convert

from strategies import KERNEL, convert_shapes, convert_variants, st

NOT_HF = convert_variants().filter(lambda v: v[0] != "hf")


def _export(layout, tokens, positions, backend):
    cache = layout.export_cache(tokens, positions)
    with convert._core.backend(backend):
        return convert._call(cache.module.export, cache.arguments, sequence=1, layer_idx=layout.layer_idx)


def _as_float32(x):
    return np.asarray(x).astype(np.float32)


@pytest.mark.simulator
@settings(max_examples=KERNEL, deadline=None)
@given(variant=NOT_HF, shape=convert_shapes(), again=st.booleans())
def test_kernels_write_and_read_what_numpy_does(variant, shape, again):
    fmt = variant[0]
    kv = random_kv(np.random.default_rng(shape["seed"]), shape["heads"], shape["head_dim"], shape["tokens"])
    caches = {b: make(variant, shape, kv, np.random.default_rng(shape["seed"] + 1), kv.tokens)
              for b in ("reference", "numba")}
    got = {}
    for backend, layout in caches.items():
        convert.import_(fmt, kv, sequence=1, layer_idx=layout.layer_idx, **layout.args, **free_pages(layout),
                        backend=backend)
        got[backend] = _export(layout, kv.tokens, kv.positions, backend)
    for name, array in caches["reference"].byte_arrays().items():
        assert np.array_equal(as_bytes(array), as_bytes(caches["numba"].byte_arrays()[name])), (variant, name)
    ref, ker = got["reference"], got["numba"]
    np.testing.assert_array_equal(_as_float32(ker.key), _as_float32(ref.key))
    np.testing.assert_array_equal(_as_float32(ker.value), _as_float32(ref.value))
    if ref.quant is not None:                    # the codes and group scales, bit for bit
        for a, b in zip(stored(ker), stored(ref)):
            assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)), variant
    if again and ker.quant is not None:
        # The kernels' own export, imported into a fresh cache of the same rule: the codes are copied.
        fresh = make(variant, shape, kv, np.random.default_rng(shape["seed"] + 2), ker.tokens)
        convert.import_(fmt, ker, sequence=1, layer_idx=fresh.layer_idx, **fresh.args, **free_pages(fresh),
                        backend="numba")
        twice = _export(fresh, ker.tokens, ker.positions, "reference")
        for a, b in zip(stored(twice), stored(ref)):
            assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)), variant


@pytest.mark.gpu
def test_cupy_caches_convert_on_the_device():
    import cupy
    rng = np.random.default_rng(0)
    kv = random_kv(rng, 2, 16, 7)
    key_cache = np.zeros((4, 2, 4, 4, 4), np.float32)
    value_cache = np.zeros((4, 2, 16, 4), np.float32)
    tables = np.array([[2, 0], [1, 3]], np.int32)
    host = dict(key_cache=key_cache, value_cache=value_cache, block_tables=tables)
    device = {n: cupy.asarray(a) for n, a in host.items()}
    convert.import_("vllm", kv, sequence=0, **host)
    convert.import_("vllm", kv, sequence=0, **device)
    for n in host:
        np.testing.assert_array_equal(device[n].get(), host[n])
    back = convert.export("vllm", sequence=0, seq_lens=np.array([7, 0]), **device)
    np.testing.assert_array_equal(back.key.get(), kv.key)

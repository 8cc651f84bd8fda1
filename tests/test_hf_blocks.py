"""cacheattn.hf.blocks: the page and slot managers (no torch needed), and `import cacheattn` without the hf
extra's packages."""

import subprocess
import sys

import pytest

from cacheattn.hf.blocks import PagedKVManager, SlotKVManager


def test_paged_manager_builds_the_documents_index_tensors():
    pages = PagedKVManager(num_pages=8, page_size=4)
    pages.add("a", 5)
    pages.add("b", 2)
    pages.reserve("a", 5)
    pages.reserve("b", 2)
    pages.advance(["a", "b"], [5, 2])                      # their prompts ran; c joins while they decode
    pages.add("c", 7)
    for name, total in (("a", 6), ("b", 3), ("c", 7)):
        pages.reserve(name, total)
    step = pages.layout(["a", "b", "c"], [1, 1, 7])
    # docs/ppl.md's hand-built example has the same shape: seqstarts from seqlens, kvstarts from past + seqlen.
    assert step.seqstarts.tolist() == [0, 1, 2, 9] and step.kvstarts.tolist() == [0, 6, 9, 16]
    assert step.decoding_batches == 2 and step.max_seqlen == 7 and step.max_kvlen == 7
    table = step.cachestarts()
    assert table.shape == (3, 2) and table[1, 1] == -1
    assert sorted(p for row in pages.pages.values() for p in row) == list(range(5))     # no page twice
    assert (table[table >= 0] % 4 == 0).all()
    offsets = step.kv_cache_block_offsets(num_layers=3)
    assert offsets.shape == (1, 3, 2, 2)
    assert offsets[0, 0, 1, 0] == pages.pages["a"][0] * 3 * 2 + 1         # block * num_layers * 2 + kv
    assert step.host_request_types.tolist() == [1, 1, 0] and step.context_lengths.tolist() == [5, 2, 7]
    assert step.sequence_length.tolist() == [6, 3, 7]
    with pytest.raises(ValueError, match="context requests must come before"):
        step.check_context_first()
    freed = list(pages.pages["a"])
    pages.release("a")
    pages.add("d", 3)
    pages.reserve("d", 3)
    assert pages.pages["d"] == freed[:1]                 # freed pages are handed out first
    with pytest.raises(RuntimeError, match="exhausted"):
        pages.reserve("d", 100)


def test_slot_manager_gives_each_request_one_region():
    slots = SlotKVManager(num_slots=2, slot_tokens=10)
    slots.add("a", 4)
    slots.add("b", 3)
    step = slots.layout(["b", "a"], [3, 4])
    assert step.cachestarts().tolist() == [10, 0] and step.slots.tolist() == [1, 0]
    with pytest.raises(RuntimeError, match="no free cache slot"):
        slots.add("c", 1)
    with pytest.raises(RuntimeError, match="a slot holds 10"):
        slots.reserve("a", 11)
    slots.release("a")
    slots.add("c", 2)
    assert slots.slot["c"] == 0


def test_import_cacheattn_needs_neither_torch_nor_transformers():
    code = "import sys, cacheattn, cacheattn.hf, cacheattn.hf.blocks; " \
           "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)

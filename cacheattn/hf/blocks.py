"""The cache bookkeeping a server keeps beside the operators: which pages (or which slot) each request owns, and
the index tensors each operator's document asks for, built from that.

Needs neither torch nor transformers: a user who calls an operator by hand gets `seqstarts`, `kvstarts`,
`cachestarts` (OpenPPL), `kv_cache_block_offsets`, `sequence_length`, `host_request_types`, ... (TensorRT-LLM)
from here instead of writing them out as the docs pages do.

    pages = PagedKVManager(num_pages=64, page_size=16)
    pages.add("a", prompt_len=5); pages.add("b", prompt_len=3)
    pages.reserve("a", 6); pages.reserve("b", 3)                # tokens in the cache after this step
    step = pages.layout(["a", "b"], seqlens=[1, 3])             # a decodes one token, b runs its prompt
    step.seqstarts, step.kvstarts, step.cachestarts(), step.kv_cache_block_offsets(num_layers=2)

Two managers: `PagedKVManager` (pages from a free list; OpenPPL cache_mode 1, TensorRT-LLM's paged pool) and
`SlotKVManager` (one fixed-length region per request; OpenPPL cache_mode 0 and TensorRT-LLM's contiguous cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class PagePool:
    """A free list of page numbers; a request takes pages as its tokens need them and gives them all back."""

    def __init__(self, num_pages: int):
        self.free = list(range(num_pages))
        self.in_use = 0
        self.peak = 0

    def take(self) -> int:
        if not self.free:
            raise RuntimeError("the page pool is exhausted: give the manager more pages (num_pages)")
        self.in_use += 1
        self.peak = max(self.peak, self.in_use)
        return self.free.pop(0)

    def give_back(self, pages: list) -> None:
        self.free[:0] = pages            # reused first, as a server's allocator hands out recently freed pages
        self.in_use -= len(pages)


def prefix_starts(lengths) -> np.ndarray:
    """[0, l0, l0 + l1, ...] (int64): OpenPPL's seqstarts / kvstarts from per-request lengths."""
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, np.int64))]).astype(np.int64)


@dataclass
class BatchLayout:
    """One call's batch, requests in call order. seqlens: new tokens this call; past: tokens already cached
    (OpenPPL start_pos, TensorRT-LLM host_past_key_value_lengths); prompt_lens: each request's prompt length.
    pages: per request its page numbers (paged) or None; slots: per request its slot (slot manager) or None."""
    seqlens: np.ndarray
    past: np.ndarray
    prompt_lens: np.ndarray
    page_size: int
    pages: list | None = None
    slots: np.ndarray | None = None
    slot_tokens: int = 0

    # --- OpenPPL (ppl-multi-head-cache-attention.md) ---
    @property
    def kvlens(self) -> np.ndarray:
        return self.past + self.seqlens

    @property
    def seqstarts(self) -> np.ndarray:
        return prefix_starts(self.seqlens)

    @property
    def kvstarts(self) -> np.ndarray:
        return prefix_starts(self.kvlens)

    @property
    def start_pos(self) -> np.ndarray:
        return self.past.astype(np.int64)

    @property
    def decoding_batches(self) -> int:
        """Leading requests that decode (cached tokens, one new token); OpenPPL wants them first."""
        decoding = (self.past > 0) & (self.seqlens == 1)
        count = int(np.argmin(decoding)) if not decoding.all() else len(decoding)
        if decoding[count:].any():
            raise ValueError("decoding_batches: the decoding requests must come first in the call order")
        return count

    @property
    def max_seqlen(self) -> int:
        return int(self.seqlens.max())

    @property
    def max_kvlen(self) -> int:
        return int(self.kvlens.max())

    def cachestarts(self) -> np.ndarray:
        """cache_mode 1: (B, max pages) token offsets of each request's pages (page * page_size), -1 unused;
        cache_mode 0 (slot manager): (B,) the first token offset of each request's slot."""
        if self.pages is None:
            return (self.slots * self.slot_tokens).astype(np.int64)
        table = np.full((len(self.pages), max(len(p) for p in self.pages)), -1, np.int64)
        for b, pages in enumerate(self.pages):
            table[b, :len(pages)] = np.asarray(pages, np.int64) * self.page_size
        return table

    # --- TensorRT-LLM (trtllm-gpt-attention.md) ---
    def kv_cache_block_offsets(self, num_layers: int) -> np.ndarray:
        """(1, B, 2, max blocks) int32 as TensorRT-LLM's KV cache manager writes them: block * num_layers * 2 + kv
        (the plugin adds 2 * layer_idx), so the pool is (num_pages, num_layers, 2, Hkv, page_size, Dh)."""
        width = max(len(p) for p in self.pages)
        offsets = np.zeros((1, len(self.pages), 2, width), np.int32)
        for b, pages in enumerate(self.pages):
            for kv in range(2):
                offsets[0, b, kv, :len(pages)] = np.asarray(pages) * num_layers * 2 + kv
        return offsets

    @property
    def host_request_types(self) -> np.ndarray:
        """RequestType per entry: context 0 (first call for the request: its prompt), generation 1."""
        return (self.past > 0).astype(np.int32)

    @property
    def sequence_length(self) -> np.ndarray:
        return self.kvlens.astype(np.int32)

    @property
    def host_past_key_value_lengths(self) -> np.ndarray:
        return self.past.astype(np.int32)

    @property
    def context_lengths(self) -> np.ndarray:
        """New tokens of a context request, the prompt length of a generation request."""
        return np.where(self.past > 0, self.prompt_lens, self.seqlens).astype(np.int32)

    def check_context_first(self) -> None:
        if (np.diff(self.host_request_types) < 0).any():
            raise ValueError("host_request_types: context requests must come before generation requests")


class _Manager:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self.cached: dict = {}           # request -> tokens in the cache
        self.prompt_lens: dict = {}

    def add(self, request, prompt_len: int) -> None:
        """A request joins; its prompt (prompt_len tokens) goes into the cache on its first call."""
        if request in self.cached:
            raise ValueError(f"request {request!r} is already in the cache")
        self.cached[request] = 0
        self.prompt_lens[request] = int(prompt_len)

    def layout(self, order, seqlens) -> BatchLayout:
        """The call's batch: requests in call order, seqlens new tokens each; reserve() them first."""
        seqlens = np.asarray(seqlens, np.int64)
        past = np.array([self.cached[r] for r in order], np.int64)
        return BatchLayout(seqlens, past, np.array([self.prompt_lens[r] for r in order], np.int64), self.page_size,
                           **self._where(order))

    def advance(self, order, seqlens) -> None:
        """After the call: the new tokens are cached."""
        for r, n in zip(order, seqlens):
            self.cached[r] += int(n)


class PagedKVManager(_Manager):
    """Pages of page_size tokens from a free list of num_pages; a request takes pages as its tokens need them."""

    def __init__(self, num_pages: int, page_size: int):
        super().__init__(page_size)
        self.pool = PagePool(num_pages)
        self.pages: dict = {}

    def add(self, request, prompt_len: int) -> None:
        super().add(request, prompt_len)
        self.pages[request] = []

    def reserve(self, request, total_tokens: int) -> None:
        """Enough pages for total_tokens cached tokens (the request's length after this step)."""
        need = -(-int(total_tokens) // self.page_size)
        pages = self.pages[request]
        pages += [self.pool.take() for _ in range(need - len(pages))]

    def release(self, request) -> None:
        """The request is done: its pages go back to the pool."""
        self.pool.give_back(self.pages.pop(request))
        del self.cached[request], self.prompt_lens[request]

    def _where(self, order):
        return dict(pages=[list(self.pages[r]) for r in order])


class SlotKVManager(_Manager):
    """num_slots regions of slot_tokens tokens each; a request owns one slot from join to release (OpenPPL's
    offset cache: cachestarts[b] = slot * slot_tokens; TensorRT-LLM's contiguous cache: row = slot)."""

    def __init__(self, num_slots: int, slot_tokens: int):
        super().__init__(page_size=slot_tokens)
        self.slot_tokens = slot_tokens
        self.free = list(range(num_slots))
        self.slot: dict = {}

    def add(self, request, prompt_len: int) -> None:
        if not self.free:
            raise RuntimeError("no free cache slot: give the manager more slots (num_slots)")
        super().add(request, prompt_len)
        self.slot[request] = self.free.pop(0)

    def reserve(self, request, total_tokens: int) -> None:
        if total_tokens > self.slot_tokens:
            raise RuntimeError(f"request {request!r} needs {total_tokens} tokens, a slot holds {self.slot_tokens}")

    def release(self, request) -> None:
        self.free.insert(0, self.slot.pop(request))
        del self.cached[request], self.prompt_lens[request]

    def _where(self, order):
        return dict(slots=np.array([self.slot[r] for r in order], np.int64), slot_tokens=self.slot_tokens)

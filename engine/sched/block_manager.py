"""Blocks of the paged KV cache: allocation, reference counts, and prefix caching.

Invariants:
- every block is either in use (``ref_count > 0``) or in ``_free`` (``ref_count == 0``), never both;
- ``_by_hash[h] == b`` only while block ``b`` holds the complete, already written KV of the
  tokens whose prefix-chain hash is ``h``;
- a free block keeps its hash, so a later request can still reuse it, until it is handed
  out for new data; free blocks are handed out least recently freed first (LRU eviction).
"""
from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from engine.sched.sequence import Sequence


def chain_hash(parent: bytes | None, token_ids: list[int]) -> bytes:
    """Hash of a full block given its parent block's hash: equal hashes mean equal prefixes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(array("q", token_ids).tobytes())  # a third of the time of their decimal text
    return h.digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: list[int] = field(default_factory=list)  # kept to rule out hash collisions


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up in the prefix cache
    hits: int = 0  # of those, tokens found cached


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[bytes, int] = {}
        # request_id -> hashes of the sequence's full, written blocks, in order
        self._seq_hashes: dict[str, list[bytes]] = {}
        self.stats = PrefixCacheStats()
        # Called with the ids of blocks handed out for new data (the contamination gate poisons them).
        self.on_allocate = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def match_prefix(self, seq: Sequence) -> int:
        """On admission: takes the cached blocks of the longest cached prefix and marks those tokens computed.

        The last token is never taken from the cache, since its logits are needed.
        """
        assert not seq.block_table, "match_prefix is for a sequence that holds no blocks"
        hashes: list[bytes] = []
        self._seq_hashes[seq.request_id] = hashes
        if not self.enable_prefix_caching:
            return 0
        tokens = seq.token_ids
        usable = (len(tokens) - 1) // self.block_size
        self.stats.queries += len(tokens)
        parent = None
        for i in range(usable):
            chunk = tokens[i * self.block_size : (i + 1) * self.block_size]
            h = self._hash(parent, chunk)
            bid = self._by_hash.get(h)
            if bid is None or self.blocks[bid].token_ids != chunk:
                break
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self._free[bid]
            block.ref_count += 1
            seq.block_table.append(bid)
            hashes.append(h)
            parent = h
        cached = len(seq.block_table) * self.block_size
        self.stats.hits += cached
        seq.num_computed_tokens = cached
        seq.num_cached_tokens = cached
        return cached

    def _hash(self, parent: bytes | None, token_ids: list[int]) -> bytes:
        return chain_hash(parent, token_ids)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def ensure_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Gives ``seq`` enough blocks to hold ``num_tokens`` tokens; all or nothing."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self._free):
            return False
        first_new = len(seq.block_table)
        for _ in range(need):
            bid, _ = self._free.popitem(last=False)
            block = self.blocks[bid]
            if block.hash is not None:  # evict: its old content is about to be overwritten
                if self._by_hash.get(block.hash) == bid:
                    del self._by_hash[block.hash]
                block.hash, block.token_ids = None, []
            block.ref_count = 1
            seq.block_table.append(bid)
        if need and self.on_allocate is not None:
            self.on_allocate(seq.block_table[first_new:])
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Releases the sequence's blocks beyond those ``num_tokens`` tokens need (after rejected draft tokens:
        those blocks hold no computed token, so no prefix hash covers them)."""
        keep = -(-num_tokens // self.block_size)
        while len(seq.block_table) > keep:
            bid = seq.block_table.pop()
            block = self.blocks[bid]
            block.ref_count -= 1
            assert block.ref_count == 0 and block.hash is None, "a trimmed block is the sequence's own and unhashed"
            self._free[bid] = None
            self._free.move_to_end(bid, last=False)  # handed out first: it holds no prefix anyone could reuse

    def commit(self, seq: Sequence) -> None:
        """After a step: registers the sequence's newly completed blocks in the prefix cache."""
        hashes = self._seq_hashes.setdefault(seq.request_id, [])
        full = seq.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or len(hashes) >= full:
            return
        tokens = seq.token_ids
        for i in range(len(hashes), full):
            chunk = tokens[i * self.block_size : (i + 1) * self.block_size]
            h = self._hash(hashes[-1] if hashes else None, chunk)
            hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h not in self._by_hash and block.hash is None:
                block.hash, block.token_ids = h, chunk
                self._by_hash[h] = block.block_id

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (after a forward swap, cached KV was computed by other kernels).

        Blocks in use stay with their sequences but are no longer findable, and the blocks those
        sequences complete later chain from unmatchable hashes, so mixed KV is never shared.
        """
        for block in self.blocks:
            block.hash, block.token_ids = None, []
        self._by_hash.clear()
        for hashes in self._seq_hashes.values():
            hashes[:] = [os.urandom(16) for _ in hashes]

    def free(self, seq: Sequence) -> None:
        """Releases the sequence's blocks, tail first, so a shared prefix outlives its suffixes in the LRU."""
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self._free[bid] = None
        seq.block_table = []
        self._seq_hashes.pop(seq.request_id, None)

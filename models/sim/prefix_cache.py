"""vLLM V1's automatic prefix caching over one replica's KV block pool.

Mirrors `vllm/v1/core/block_pool.py` and `kv_cache_manager.py` (0.33) for one full-attention
group:
- A request's content is a list of segments `(content_id, tokens)`: equal ids mean equal
  tokens (the Mooncake trace's `hash_ids` of 512-token blocks, a conversation's turns, or a
  fresh id per request); its generated tokens follow as `OUTPUT_ID` content.
- Block hashes chain over full blocks: block j's hash is `hash((hash of block j-1, the
  pieces of content in tokens [j*bs, (j+1)*bs)))`, so equal hashes mean equal prefixes.
- Blocks are cached (hash -> block) when they are allocated for tokens whose content is
  known (vLLM's `cache_blocks` in `allocate_slots`), and stay cached after their request
  frees them until the block is handed out again.
- A WAITING request's admission looks up its longest run of cached leading blocks, at most
  `(num_tokens - 1) // bs` of them (the last token is always computed); hit blocks are
  shared (reference counted), and a hit block that was free leaves the free queue.
- Free queue: freed blocks go back in reverse order (a request's tail first); hashed ones to
  the end (evicted last, least recently used first), unhashed ones to the front (reused
  first); allocation takes blocks from the front and evicts their hashes.

Hashes are Python's hash of int tuples, which is deterministic across processes. A request
whose content is all its own (ids below `OUTPUT_ID`, given by the engine) can only ever hit
its own blocks (after a preemption): its blocks are marked cached without hashing, and it
remembers which blocks it freed, and their queue stamp, to find them again if no one has
taken them since. The free queue's order, and so every eviction, is the same either way.
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np
from borrowd.models.sim.request import Request

OUTPUT_ID = -1  # content id of generated tokens (their tokens are what the model sampled)
NO_HASH = 0
PRIVATE = 1  # a cached block of content no other request has (not in the hash map)
SMALL = 8  # up to this many blocks, per-block Python beats numpy's call overhead


def is_private(req: Request) -> bool:
    """True when no other request can share `req`'s content (engine-given ids only)."""
    return all(content_id < OUTPUT_ID for content_id, _ in req.segments)


class BlockPool:
    """Reference-counted KV blocks with an LRU free queue and a hash -> blocks map.

    The free queue holds entries `stamp * num_blocks + block` in two lists: `_front`, a
    stack of blocks queued at the front (its end is the queue's head), then `_tail[_head:]`
    in order. A block taken out of the middle (a prefix hit) only loses its `free` flag, and
    a block queued again gets a new stamp, so stale entries are skipped when they come up.
    Per-block state is in numpy arrays so that long prompts' blocks are handed out and freed
    in bulk (slices, not one block at a time).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self._n = num_blocks
        self._front: list[int] = []
        self._tail: list[int] = list(range(num_blocks))
        self._head = 0
        self._stamp = np.zeros(num_blocks, dtype=np.int64)
        self._is_free = np.ones(num_blocks, dtype=np.bool_)
        self._num_free = num_blocks
        self._ref = np.zeros(num_blocks, dtype=np.int64)
        self._hash = np.zeros(num_blocks, dtype=np.int64)
        self._stale = 0  # queue entries of blocks taken out of the middle
        self._cached: dict[int, dict[int, None]] = {}
        self.hit_tokens = 0  # prompt tokens served from the cache at admissions

    @property
    def num_free(self) -> int:
        """Free blocks, cached ones (evictable) included, as vLLM counts them."""
        return self._num_free

    def free_order(self) -> list[int]:
        """The free blocks, next to be handed out first."""
        n = self._n
        return [e % n for e in [*self._front[::-1], *self._tail[self._head:]]
                if self._is_free[e % n] and self._stamp[e % n] == e // n]

    def is_free(self, block: int) -> bool:
        """True when `block` is in the free queue."""
        return bool(self._is_free[block])

    def num_cached_blocks(self) -> int:
        """Blocks that currently carry a hash."""
        return sum(len(blocks) for blocks in self._cached.values())

    def find_hits(self, req: Request, max_tokens: int) -> list[int]:
        """Block ids of the longest cached prefix of `req`, at most `max_tokens` long."""
        hits: list[int] = []
        n = max_tokens // self.block_size
        if is_private(req):
            stamp = self._stamp
            is_free = self._is_free
            for b, g in req.freed_blocks[:n]:
                if not is_free[b] or stamp[b] != g:
                    break
                hits.append(b)
            return hits
        cached = self._cached
        for j in range(n):
            blocks = cached.get(block_hash(req, j, self.block_size))
            if not blocks:
                break
            hits.append(next(iter(blocks)))
        return hits

    def num_evictable(self, block_ids: list[int]) -> int:
        """How many of `block_ids` sit in the free queue (touching them takes them out)."""
        ref = self._ref
        return sum(1 for b in block_ids if ref[b] == 0)

    def touch(self, req: Request, block_ids: list[int]) -> None:
        """Give `req` the cached blocks `block_ids` (its prefix hit) and count it."""
        ref = self._ref
        is_free = self._is_free
        for b in block_ids:
            if ref[b] == 0:
                is_free[b] = 0
                self._num_free -= 1
                self._stale += 1
            ref[b] += 1
        req.block_ids.extend(block_ids)
        req.num_cached_blocks = len(req.block_ids)
        self.hit_tokens += len(block_ids) * self.block_size

    def allocate(self, req: Request, count: int) -> None:
        """Hand `count` blocks from the front of the free queue to `req`, evicting them."""
        if count <= 0:
            return
        n = self._n
        entries = self._take(count)
        if self._stale:
            stamp = self._stamp
            is_free = self._is_free
            blocks: list[int] = []
            while True:
                for e in entries:
                    b = e % n
                    if is_free[b] and stamp[b] == e // n:
                        blocks.append(b)
                    else:
                        self._stale -= 1
                if len(blocks) == count:
                    break
                entries = self._take(count - len(blocks))
        else:
            blocks = [e % n for e in entries]
        hashes = self._hash
        if count <= SMALL:
            is_free = self._is_free
            ref = self._ref
            for b in blocks:
                is_free[b] = False
                ref[b] = 1
                h = hashes[b]
                if h == PRIVATE:
                    hashes[b] = NO_HASH
                elif h != NO_HASH:
                    self._evict(b)
            req.block_ids.extend(blocks)
            self._num_free -= count
            return
        idx = np.array(blocks, dtype=np.int64)
        self._is_free[idx] = False
        self._ref[idx] = 1
        held = hashes[idx]
        if held.any():
            hashes[idx[held == PRIVATE]] = NO_HASH
            for b in idx[(held != NO_HASH) & (held != PRIVATE)].tolist():
                self._evict(b)
        req.block_ids.extend(blocks)
        self._num_free -= count

    def _take(self, count: int) -> list[int]:
        """The next `count` queue entries (stale ones included), out of the queue."""
        front = self._front
        taken: list[int] = []
        if front:
            k = min(count, len(front))
            taken = front[:-k - 1:-1]
            del front[-k:]
            count -= k
        if count:
            head = self._head
            taken += self._tail[head:head + count]
            self._head = head + count
            if self._head > 4096 and self._head * 2 > len(self._tail):
                del self._tail[:self._head]
                self._head = 0
        return taken

    def cache(self, req: Request, num_tokens: int) -> None:
        """Cache `req`'s full blocks within its first `num_tokens` tokens."""
        bs = self.block_size
        full = min(num_tokens // bs, len(req.block_ids))
        start = req.num_cached_blocks
        if full <= start:
            return
        ids = req.block_ids
        if is_private(req):
            if full - start <= SMALL:
                hashes = self._hash
                for b in ids[start:full]:
                    hashes[b] = PRIVATE
            else:
                self._hash[ids[start:full]] = PRIVATE
            req.num_cached_blocks = full
            return
        for j in range(start, full):
            b = ids[j]
            h = block_hash(req, j, bs)
            if self._hash[b] != NO_HASH:
                self._evict(b)
            self._hash[b] = h
            blocks = self._cached.get(h)
            if blocks is None:
                self._cached[h] = {b: None}
            else:
                blocks[b] = None
        req.num_cached_blocks = full

    def release(self, req: Request, preempted: bool = False) -> None:
        """Free `req`'s blocks in reverse order (see the module docstring); a preempted
        request of its own content remembers its cached blocks to find them again."""
        ids = req.block_ids
        if not ids:
            return
        idx = np.array(ids[::-1], dtype=np.int64)
        ref = self._ref
        ref[idx] -= 1  # a request holds each block once
        freed = idx[ref[idx] == 0]
        self._is_free[freed] = True
        stamp = self._stamp
        stamp[freed] += 1
        entries = stamp[freed] * self._n + freed
        unhashed = self._hash[freed] == NO_HASH
        self._tail.extend(entries[~unhashed].tolist())
        self._front.extend(entries[unhashed][::-1].tolist())
        self._num_free += len(freed)
        if preempted and is_private(req):
            kept = ids[:req.num_cached_blocks]
            req.freed_blocks = list(zip(kept, stamp[kept].tolist(), strict=True))
        req.block_ids = []
        req.num_cached_blocks = 0

    def _evict(self, b: int) -> None:
        h = int(self._hash[b])
        blocks = self._cached[h]
        del blocks[b]
        if not blocks:
            del self._cached[h]
        self._hash[b] = NO_HASH


def block_hash(req: Request, j: int, block_size: int) -> int:
    """Hash of `req`'s block `j` (its hashes are memoised on the request)."""
    hashes = req.block_hashes
    while len(hashes) <= j:
        k = len(hashes)
        parent = hashes[-1] if hashes else NO_HASH
        hashes.append(hash((parent, *_pieces(req, k * block_size, (k + 1) * block_size))))
    return hashes[j]


def _pieces(req: Request, start: int, end: int) -> list[int]:
    """Content of tokens [start, end) as flat (id, first offset, length) triples; generated
    tokens have no offset (every sampled token of the simulator is the same)."""
    segments = req.segments
    starts = req.segment_starts
    out: list[int] = []
    pos = start
    i = bisect_right(starts, pos) - 1
    while pos < end:
        if i < len(segments):
            content_id, length = segments[i]
            seg_start = starts[i]
            if pos >= seg_start + length:
                i += 1
                continue
            take = min(end, seg_start + length) - pos
            offset = pos - seg_start
        else:
            content_id, take, offset = OUTPUT_ID, end - pos, 0
        if content_id == OUTPUT_ID:
            if len(out) >= 3 and out[-3] == OUTPUT_ID:
                out[-1] += take
            else:
                out += (OUTPUT_ID, 0, take)
        else:
            out += (content_id, offset, take)
        pos += take
        i += 1
    return out

"""The `sim` engine's prefix cache: an LRU of prompt blocks bounded by a KV-cache budget.

Modelled on vLLM's automatic prefix caching (docs.vllm.ai, "Automatic Prefix Caching"; the
design in `vllm/v1/core/kv_cache_utils.py`): a prompt is cut into blocks of
`block_tokens` tokens; a block is identified by the hash of its tokens chained to its
parent block's hash, so a block matches only with everything before it. Only full blocks
are cached. A new prompt's cached prefix is its longest run of leading blocks found in the
cache; at least its last token is always computed (vLLM does the same, to get the logits).
The least recently used blocks are evicted once the blocks exceed the budget; a prompt's
blocks are touched last-first, so a parent is always more recent than its children and
a prefix is evicted from its tail.

When a sequence finishes, the full blocks of its prompt and answer are cached too, as
vLLM does: the answer after an `assistant:` header, which is how the next turn's prompt
repeats it (`ChatRequest.prompt_text` joins `role: content` lines; a chat template puts
the assistant header in the generation prompt the same way). So a conversation's next turn
finds all of the previous turn but the last partial block.

Salted as vLLM's `cache_salt` is (`vllm/v1/core/kv_cache_utils.py`: the salt is an extra
key of a prompt's first block only, so every later block, chained to it, differs too): a
prompt's blocks match only blocks cached under the same salt, i.e. the same tenant's
(`shared/prefixes.py` `cache_salt`). Another tenant's prompt never hits them, so it cannot
learn from its own timing whether a prefix was cached.

The hit rate is tokens found / prompt tokens looked up over the last `window` requests, as
vLLM's `CachingMetrics` computes it (`vllm/v1/metrics/stats.py`, default 1000 requests).
"""

from __future__ import annotations

from collections import OrderedDict, deque

# vLLM's default KV-cache block size on CUDA (tokens per block).
BLOCK_TOKENS = 16
HIT_RATE_WINDOW = 1000
# How a finished answer continues its prompt in the next turn (`assistant: ` + answer).
ANSWER_HEADER = ("assistant", ":")


class PrefixCache:
    """Blocks of recent prompts, at most `capacity_tokens` tokens of them."""

    def __init__(
        self,
        capacity_tokens: int,
        *,
        block_tokens: int = BLOCK_TOKENS,
        window: int = HIT_RATE_WINDOW,
    ) -> None:
        if capacity_tokens < 0 or block_tokens < 1 or window < 1:
            raise ValueError("capacity_tokens >= 0, block_tokens >= 1, window >= 1")
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_tokens // block_tokens
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._recent: deque[tuple[int, int]] = deque(maxlen=window)  # (queried, hit)
        self._queried = 0
        self._hit = 0
        self.queried_total = 0  # prompt tokens looked up since the start
        self.hit_total = 0  # of which found cached

    def __len__(self) -> int:
        """Blocks held."""
        return len(self._blocks)

    def admit(self, tokens: list[str], salt: str | None = None) -> int:
        """Look a prompt's tokens up and cache its blocks under `salt`; the tokens found
        cached (under the same salt)."""
        hashes = self._hashes(tokens, salt)
        found = 0
        for h in hashes:
            if h not in self._blocks:
                break
            found += 1
        cached = min(found * self.block_tokens, max(0, len(tokens) - 1))
        self._count(len(tokens), cached)
        self._insert(hashes)
        return cached

    def store(self, tokens: list[str], salt: str | None = None) -> None:
        """Cache the full blocks of a finished sequence (prompt and answer); no lookup."""
        self._insert(self._hashes(tokens, salt))

    def _hashes(self, tokens: list[str], salt: str | None) -> list[int]:
        b = self.block_tokens
        hashes: list[int] = []
        parent = 0 if salt is None else hash(("cache_salt", salt))
        for start in range(0, len(tokens) - b + 1, b):
            parent = hash((parent, *tokens[start : start + b]))
            hashes.append(parent)
        return hashes

    def _insert(self, hashes: list[int]) -> None:
        if self.capacity_blocks <= 0:
            return
        for h in reversed(hashes[: self.capacity_blocks]):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)

    @property
    def hit_rate(self) -> float | None:
        """Share of looked-up prompt tokens found over the window; None before any lookup."""
        return None if self._queried == 0 else self._hit / self._queried

    def _count(self, queried: int, hit: int) -> None:
        if len(self._recent) == self._recent.maxlen:
            old_queried, old_hit = self._recent[0]
            self._queried -= old_queried
            self._hit -= old_hit
        self._recent.append((queried, hit))
        self.queried_total += queried
        self.hit_total += hit
        self._queried += queried
        self._hit += hit

"""The sim engine's prefix cache: blocks, LRU eviction, the hit rate, and a next turn's hit."""

from __future__ import annotations

from services.worker.engines.base import EngineDelta, EngineRequest
from services.worker.engines.sim import SimEngine
from services.worker.engines.sim_cache import PrefixCache
from services.worker.engines.sim_profiles import PROFILES, SimProfile, llama3_8b_kv_tokens
from shared.tokens import sim_split


def words(n: int, start: int = 0) -> list[str]:
    return [f"w{i}" for i in range(start, start + n)]


def test_a_repeated_prompt_finds_its_full_blocks_but_never_its_last_token() -> None:
    cache = PrefixCache(10_000, block_tokens=16)
    prompt = words(40)  # two full blocks and 8 tokens
    assert cache.admit(prompt) == 0
    assert cache.admit(prompt) == 32
    exact = words(32)
    assert cache.admit(exact) == 31  # all cached, but the last token is computed


def test_a_longer_prompt_finds_its_cached_prefix_and_a_changed_start_finds_none() -> None:
    cache = PrefixCache(10_000, block_tokens=16)
    cache.admit(words(48))
    assert cache.admit(words(48) + words(30, start=100)) == 48
    assert cache.admit(["other", *words(47)]) == 0  # a block matches only with its parents


def test_least_recently_used_blocks_go_first_and_a_prefix_goes_from_its_tail() -> None:
    cache = PrefixCache(4 * 16, block_tokens=16)  # four blocks
    a, b = words(48), words(32, start=500)
    cache.admit(a)  # three blocks
    cache.admit(b)  # two more: a's last block is evicted, not its first
    assert len(cache) == 4
    assert cache.admit(a) == 32


def test_hit_rate_is_tokens_found_over_tokens_looked_up_in_a_window() -> None:
    cache = PrefixCache(10_000, block_tokens=16, window=2)
    assert cache.hit_rate is None
    cache.admit(words(32))  # 0 of 32
    cache.admit(words(32))  # 31 of 32
    assert cache.hit_rate == 31 / 64
    cache.admit(words(32))  # the first lookup leaves the window
    assert cache.hit_rate == 62 / 64
    assert (cache.queried_total, cache.hit_total) == (96, 62)


def test_a_zero_budget_caches_nothing() -> None:
    cache = PrefixCache(0)
    cache.admit(words(64))
    assert cache.admit(words(64)) == 0


def test_profiles_hold_their_gpus_kv_cache() -> None:
    # (80 GiB x 0.9 - 16.06 GB of weights) / 128 KiB per token
    assert PROFILES["llama3-8b-h100"].prefix_cache_tokens == llama3_8b_kv_tokens(80 * 2**30)
    assert 460_000 < llama3_8b_kv_tokens(80 * 2**30) < 470_000


async def answer(engine: SimEngine, rid: str, prompt: str) -> str:
    text = []
    async for out in engine.generate(EngineRequest(rid, prompt, 40)):
        if isinstance(out, EngineDelta):
            text.append(out.text)
    return "".join(text)


async def test_a_next_turn_finds_the_previous_prompt_and_answer_cached() -> None:
    engine = SimEngine(SimProfile(token_rate=2000.0, max_num_seqs=4))
    await engine.start()
    try:
        first = "system: " + " ".join(words(100)) + "\nuser: what is a bus?"
        reply = await answer(engine, "t1", first)
        second = f"{first}\nassistant: {reply}\nuser: and a batch?"
        await answer(engine, "t2", second)
    finally:
        await engine.stop()
    cache = engine.prefix_cache
    turn1, turn2 = len(sim_split(first)), len(sim_split(second))
    history = len(sim_split(f"{first}\nassistant: {reply}"))
    assert cache.queried_total == turn1 + turn2
    # Every full block of the first turn's prompt and answer; only the new message is not.
    assert cache.hit_total == history - history % 16
    rate = engine.capacity().prefix_cache_hit_rate
    assert rate is not None
    assert rate == cache.hit_total / cache.queried_total

"""One tenant cannot learn another's prompt prefixes from prefix caching.

Before: the prefix-affinity key was the same for every tenant sending the same opening (or
naming the same conversation id), so the scheduler sent a probe to the worker holding the
victim's prefix; and the engines' prefix caches were shared, so the probe's time to first
token said whether the victim had sent that prefix. Now the key is salted with the tenant
(shared/prefixes.py), and so is every engine's prefix cache: vLLM's `cache_salt`, and the
`sim` engine's model of it (the transformers engine keeps no cache between requests).

The attacker's probe is the victim's own prompt, sent as another tenant.
"""

from __future__ import annotations

import pytest

from services.worker.engines.sim import SimEngine
from services.worker.engines.sim_profiles import SimProfile
from services.worker.runner import engine_request
from shared.messages import ChatMessage, ChatRequest, QueuedRequest, ReplyTo, Tier
from shared.prefixes import cache_salt, prefix_key
from tests.test_engine_vllm import started_engine

VICTIM, ATTACKER = "t-" + "a" * 32, "t-" + "b" * 32
SYSTEM = ChatMessage(role="system", content="You are the payroll assistant of ACME. " * 20)
OPENING = ChatMessage(role="user", content="Alice's salary is 123,456; draft her review.")


def queued(tenant: str, request_id: str, messages: list[ChatMessage]) -> QueuedRequest:
    return QueuedRequest(
        request_id=request_id,
        tenant=tenant,
        messages=messages,
        max_tokens=8,
        tier=Tier.interactive,
        prompt_tokens=0,
        reply_to=ReplyTo(topic="r"),
    )


@pytest.mark.parametrize(
    "request_",
    [
        ChatRequest(messages=[SYSTEM, OPENING]),
        ChatRequest(prompt=SYSTEM.content + OPENING.content),
        ChatRequest(messages=[OPENING], conversation_id="payroll-2026"),
    ],
    ids=["messages", "prompt", "conversation"],
)
def test_the_same_prefix_gets_another_affinity_key_for_another_tenant(
    request_: ChatRequest,
) -> None:
    assert prefix_key(request_, VICTIM) != prefix_key(request_, ATTACKER)
    assert prefix_key(request_, VICTIM) == prefix_key(request_, VICTIM)  # affinity still works


def test_every_tenant_gets_a_salt_vllm_accepts() -> None:
    names = [VICTIM, ATTACKER, "default", "a/b@c\\d\x00e", "é" * 128, "x"]
    salts = [cache_salt(name) for name in names]
    assert len(set(salts)) == len(names)
    for salt in salts:
        # vllm/entrypoints/generate/base/protocol.py `validate_cache_salt`
        assert 0 < len(salt) <= 128
        assert not set(salt) & set("@/\\\x00")


async def test_the_sim_engine_serves_a_cached_prefix_only_to_its_tenant() -> None:
    """The victim's prompt is cached; the attacker's copy of it finds nothing, while the
    victim's next request finds it (so the probe's timing tells the attacker nothing)."""
    engine = SimEngine(SimProfile(token_rate=2000.0, max_num_seqs=4))
    await engine.start()
    cache = engine.prefix_cache
    try:
        hits = []
        for tenant, rid in ((VICTIM, "v1"), (ATTACKER, "a1"), (VICTIM, "v2")):
            before = cache.hit_total
            request = engine_request(queued(tenant, rid, [SYSTEM, OPENING]))
            _ = [out async for out in engine.generate(request)]
            hits.append(cache.hit_total - before)
    finally:
        await engine.stop()
    assert hits[0] == 0  # nothing cached yet
    assert hits[1] == 0  # the attacker's probe: another tenant's blocks are not its
    assert hits[2] > 100  # the victim's own: its whole system prompt


async def test_vllm_gets_the_tenants_cache_salt_with_every_prompt() -> None:
    engine, llm = await started_engine()
    for rid, tenant in (("v1", VICTIM), ("a1", ATTACKER), ("v2", VICTIM)):
        request = engine_request(queued(tenant, rid, [OPENING]))
        _ = [out async for out in engine.generate(request)]
    salts = [call["prompt"]["cache_salt"] for call in llm.generate_calls]
    await engine.stop()
    assert salts == [cache_salt(VICTIM), cache_salt(ATTACKER), cache_salt(VICTIM)]
    assert salts[0] != salts[1]
    # The rest of the prompt is unchanged: the template's token ids.
    victims, attackers = (call["prompt"]["prompt_token_ids"] for call in llm.generate_calls[:2])
    assert victims == attackers

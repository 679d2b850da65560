"""The prefix key of a request: what requests that share a prompt prefix have in common.

Prefix-affinity routing (services/scheduler/routing.py) sends requests with the same key to
the worker that last served it, whose engine then finds the shared prefix in its KV cache.

- A request naming a `conversation_id` is keyed by it: every turn of one conversation.
- A chat request without one is keyed by its leading messages: the system messages it
  starts with and the first message after them (the conversation's opening). A later turn
  repeats them verbatim (it is the earlier turns plus a new message), so it gets the same
  key; requests sharing only a system prompt are spread (every worker soon holds a system
  prompt that many requests use, so it is a hit wherever they land).
- A plain `prompt` is keyed by its first `PROMPT_PREFIX_CHARS` characters.

Every key is salted with the request's tenant: two tenants sending the same prefix (or
naming the same conversation id) get different keys, so affinity neither sends them to the
same worker on purpose nor lets one tenant learn from where (and how fast) its request ran
whether another sent that prefix. The engines' prefix caches are salted per tenant the same
way (`cache_salt`: vLLM's `TokensPrompt.cache_salt`, the `sim` engine's cache), so a tenant
never hits blocks another tenant's prompt left in the KV cache, wherever it runs.

Pure and cheap: one BLAKE2b over at most the leading messages, once per request.
"""

from __future__ import annotations

import hashlib

from shared.messages import ChatMessage, ChatRequest

# A plain prompt's key covers this many leading characters (~256 tokens of English).
PROMPT_PREFIX_CHARS = 1024
_DIGEST_BYTES = 8


def prefix_key(request: ChatRequest, tenant: str) -> str:
    """The request's prefix key for `tenant` (see the module docstring); never empty."""
    if request.conversation_id is not None:
        return "conversation:" + _digest([tenant, request.conversation_id])
    if request.messages is not None:
        return "messages:" + _digest([tenant, *_leading(request.messages)])
    prompt = request.prompt or ""
    return "prompt:" + _digest([tenant, prompt[:PROMPT_PREFIX_CHARS]])


def cache_salt(tenant: str) -> str:
    """The prefix-cache salt of `tenant`'s requests: one per tenant, and always a value
    vLLM accepts (non-empty, at most 128 characters, none of `@ / \\` or NUL), whatever
    a tenant name holds. Not a secret: the salt separates tenants' cache blocks, it does
    not hide them; tenant ids written by the edge are keyed hashes already."""
    data = b"tokenbus-cache-salt\x00" + tenant.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _leading(messages: list[ChatMessage]) -> list[str]:
    """The leading system messages and the first message after them, as hashable parts."""
    parts: list[str] = []
    for m in messages:
        parts.append(f"{m.role}\x00{m.content}")
        if m.role != "system":
            break
    return parts


def _digest(parts: list[str]) -> str:
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    for part in parts:
        data = part.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()

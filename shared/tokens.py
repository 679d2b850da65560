"""Token counts without the model's tokenizer: a bound that never undercounts, for quotas and
budgets, and the `sim` engine's own token model.

The bound (`prompt_token_bound`) is what a request is charged before it runs: tenant quotas
(the edge's tokens per minute), batch token budgets and fair share. A byte-level BPE (GPT-2,
Llama 3, Qwen, Mistral's tekken) covers every token with at least one UTF-8 byte of the
text, and SentencePiece with byte fallback (Llama 2, Gemma) at least one byte too, so no
such tokenizer makes more tokens of a text than its UTF-8 bytes. The chat template adds its
own tokens: around each message (role headers, end-of-turn markers) up to
`TEMPLATE_TOKENS_PER_MESSAGE`, beyond the `role: ` label `prompt_text` already counts in
bytes; once per request (the BOS, the generation prompt, a default system prompt such as
SmolLM2's or Llama 3.1's date header) up to `TEMPLATE_TOKENS_PER_REQUEST`. A template that
writes more text of its own exceeds the bound by that much; the edge settles each request
with its real `usage` when it ends, so quotas still converge on what was used (ADR 0046).

The bound is about 4x the real count for English text (about 4 bytes per token), less for
CJK (ADR 0046 has the ratios measured against a real tokenizer). Where the edge has the
model's own tokenizer it could count exactly; the project does not carry the `tokenizers`
library, so the bound is all there is (ADR 0046).

`sim_tokens` and `sim_split` are the `sim` engine's stand-in tokenizer (a word or a
punctuation mark per token): what it reports as usage and models its timing and prefix
cache with. They undercount a real tokenizer by orders of magnitude on text without spaces
(65,536 `a`s are one of them) and are never used to charge anyone.
"""

from __future__ import annotations

import re

# Tokens a chat template may add per message beyond the message's text (and its `role: `
# label): Llama 3 adds 5 (start/end header, role, blank line, end of turn), ChatML 5
# (im_start, role, newline, im_end, newline); room left for a BOS and the generation prompt.
# A plain prompt counts as one message.
TEMPLATE_TOKENS_PER_MESSAGE = 8
# Tokens a chat template may add once per request: the BOS and the generation prompt (~5),
# and a default system prompt where the conversation has none (SmolLM2's: 16 tokens beyond
# what the per-message allowance covers; Llama 3.1's date header: ~20).
TEMPLATE_TOKENS_PER_REQUEST = 32

_SIM_TOKEN = re.compile(r"\w+|[^\w\s]")


def prompt_token_bound(text: str, messages: int = 1) -> int:
    """At most how many tokens a prompt of `text` (`ChatRequest.prompt_text`) in `messages`
    messages makes, for any byte-level tokenizer and chat template (module docstring)."""
    template = TEMPLATE_TOKENS_PER_REQUEST + TEMPLATE_TOKENS_PER_MESSAGE * max(1, messages)
    return len(text.encode("utf-8", "surrogatepass")) + template


def sim_tokens(text: str) -> int:
    """The `sim` engine's token count: words and punctuation marks (close to BPE counts for
    English chat text, far below them otherwise). Not a bound: never charge with it."""
    return len(_SIM_TOKEN.findall(text))


def sim_split(text: str) -> list[str]:
    """The tokens `sim_tokens` counts, in order (the `sim` engine's prefix cache)."""
    return _SIM_TOKEN.findall(text)

"""The OpenAI-compatible API of the edge: request and response models, their mapping onto
tokenbus requests, SSE framing, errors, the model directory (ADR 0027)."""

"""Engines a worker can run: `sim` everywhere, `vllm` and `transformers` where installed."""

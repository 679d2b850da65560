"""The real-engine suite: run with the vLLM worker environment's Python (deploy/test.sh)."""

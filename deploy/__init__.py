"""Deployment tooling: how tokenbus runs on a laptop, in CI, in Docker and on a cluster."""

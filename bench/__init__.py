"""Benchmarks; run them from the repository root as modules: uv run python -m bench.rollout."""

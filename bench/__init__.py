"""Benchmarks; run them from the repository root, as modules (uv run python -m bench.rollout) or as files
(uv run bench/rollout.py): each puts the repository root on the import path itself."""

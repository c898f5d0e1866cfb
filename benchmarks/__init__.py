"""Benchmarks of the chunked_logits backend: ``python benchmarks/run.py`` (see README.md)."""

"""Measuring a model: perplexity, passkey retrieval, decode speed and cache memory, and the `evaluate` report."""

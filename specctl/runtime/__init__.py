"""The shared speculative runtime: target runner + KV cache, proposers, verifier, stats, decode loop."""

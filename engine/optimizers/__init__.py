"""Optimizers torch does not have, with DeepSpeed's semantics: Adam without bias correction, LAMB, and the
compressed-communication family (1-bit Adam, 0/1 Adam, 1-bit LAMB)."""

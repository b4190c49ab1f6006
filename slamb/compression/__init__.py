"""Gradient compression primitives shared by the optimizers (sparsification, 1-bit quantization)."""

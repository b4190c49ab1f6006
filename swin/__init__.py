"""Swin Transformer on ImageNet (timm models and data pipeline): ``python -m swin.train``."""

"""Attention trace monitor: watches the attention heads of transformer models in production."""

__version__ = "0.1.0"

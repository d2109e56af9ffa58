"""Long-Short Transformer for Hugging Face Transformers."""

from .long_short_attention import CausalState, LongShortSelfAttention

__all__ = ["CausalState", "LongShortSelfAttention"]

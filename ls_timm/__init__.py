"""Long-Short Transformer models for timm."""

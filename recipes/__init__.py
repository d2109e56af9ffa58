"""Recipes: convert RoBERTa, pretrain, fine-tune, launch, publish (see README.md)."""

"""``python -m recipes.lra --task listops --output_dir runs/listops-ls``: see ``train.py``."""

from .train import main

main()

"""Write a LongShort model as a self-contained Hub folder (weights, config with a complete ``auto_map``, remote code)."""

import os
import shutil
import tempfile
from pathlib import Path

from .modeling_long_short import LongShortPreTrainedModel
from .modeling_long_short_xl import LongShortXLPreTrainedModel

__all__ = ["REMOTE_CODE_FILES", "REMOTE_CODE_FILES_XL", "save_for_hub"]

# The files a folder needs to load with trust_remote_code=True where ls_hf is not installed.
REMOTE_CODE_FILES = ("configuration_long_short.py", "modeling_long_short.py", "long_short_attention.py")
# LongShortXLForCausalLM's folders also need its own file (which imports the three above).
REMOTE_CODE_FILES_XL = (*REMOTE_CODE_FILES, "modeling_long_short_xl.py")


def save_for_hub(model, folder, tokenizer=None, **save_kwargs) -> Path:
    """Save ``model`` (and ``tokenizer``) into ``folder``, ready for ``upload_folder`` / ``push_to_hub``.

    The folder gets ``model.safetensors``, ``config.json`` whose ``auto_map`` names the config and every head (so
    ``AutoModel``, ``AutoModelForMaskedLM``, ``AutoModelForCausalLM``, ... all load it with ``trust_remote_code=True``),
    the remote-code files ``REMOTE_CODE_FILES`` (``REMOTE_CODE_FILES_XL`` for ``LongShortXLForCausalLM``),
    ``generation_config.json`` for causal models, and the tokenizer files. Everything is written to a temporary folder
    first and moved into place at the end, so a failure leaves nothing half-written. ``folder`` must not exist or be
    empty. Returns ``Path(folder)``.
    """
    if not isinstance(model, LongShortPreTrainedModel):
        raise TypeError(f"model must be a LongShort model (LongShortPreTrainedModel), got {type(model).__name__}.")
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"folder {str(folder)!r} already exists and is not an empty directory; pick a new path.")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        model.save_pretrained(staging, **save_kwargs)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        needed = REMOTE_CODE_FILES_XL if isinstance(model, LongShortXLPreTrainedModel) else REMOTE_CODE_FILES
        missing = [name for name in needed if not (staging / name).is_file()]
        if missing:
            raise RuntimeError(f"save_pretrained did not write the remote code files {missing}.")
        if folder.exists():
            folder.rmdir()
        os.replace(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder

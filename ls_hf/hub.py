"""Write a LongShort model as a self-contained Hub folder (weights, config with a complete ``auto_map``, remote code),
and tell a local folder from a Hub id."""

import os
import shutil
import tempfile
from pathlib import Path

from .modeling_long_short import LongShortPreTrainedModel
from .modeling_long_short_xl import LongShortXLPreTrainedModel

__all__ = ["REMOTE_CODE_FILES", "REMOTE_CODE_FILES_XL", "is_local_path", "save_for_hub"]

# The files a folder needs to load with trust_remote_code=True where ls_hf is not installed.
REMOTE_CODE_FILES = (
    "cache_long_short.py",
    "configuration_long_short.py",
    "modeling_long_short.py",
    "long_short_attention.py",
    "long_short_blocks.py",
    "long_short_fused.py",
    "long_short_kernels.py",
    "long_short_plan.py",
    "long_short_rules.py",
    "long_short_tiles.py",
)
# LongShortXLForCausalLM's folders also need its own file (which imports those above).
REMOTE_CODE_FILES_XL = (*REMOTE_CODE_FILES, "modeling_long_short_xl.py")


def is_local_path(name) -> bool:
    """Whether ``name`` means a local folder rather than a Hub id (``owner/name`` or ``name``): it exists, starts with
    ``.``, ``/`` or ``~``, or has more than one ``/``."""
    name = str(name)
    return Path(name).expanduser().exists() or name.startswith((".", "/", "~")) or name.count("/") > 1


def _readable(folder: Path) -> None:
    """``mkdtemp`` creates mode 0700: give the folder the mode a plain ``mkdir`` would (the umask's)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)


def save_for_hub(
    model, folder, tokenizer=None, files: dict | None = None, overwrite: bool = False, **save_kwargs
) -> Path:
    """Save ``model`` (and ``tokenizer``, and ``files``: name -> text) into ``folder``, ready for ``upload_folder``.

    The folder gets ``model.safetensors``, ``config.json`` whose ``auto_map`` names the config and every head (so
    ``AutoModel``, ``AutoModelForMaskedLM``, ``AutoModelForCausalLM``, ... all load it with ``trust_remote_code=True``),
    the remote-code files ``REMOTE_CODE_FILES`` (``REMOTE_CODE_FILES_XL`` for ``LongShortXLForCausalLM``),
    ``generation_config.json`` for causal models, and the tokenizer files. Everything is written next to ``folder``
    first and moved into place at the end, so a failure leaves neither a half-written nor a missing folder.
    ``folder`` must not exist or be empty, unless ``overwrite`` (then it is replaced). Returns ``Path(folder)``.
    """
    if not isinstance(model, (LongShortPreTrainedModel, LongShortXLPreTrainedModel)):
        raise TypeError(
            f"model must be a LongShort model (LongShortPreTrainedModel or LongShortXLPreTrainedModel), "
            f"got {type(model).__name__}."
        )
    folder = Path(folder).expanduser()
    if folder.exists() and not overwrite and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(
            f"{str(folder)!r} already exists and is not an empty directory; pick a new path or pass "
            f"overwrite=True (--overwrite) to replace it."
        )
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        new = staging / "new"
        model.save_pretrained(new, **save_kwargs)
        if tokenizer is not None:
            tokenizer.save_pretrained(new)
        for name, text in (files or {}).items():
            (new / name).write_text(text)
        needed = REMOTE_CODE_FILES_XL if isinstance(model, LongShortXLPreTrainedModel) else REMOTE_CODE_FILES
        missing = [name for name in needed if not (new / name).is_file()]
        if missing:
            raise RuntimeError(f"save_pretrained did not write the remote code files {missing}.")
        _readable(new)
        if folder.exists():
            os.replace(folder, staging / "old")
        os.replace(new, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder

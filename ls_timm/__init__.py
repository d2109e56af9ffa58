"""Long-Short Transformer models for timm: ``import ls_timm`` registers the ``vil_ls_*`` and ``cvt_ls_*`` entries."""

from . import cvt_ls, vil_ls
from .cvt_ls import CvtLs
from .long_short_attention_2d import LongShortAttention2d
from .vil_ls import VilLs

__all__ = ["CvtLs", "LongShortAttention2d", "VilLs", "cvt_ls", "vil_ls"]

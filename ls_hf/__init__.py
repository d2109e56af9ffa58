"""Long-Short Transformer for Hugging Face Transformers.

``import ls_hf`` registers ``LongShortConfig`` (model_type ``"long_short"``) and every head with the Auto classes, and
``LongShortXLConfig`` (``"long_short_xl"``, the official character-level model) with ``AutoModel``,
``AutoModelForCausalLM`` and ``AutoTokenizer`` (ByT5's byte tokenizer, that of ``recipes.char_lm``).
"""

import transformers

from . import modeling_long_short, modeling_long_short_xl
from .configuration_long_short import LongShortConfig
from .long_short_attention import CausalState, LongShortSelfAttention
from .modeling_long_short import *  # every head of modeling_long_short.HEADS, the cache, the base class
from .modeling_long_short import AUTO_CLASSES
from .modeling_long_short_xl import (
    LongShortXLCache,
    LongShortXLConfig,
    LongShortXLForCausalLM,
    LongShortXLModel,
    LongShortXLOutput,
)

transformers.AutoConfig.register(LongShortConfig.model_type, LongShortConfig, exist_ok=True)
for _auto_name, _model_class in AUTO_CLASSES.items():
    getattr(transformers, _auto_name).register(LongShortConfig, _model_class, exist_ok=True)
transformers.AutoTokenizer.register(LongShortConfig, transformers.RobertaTokenizer, exist_ok=True)
transformers.AutoConfig.register(LongShortXLConfig.model_type, LongShortXLConfig, exist_ok=True)
for _auto_name, _model_class in modeling_long_short_xl.AUTO_CLASSES_XL.items():
    getattr(transformers, _auto_name).register(LongShortXLConfig, _model_class, exist_ok=True)
transformers.AutoTokenizer.register(LongShortXLConfig, transformers.ByT5Tokenizer, exist_ok=True)  # one id per byte

__all__ = ["CausalState", "LongShortConfig", "LongShortSelfAttention"]
__all__ += modeling_long_short.__all__
__all__ += ["LongShortXLCache", "LongShortXLConfig", "LongShortXLForCausalLM", "LongShortXLModel", "LongShortXLOutput"]

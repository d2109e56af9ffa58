"""The decoding cache of causal LongShort models, and the glue that lets ``generate`` use it.

Causal Long-Short attention (paper Eq. 5, Appendix D) keeps per layer the last window of keys/values and the projected
rows of finished segments (``CausalState``), so a decoding step costs O(w + r n / l) instead of O(n); Transformers'
other cache types hold full K/V. This file only uses single-dot relative imports: it is copied as-is into saved
folders as Hub remote code.
"""

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_long_short import LongShortConfig
from .long_short_attention import CausalState

__all__ = ["CACHE_NAME", "LongShortCache", "LongShortCacheLayer", "decoding_cache", "prepare_own_cache"]

# The decoding cache's name as a forward argument, in model outputs and in ``generate``'s model kwargs:
# ``past_key_values`` up to Transformers 5.23, ``cache`` from 5.24 (which still reads the old name and warns).
CACHE_NAME = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def decoding_cache(cache, past_key_values):
    """The decoding cache given as ``cache`` (Transformers >= 5.24) or ``past_key_values`` (its earlier name)."""
    if cache is not None and past_key_values is not None:
        raise ValueError(
            "Pass the decoding cache once, as cache=... (named past_key_values before Transformers 5.24), not both."
        )
    return cache if cache is not None else past_key_values


def prepare_own_cache(generation_config, model_kwargs, make_cache, refusal: str) -> None:
    """``generate``'s cache for a model that decodes only with its own cache type: ``make_cache()`` unless the caller
    passed a cache or turned caching off. Any ``cache_implementation`` is refused with ``refusal`` (the other cache
    types hold full K/V)."""
    if generation_config.cache_implementation is not None:
        raise ValueError(f"{refusal}; drop cache_implementation={generation_config.cache_implementation!r}.")
    if model_kwargs.get(CACHE_NAME) is None and generation_config.use_cache is not False:
        model_kwargs[CACHE_NAME] = make_cache()


class LongShortCacheLayer(CacheLayerMixin):
    """One layer's decoding cache: a ``CausalState`` that ``LongShortSelfAttention`` reads and extends in place."""

    is_compileable = False
    is_croppable = False  # finished segments are compressed into projected rows
    supports_early_init = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.state = CausalState()

    def lazy_initialization(self, key_states, value_states):
        """Nothing to allocate: the attention fills ``state`` on its first call."""

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("LongShortSelfAttention extends `state` itself; there are no raw K/V to append.")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.state.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.state.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state = CausalState()

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(
            "A LongShortCache cannot be cropped: finished segments are compressed into projected rows. Decode without "
            "assisted generation / prompt lookup, or restart from the prompt."
        )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.state.map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.state.map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.state.map_batch(lambda t: t[indices])


class LongShortCache(Cache):
    """Decoding cache of a causal LongShort model, one ``LongShortCacheLayer`` per layer.

    It holds only what causal Long-Short attention needs (Appendix D): window keys/values of the current and
    previous window segment, the projected rows of every finished segment of l tokens and the projection scores of
    the unfinished one. ``get_seq_length()`` is the number of tokens seen.
    """

    def __init__(self, config: LongShortConfig):
        super().__init__(layers=[LongShortCacheLayer() for _ in range(config.num_hidden_layers)])

# Copyright 2026 The transformer-ls authors. Licensed under the MIT License.
"""The paper's character-level language model (Zhu et al., 2021, Sec. 4.2): Long-Short attention with a
Transformer-XL memory and relative positions, as the official autoregressive code builds it.

``LongShortXLForCausalLM`` (``model_type="long_short_xl"``) differs from ``LongShortForCausalLM`` (a RoBERTa-style
Post-LN decoder with learned absolute positions) in what the official ``TransformerLSModel`` does:

* Pre-LN in the official form: ``h = LN_1(h); h = h + Attn(h); h = LN_2(h); h = h + FFN(h)`` (the residual stream is
  the normalised input; no final LayerNorm), embeddings scaled by ``sqrt(d)``, output tied to the input embedding
  with its own bias.
* Transformer-XL relative positions (Dai et al., 2019, Sec. 3.3): with ``q`` scaled by ``1/sqrt(d_h)``, window
  scores ``(q + u) k + (q + v) R_{t-j}`` with sinusoids of the distance ``t - j``; scores of projected rows
  ``q k_bar + q R'_c`` with a sinusoid of the row distance ``a r - 1 - c`` for a query in segment ``a`` and row ``c``
  (no u, v).
* A memory: each layer also attends to the detached inputs of the previous blocks (its window keys and their
  projected rows). ``forward(memory=...)`` takes and returns it, so consecutive training batches continue the same
  streams (truncated backpropagation through time) and evaluation streams a long context. The official code starts
  a stream with a memory of ``memory_length`` zeros (``initial_memory``); ``memory=None`` starts it with none.

Two rules where the official code and the paper's text differ are options (config ``window_rule`` and
``projection_input``); the official ones are this class's defaults, because this class reproduces the official
model (in float64 its log-probabilities match the official code's to 3.4e-7, the official softmaxes running in
float32; ``tests/fixtures/char_lm_official.*``):

* ``window_rule="token"`` (official): the token at t sees the w keys ``[t - w + 1, t]``; ``"segment"`` (paper,
  Appendix D, Fig. 5): the w keys left of its window segment and the segment's past.
* ``projection_input="raw"`` (official): the projection compresses ``X W_K`` (block) and compresses ``X`` itself
  before ``W_K`` (memory, head i's weights pooling channel slice i); ``"normalized"`` (paper, Sec. 3.4):
  ``P^T LN_L(X W_K)`` for block and memory alike.

Positions count from the first memory token; the memory length must be a multiple of l. This file only uses
single-dot relative imports: it is copied as-is into saved folders as Hub remote code.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from huggingface_hub.dataclasses import strict
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils.generic import can_return_tuple

from .cache_long_short import CACHE_NAME, LongShortCacheLayer, decoding_cache, prepare_own_cache
from .long_short_attention import BatchFirstState
from .long_short_rules import segment_keep, validate_long_short_args, window_keep
from .modeling_long_short import hub_auto_map

__all__ = [
    "AUTO_CLASSES_XL",
    "HEADS_XL",
    "LongShortXLCache",
    "LongShortXLConfig",
    "LongShortXLForCausalLM",
    "LongShortXLModel",
    "LongShortXLOutput",
    "XLState",
]

WINDOW_RULES = ("token", "segment")
PROJECTION_INPUTS = ("raw", "normalized")
# The other fields of LongShortConfig, which this config extended until it had its own base: configs saved then carry
# them. The model never read them; those with a value here take only that one (the model has no other).
INHERITED_FIELDS = {
    "hidden_act": ...,
    "max_position_embeddings": ...,
    "type_vocab_size": ...,
    "sep_token_id": ...,
    "classifier_dropout": ...,
    "recompute_window_tiles": ...,
    "is_decoder": True,
    "qk_head_dim": None,
    "global_projections": False,
}


@strict(accept_kwargs=True)
class LongShortXLConfig(PreTrainedConfig):
    r"""Configuration of ``LongShortXLForCausalLM``, the official character-level model (always causal).

    The defaults are the official enwik8 base model's (12 layers, width 512, 8 heads, inner 2048, w = 512, l = 16,
    r = 1, dropout 0.2 on hidden states, embeddings and window positions, no attention dropout, memory 2048).

    Fields:
        vocab_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, layer_norm_eps,
            initializer_range, pad_token_id, bos_token_id, eos_token_id, use_cache, tie_word_embeddings: as in
            ``LongShortConfig`` (RoBERTa's names).
        hidden_dropout_prob (`float`, defaults to 0.2): dropout on the embeddings, the window positions, the
            attention output, the feed-forward and the last hidden states (the official ``dropout``/``emb_dropout``).
        attention_probs_dropout_prob (`float`, defaults to 0.0): dropout on the attention probabilities.
        window_size (`int` or `list[int]`, defaults to 512): window w (per layer with a list).
        projection_rank (`int` or `list[int]`, defaults to 1): rows r of the dynamic projection (Eq. 3) per segment
            and head (per layer with a list; 0: window only).
        causal_segment_length (`int`, defaults to 16): the projection compresses each segment of l tokens (Eq. 5),
            ``1 <= l <= w``.
        use_dual_ln (`bool`, defaults to True): DualLN (Eq. 7); False is the paper's ablation.
        memory_length (`int`, defaults to 2048): tokens of earlier blocks kept per layer (a multiple of
            ``causal_segment_length``; 0: no memory). ``forward(memory_length=...)`` overrides it (evaluation with a
            longer context).
        window_rule (`str`, defaults to ``"token"``): ``"token"`` (official: the w keys ``[t - w + 1, t]``) or
            ``"segment"`` (paper, Appendix D: the w keys left of the window segment plus its past).
        projection_input (`str`, defaults to ``"raw"``): ``"raw"`` (official: compress ``X W_K``, and ``X`` before
            ``W_K`` in the memory) or ``"normalized"`` (paper Sec. 3.4: compress ``LN_L(X W_K)``).

    Configs saved when this class extended ``LongShortConfig`` also carry that class's other fields
    (``INHERITED_FIELDS``), which this model never read: they load and are dropped.
    """

    model_type = "long_short_xl"
    is_decoder: ClassVar[bool] = True  # always causal (read by code that serves both LongShort configs)

    vocab_size: int = 259
    hidden_size: int = 512
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    intermediate_size: int = 2048
    hidden_dropout_prob: float | int = 0.2
    attention_probs_dropout_prob: float | int = 0.0
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-5
    pad_token_id: int | None = 1
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 2
    use_cache: bool = True
    tie_word_embeddings: bool = True
    window_size: int | list[int] = 512
    projection_rank: int | list[int] = 1
    causal_segment_length: int = 16
    use_dual_ln: bool = True
    memory_length: int = 2048
    window_rule: str = "token"
    projection_input: str = "raw"

    def __post_init__(self, **kwargs):
        for name, only in INHERITED_FIELDS.items():
            value = kwargs.pop(name, only)
            if only is not ... and value != only:
                raise ValueError(
                    f"{name} must be {only!r} or left out, got {value!r}: LongShortXLConfig is the "
                    f"official causal language model (no LMSA, no global tokens)."
                )
        super().__post_init__(**kwargs)
        self.check_long_short()

    def layer_value(self, name: str, layer_idx: int) -> int:
        """``window_size`` or ``projection_rank`` of layer ``layer_idx`` (the field may be an int or a list)."""
        value = getattr(self, name)
        return value[layer_idx] if isinstance(value, list) else value

    def check_long_short(self) -> None:
        """Raise ``ValueError`` naming the field if these settings cannot build a model."""
        for layer_idx in range(self.num_hidden_layers):
            per_layer = {}
            for name in ("window_size", "projection_rank"):
                value = getattr(self, name)
                if isinstance(value, list) and len(value) != self.num_hidden_layers:
                    raise ValueError(
                        f"{name} has {len(value)} entries but num_hidden_layers="
                        f"{self.num_hidden_layers}; give one value per layer or a single int."
                    )
                per_layer[name] = f"{name}[{layer_idx}]" if isinstance(value, list) else name
            validate_long_short_args(
                hidden_size=self.hidden_size,
                num_heads=self.num_attention_heads,
                window_size=self.layer_value("window_size", layer_idx),
                projection_rank=self.layer_value("projection_rank", layer_idx),
                causal=True,
                segment_length=self.causal_segment_length,
                attention_dropout=self.attention_probs_dropout_prob,
                names={
                    "num_heads": "num_attention_heads",
                    "segment_length": "causal_segment_length",
                    "attention_dropout": "attention_probs_dropout_prob",
                    **per_layer,
                },
            )
        if self.window_rule not in WINDOW_RULES:
            raise ValueError(f"window_rule must be one of {WINDOW_RULES}, got {self.window_rule!r}.")
        if self.projection_input not in PROJECTION_INPUTS:
            raise ValueError(f"projection_input must be one of {PROJECTION_INPUTS}, got {self.projection_input!r}.")
        check_memory_length(self.memory_length, self.causal_segment_length, "memory_length")


def check_memory_length(value, segment_length: int, name: str) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a multiple of l that is >= 0."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or value % segment_length:
        raise ValueError(
            f"{name} must be a multiple of causal_segment_length ({segment_length}) that is >= 0, got "
            f"{value!r}: the memory is compressed segment by segment."
        )


def sinusoids(distances: Tensor, width: int) -> Tensor:
    """Transformer-XL's relative encoding ``[sin(t f), cos(t f)]``, ``f = 10000^(-2i/d)``: (N,) -> (N, width)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, width, 2, dtype=torch.float64, device=distances.device) / width))
    angles = distances.to(torch.float64)[:, None] * inv_freq
    return torch.cat([angles.sin(), angles.cos()], -1)


@dataclass
class XLState(BatchFirstState):
    """One layer's view of the past, batch first: positions ``[0, seen)`` count from the first memory token.

    ``keys``/``values``: window keys/values (after ``LN_L``) of positions ``[seen - L, seen)``, enough for the window
    segment of the next token and the one before it. ``rows_*``: projected rows of every finished segment of l
    tokens (after ``LN_G``). ``pending_*``: the projection scores and inputs of the unfinished segment.
    """

    seen: int = 0
    keys: Tensor | None = None  # (B, L, H, d)
    values: Tensor | None = None
    rows_k: Tensor | None = None  # (B, N, H, d)
    rows_v: Tensor | None = None
    pending_scores: Tensor | None = None  # (B, p, H, r)
    pending_k: Tensor | None = None  # (B, p, H, d)
    pending_v: Tensor | None = None
    _tensors: tuple = field(
        default=("keys", "values", "rows_k", "rows_v", "pending_scores", "pending_k", "pending_v"), repr=False
    )


def _cat(old: Tensor | None, new: Tensor) -> Tensor:
    return new if old is None else torch.cat([old, new], 1)


class LongShortXLAttention(nn.Module):
    """Causal Long-Short attention (Eq. 5-7) with Transformer-XL relative positions and a memory.

    Parameters mirror the official ``ChunkedLSAttention``: ``query``/``key``/``value``/``output`` (no bias),
    ``dynamic_projection`` (W^P, Eq. 3), ``window_position`` (R for window distances, no bias), ``row_position``
    (R' for row distances, with bias), ``content_bias`` u and ``position_bias`` v, DualLN ``dual_ln_local`` (window)
    and ``dual_ln_global`` (projected rows).
    """

    def __init__(self, config: LongShortXLConfig, layer_idx: int):
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = d // self.num_heads
        self.window_size = config.layer_value("window_size", layer_idx)
        self.projection_rank = config.layer_value("projection_rank", layer_idx)
        self.segment_length = config.causal_segment_length
        self.window_rule = config.window_rule
        self.projection_input = config.projection_input
        self.use_dual_ln = config.use_dual_ln
        self.attention_dropout = config.attention_probs_dropout_prob
        self.query = nn.Linear(d, d, bias=False)
        self.key = nn.Linear(d, d, bias=False)
        self.value = nn.Linear(d, d, bias=False)
        self.output = nn.Linear(d, d, bias=False)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.dynamic_projection = nn.Linear(d, self.num_heads * self.projection_rank) if self.projection_rank else None
        self.window_position = nn.Linear(d, d, bias=False)
        self.row_position = nn.Linear(d, d)
        self.content_bias = nn.Parameter(torch.zeros(self.num_heads, self.head_dim))
        self.position_bias = nn.Parameter(torch.zeros(self.num_heads, self.head_dim))
        self.dual_ln_local = nn.LayerNorm(d, eps=config.layer_norm_eps) if self.use_dual_ln else None
        self.dual_ln_global = nn.LayerNorm(d, eps=config.layer_norm_eps) if self.use_dual_ln else None

    def _split(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.num_heads, -1))

    @staticmethod
    def _ln(x: Tensor, norm: nn.LayerNorm | None) -> Tensor:
        """DualLN (Eq. 7) over the full width of a (B, n, H, d) tensor; identity when switched off (``norm`` None)."""
        return x if norm is None else norm(x.flatten(2)).view_as(x)

    def _ln_global(self, x: Tensor) -> Tensor:
        return self._ln(x, self.dual_ln_global)

    def _window_keys(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(X W_K, X W_V)`` and their ``LN_L`` for normalised inputs h (B, n, d)."""
        k, v = self._split(self.key(h)), self._split(self.value(h))
        return k, v, self._ln(k, self.dual_ln_local), self._ln(v, self.dual_ln_local)

    def _advance(
        self,
        state: XLState,
        count: int,
        scores: Tensor | None,
        inputs_k: Tensor,
        inputs_v: Tensor,
        finish_k: Callable[[Tensor], Tensor],
        finish_v: Callable[[Tensor], Tensor],
    ) -> None:
        """Append ``count`` tokens' projection scores/inputs to the unfinished segment and compress every segment of
        l tokens they finish (Eq. 5: softmax over the segment in float32, ``K_bar = P^T K`` per head), turning
        the pooled rows into keys/values with ``finish_*``."""
        state.seen += count
        if not self.projection_rank:
            return
        l = self.segment_length
        scores, k, v = (
            _cat(old, new)
            for old, new in ((state.pending_scores, scores), (state.pending_k, inputs_k), (state.pending_v, inputs_v))
        )
        done = scores.shape[1] // l * l
        if done:
            prob = scores[:, :done].to(torch.promote_types(scores.dtype, torch.float32))
            prob = prob.unflatten(1, (-1, l)).softmax(2).to(k.dtype)  # (B, S, l, H, r)

            def pool(x):  # (B, S * l, H, d) -> (B, S * r, H, d)
                return torch.einsum("bslhr,bslhd->bsrhd", prob, x[:, :done].unflatten(1, (-1, l))).flatten(1, 2)

            state.rows_k = _cat(state.rows_k, finish_k(pool(k)))
            state.rows_v = _cat(state.rows_v, finish_v(pool(v)))
        state.pending_scores, state.pending_k, state.pending_v = scores[:, done:], k[:, done:], v[:, done:]

    def _keep_keys(self, state: XLState, keys: Tensor, values: Tensor) -> None:
        """Hold the window keys of the current and the previous window segment."""
        keep_from = max(0, (state.seen // self.window_size - 1) * self.window_size)
        start = state.seen - keys.shape[1]
        state.keys, state.values = keys[:, keep_from - start :], values[:, keep_from - start :]

    def read_memory(self, memory: Tensor) -> XLState:
        """The state after the normalised memory (B, L, d), L a multiple of l: its window tail and projected rows.
        With ``projection_input="raw"`` the memory is compressed before ``W_K``/``W_V`` (official cache path)."""
        state, L, w = XLState(), memory.shape[1], self.window_size
        scores = self._split(self.dynamic_projection(memory)) if self.projection_rank else None
        if self.projection_input == "raw":  # W_K, W_V and LN_L only for the window tail; the rows pool the inputs
            _, _, k_win, v_win = self._window_keys(memory[:, max(0, (L // w - 1) * w) :])
            slices = self._split(memory)
            self._advance(
                state,
                count=L,
                scores=scores,
                inputs_k=slices,
                inputs_v=slices,
                finish_k=lambda x: self._ln_global(self._split(self.key(x.flatten(2)))),
                finish_v=lambda x: self._ln_global(self._split(self.value(x.flatten(2)))),
            )
        else:
            _, _, k_win, v_win = self._window_keys(memory)
            self._advance(
                state,
                count=L,
                scores=scores,
                inputs_k=k_win,
                inputs_v=v_win,
                finish_k=self._ln_global,
                finish_v=self._ln_global,
            )
        self._keep_keys(state, keys=k_win, values=v_win)
        return state

    def forward(self, h: Tensor, state: XLState, window_sinusoids: Tensor) -> Tensor:
        """h (B, n, d): normalised inputs of the n tokens after ``state.seen``; extends ``state`` in place.

        window_sinusoids (D, d): the relative encoding of window distances 0 .. D-1 (D = w, or 2w for the segment
        rule; the model applies its dropout to them, as the official code does)."""
        B, n, _ = h.shape
        w, l, r, H = self.window_size, self.segment_length, self.projection_rank, self.num_heads
        p0 = state.seen
        end = p0 + n
        q = self._split(self.query(h)) / math.sqrt(self.head_dim)
        k, v, k_win, v_win = self._window_keys(h)
        keys, values = _cat(state.keys, k_win), _cat(state.values, v_win)
        k_start = end - keys.shape[1]
        if r:
            inputs_k, inputs_v = (k, v) if self.projection_input == "raw" else (k_win, v_win)
            self._advance(
                state,
                count=n,
                scores=self._split(self.dynamic_projection(h)),
                inputs_k=inputs_k,
                inputs_v=inputs_v,
                finish_k=self._ln_global,
                finish_v=self._ln_global,
            )
        else:
            state.seen = end
        self._keep_keys(state, keys=keys, values=values)

        # Queries in aligned window segments: group g holds positions [g w, g w + w) and sees keys [g w - w, g w + w).
        first, last = p0 // w, (end + w - 1) // w
        G = last - first
        skip = p0 - first * w
        q_pos = torch.arange(first * w, last * w, device=h.device).view(G, w)
        k_pos = q_pos[:, :1] - w + torch.arange(2 * w, device=h.device)
        lo, hi = first * w - w, last * w
        tile_k, tile_v = (
            F.pad(x, (0, 0, 0, 0, max(0, k_start - lo), hi - end))[:, max(0, lo - k_start) :] for x in (keys, values)
        )
        tile_k, tile_v = (x.unfold(1, 2 * w, w) for x in (tile_k, tile_v))  # (B, G, H, d, 2w)
        if self.window_rule == "token":
            keep = (k_pos[:, None, :] > q_pos[:, :, None] - w) & (k_pos[:, None, :] <= q_pos[:, :, None])
        else:
            keep = window_keep(q_pos, k_pos, w, causal=True)
        keep = keep & ((k_pos >= k_start) & (k_pos < end))[:, None, :]  # (G, w, 2w)
        qg = F.pad(q, (0, 0, 0, 0, skip, G * w - skip - n)).view(B, G, w, H, -1)
        content = torch.einsum("bgihd,bghdj->bhgij", qg + self.content_bias, tile_k)
        distance = (w + torch.arange(w, device=h.device)[:, None] - torch.arange(2 * w, device=h.device)).clamp(
            0, window_sinusoids.shape[0] - 1
        )
        relative = self._split(self.window_position(window_sinusoids))  # (D, H, d)
        position = torch.einsum("bgihd,jhd->bhgij", qg + self.position_bias, relative)
        window_scores = content + position.gather(-1, distance.expand(*position.shape[:3], w, 2 * w))

        parts, visible = [], keep.any(-1)
        if state.rows_k is not None:
            R = state.rows_k.shape[1]
            seen = segment_keep(q_pos, torch.arange(R, device=h.device) // r, l)  # (G, w, R)
            row_distance = (q_pos[:, :, None] // l * r - 1 - torch.arange(R, device=h.device)).clamp(0, R - 1)
            row_relative = self._split(
                self.row_position(sinusoids(torch.arange(R, device=h.device), h.shape[-1]).to(h.dtype))
            )  # (R, H, d)
            row_scores = torch.einsum("bgihd,bjhd->bhgij", qg, state.rows_k)
            row_position = torch.einsum("bgihd,jhd->bhgij", qg, row_relative)
            row_scores = row_scores + row_position.gather(-1, row_distance.expand(*row_position.shape[:3], w, R))
            parts.append(row_scores.masked_fill(~seen, float("-inf")))
            visible = visible | seen.any(-1)
        # A padding query of the aligned layout may see no key: it keeps its whole tile (no NaN) and is cropped below.
        parts.append(window_scores.masked_fill(~(keep | ~visible[..., None]), float("-inf")))
        scores = torch.cat(parts, -1)
        prob = scores.to(torch.promote_types(scores.dtype, torch.float32)).softmax(-1).to(q.dtype)
        prob = F.dropout(prob, self.attention_dropout, self.training)
        context = torch.einsum("bhgij,bghdj->bgihd", prob[..., -2 * w :], tile_v)
        if state.rows_k is not None:
            context = context + torch.einsum("bhgij,bjhd->bgihd", prob[..., : -2 * w], state.rows_v)
        context = context.reshape(B, G * w, H * self.head_dim)[:, skip : skip + n]
        return self.dropout(self.output(context))


class LongShortXLFeedForward(nn.Module):
    def __init__(self, config: LongShortXLConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, h: Tensor) -> Tensor:
        return self.dropout(self.fc2(self.dropout(F.gelu(self.fc1(h)))))


class LongShortXLLayer(nn.Module):
    """The official Pre-LN layer: ``h = LN_1(h); h = h + Attn(h); h = LN_2(h); return h + FFN(h)``."""

    def __init__(self, config: LongShortXLConfig, layer_idx: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = LongShortXLAttention(config, layer_idx)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.feed_forward = LongShortXLFeedForward(config)

    def forward(self, h: Tensor, state: XLState, window_sinusoids: Tensor) -> Tensor:
        h = self.norm1(h)
        h = self.norm2(h + self.attention(h, state=state, window_sinusoids=window_sinusoids))
        return h + self.feed_forward(h)


class LongShortXLCacheLayer(LongShortCacheLayer):
    """One layer's decoding cache: an ``XLState`` that ``LongShortXLAttention`` extends in place."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.state = XLState()

    def reset(self) -> None:
        self.state = XLState()


class LongShortXLCache(Cache):
    """Decoding cache of ``LongShortXLForCausalLM``: per layer an ``XLState`` (the memory's and the seen tokens'
    window keys and projected rows), so a step costs O(w + r n / l)."""

    def __init__(self, config: LongShortXLConfig):
        super().__init__(layers=[LongShortXLCacheLayer() for _ in range(config.num_hidden_layers)])


@dataclass
class LongShortXLOutput(CausalLMOutputWithPast):
    """``CausalLMOutputWithPast`` plus ``memory``: per layer the detached inputs of the last ``memory_length``
    tokens (memory and block), to pass as ``memory`` with the next block of the same streams."""

    memory: tuple[Tensor, ...] | None = None


class LongShortXLPreTrainedModel(PreTrainedModel):
    config_class = LongShortXLConfig
    base_model_prefix = "long_short"
    _no_split_modules: ClassVar[list] = ["LongShortXLLayer"]

    @torch.no_grad()
    def _init_weights(self, module):
        """The official init: N(0, initializer_range) linears, embeddings and u, v; zero biases; LayerNorm weights
        N(1, initializer_range)."""
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, 0.0, std)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            init.normal_(module.weight, 1.0, std)
            init.zeros_(module.bias)
        elif isinstance(module, LongShortXLAttention):
            init.normal_(module.content_bias, 0.0, std)
            init.normal_(module.position_bias, 0.0, std)

    def initial_memory(self, batch_size: int, memory_length: int | None = None) -> tuple[Tensor, ...]:
        """The official start of ``batch_size`` streams: per layer a memory of ``memory_length`` (default
        ``config.memory_length``) zeros, unmasked (the official ``init_hid_cache``), to pass as ``memory`` with their
        first block. The first block's window keys and projected rows then include the zeros' ``LN_1`` output (the
        LayerNorm bias), as in the official model; ``memory=None`` starts with no memory instead (the first block
        sees only itself). One zero tensor serves every layer (the model never writes into a memory)."""
        config = self.config
        memory_length = config.memory_length if memory_length is None else memory_length
        check_memory_length(memory_length, config.causal_segment_length, "memory_length")
        zeros = torch.zeros(batch_size, memory_length, config.hidden_size, device=self.device, dtype=self.dtype)
        return (zeros,) * config.num_hidden_layers

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``PreTrainedModel.save_pretrained``, plus this package's modeling files and an ``auto_map`` naming the
        config and both classes, so that the folder also loads with ``trust_remote_code=True`` where ``ls_hf`` is not
        installed."""
        self.config.auto_map = hub_auto_map(LongShortXLConfig, AUTO_CLASSES_XL)
        return super().save_pretrained(save_directory, *args, **kwargs)


class LongShortXLModel(LongShortXLPreTrainedModel):
    """Embedding (scaled by sqrt(d)) and the Pre-LN layers; ``forward`` returns the last hidden states and the next
    memory."""

    def __init__(self, config: LongShortXLConfig):
        super().__init__(config)
        config.check_long_short()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.layers = nn.ModuleList([LongShortXLLayer(config, i) for i in range(config.num_hidden_layers)])
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings

    def set_input_embeddings(self, value):
        self.embeddings = value

    def forward(
        self,
        input_ids: torch.LongTensor,
        memory: Sequence[Tensor] | None = None,
        cache: LongShortXLCache | None = None,
        memory_length: int | None = None,
        past_key_values: LongShortXLCache | None = None,
    ) -> tuple[Tensor, tuple[Tensor, ...] | None]:
        """input_ids (B, n). memory: per layer (B, L, d) inputs of the L tokens before (L a multiple of l), read when
        the cache is empty (None: the stream starts here, with no memory; ``initial_memory``: the official start);
        cache: a ``LongShortXLCache`` (``past_key_values`` before Transformers 5.24). Returns (hidden states
        (B, n, d), next memory or None when ``memory_length`` is 0)."""
        cache = decoding_cache(cache, past_key_values)
        config = self.config
        memory_length = config.memory_length if memory_length is None else memory_length
        check_memory_length(memory_length, config.causal_segment_length, "memory_length")
        if memory is not None and len(memory) != config.num_hidden_layers:
            raise ValueError(f"memory must hold one tensor per layer ({config.num_hidden_layers}), got {len(memory)}.")
        h = self.embeddings(input_ids) * math.sqrt(config.hidden_size)
        longest = max(config.layer_value("window_size", i) for i in range(config.num_hidden_layers))
        span = longest if config.window_rule == "token" else 2 * longest
        window_sinusoids = self.dropout(sinusoids(torch.arange(span, device=h.device), h.shape[-1]).to(h.dtype))
        h = self.dropout(h)
        next_memory = []
        for i, layer in enumerate(self.layers):
            cache_layer = cache.layers[i] if cache is not None else None
            state = cache_layer.state if cache_layer is not None and cache_layer.state.seen else None
            if state is None:
                state = XLState()
                if memory is not None and memory[i].shape[1]:
                    mem = memory[i].to(h.dtype)
                    if mem.shape[1] % config.causal_segment_length:
                        raise ValueError(
                            f"memory[{i}] holds {mem.shape[1]} tokens, not a multiple of "
                            f"causal_segment_length ({config.causal_segment_length})."
                        )
                    state = layer.attention.read_memory(layer.norm1(mem))
                if cache_layer is not None:
                    cache_layer.state = state
            if memory_length:
                kept = _cat(memory[i] if memory is not None else None, h)
                kept = kept[
                    :,
                    kept.shape[1]
                    - min(
                        memory_length, kept.shape[1] // config.causal_segment_length * config.causal_segment_length
                    ) :,
                ]
                next_memory.append(kept.detach())
            h = layer(h, state=state, window_sinusoids=window_sinusoids)
        return self.dropout(h), (tuple(next_memory) if memory_length else None)


class LongShortXLForCausalLM(LongShortXLPreTrainedModel, GenerationMixin):
    """The official character-level Long-Short language model (paper Sec. 4.2, Table 4) with its memory.

    ``forward(input_ids, memory=previous.memory)`` continues the streams of the previous call (training with
    truncated backpropagation through time, or streaming evaluation); ``generate`` decodes with a
    ``LongShortXLCache`` and matches the full forward; the cache cannot be cropped, so assisted and prompt-lookup
    decoding are refused. Inputs are unpadded streams: an ``attention_mask`` with zeros is refused.
    """

    _tied_weights_keys: ClassVar[dict] = {"lm_head.weight": "long_short.embeddings.weight"}
    _is_stateful = True  # the cache cannot be cropped, told to Transformers < 5.25 (later: the layers' is_croppable)

    def __init__(self, config: LongShortXLConfig):
        super().__init__(config)
        self.long_short = LongShortXLModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        memory: Sequence[Tensor] | None = None,
        memory_length: int | None = None,
        cache: LongShortXLCache | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        shift_labels: torch.LongTensor | None = None,
        logits_to_keep: int | Tensor = 0,
        past_key_values: LongShortXLCache | None = None,
        **kwargs,
    ) -> LongShortXLOutput:
        """input_ids (B, n); memory: ``memory`` of the previous block's output; memory_length: tokens of memory to
        return (default ``config.memory_length``); labels (B, n): the input ids, shifted inside the loss; or
        shift_labels (B, n): the next tokens, which scores every input position (a stream's blocks)."""
        if input_ids is None:
            raise ValueError("input_ids is required (the model embeds token ids and scales them by sqrt(d)).")
        cache = decoding_cache(cache, past_key_values)
        if attention_mask is not None:
            batch, n = input_ids.shape
            lengths = (n,) if cache is None or not cache.get_seq_length() else (n, cache.get_seq_length() + n)
            if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] not in lengths:
                raise ValueError(
                    f"attention_mask must be (batch, tokens) = {(batch, n)}"
                    + (f" or (batch, cached + new tokens) = {(batch, lengths[1])}" if len(lengths) > 1 else "")
                    + f", all ones; got {tuple(attention_mask.shape)}: one entry per token of input_ids."
                )
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError(
                "LongShortXLForCausalLM models unpadded streams; attention_mask must be all ones (drop "
                "padding, or score rows of different lengths separately)."
            )
        scoring = labels is not None or shift_labels is not None
        use_cache = bool(self.config.use_cache if use_cache is None else use_cache) and not scoring
        if use_cache and cache is None:
            cache = LongShortXLCache(self.config)
        hidden, next_memory = self.long_short(input_ids, memory=memory, cache=cache, memory_length=memory_length)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep])
        loss = None
        if scoring:
            shift_labels = shift_labels.contiguous() if shift_labels is not None else None  # a slice of a stream
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size, shift_labels=shift_labels, **kwargs
            )
        return LongShortXLOutput(
            loss=loss, logits=logits, memory=next_memory, **{CACHE_NAME: cache if use_cache else None}
        )

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """Decode with a ``LongShortXLCache``; refuse any ``cache_implementation`` (those hold full K/V)."""
        prepare_own_cache(
            generation_config,
            model_kwargs,
            lambda: LongShortXLCache(self.config),
            "LongShortXL decodes only with LongShortXLCache",
        )
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)


# model class -> (Auto class, pipeline task), as modeling_long_short.HEADS.
HEADS_XL = {
    LongShortXLModel: ("AutoModel", "feature-extraction"),
    LongShortXLForCausalLM: ("AutoModelForCausalLM", "text-generation"),
}
AUTO_CLASSES_XL = {auto_name: model_class for model_class, (auto_name, _) in HEADS_XL.items()}

# Saving copies this file and its relative imports next to the weights (Hub remote code).
LongShortXLConfig.register_for_auto_class()
for _auto_name, _model_class in AUTO_CLASSES_XL.items():
    _model_class.register_for_auto_class(_auto_name)

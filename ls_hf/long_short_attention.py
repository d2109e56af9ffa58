"""Long-Short attention (Zhu et al., "Long-Short Transformer", NeurIPS 2021), in plain PyTorch.

One softmax per query over two key/value sets (paper Sec. 3.2-3.4, Eq. 3-7):

* short-term: a segment-wise sliding window. The sequence is cut into segments of ``w`` queries; a
  bidirectional segment attends to itself plus ``e = max(w // 2, 1)`` keys on each side (span 2w for
  even w, as the official code); a causal query attends to the ``w`` keys left of its segment and the
  non-future part of its segment (Appendix D, Fig. 5).
* long-range: the dynamic projection ``P = softmax_n(X W^P)`` (Eq. 3) compresses keys and values to
  ``r`` rows per head that every query sees. Causally (Eq. 5) each segment of ``l`` tokens is projected
  on its own, and a query at position t sees the rows of segments ``s < t // l`` only.
* DualLN (Eq. 7): ``LN_L`` on the window keys/values (which also feed the projection, Sec. 3.4) and
  ``LN_G`` on the projected rows, both over the full width as in the official code.
* global tokens (bidirectional, Longformer's ``global_attention_mask``): every token sees their keys, and they
  attend to every token, in the same softmax; see ``LongShortSelfAttention.forward``.

Visibility is defined once, as functions of token positions (``long_short_rules``). What every layer of a forward
pass shares (the tokens' validity, the global tokens, the backend and the fused path's block mask) is made once, by
the model, as an ``AttentionPlan`` (``long_short_plan``); the layer runs the joint softmax on its backend, the tile
paths of ``long_short_tiles`` or the fused path of ``long_short_fused``.

Causally a query at position t also sees ``r * (t // l)`` projected rows, so the cost is O(n (2w + r n / l)),
quadratic with the small factor r / l (the official causal models use r=1, l=16). A causal call with a
``CausalState`` is a prefill or a decoding step: fewer than ``w`` new queries see the cached window as one tile.
This file imports nothing from Transformers or timm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .long_short_fused import compiled_attention_layer, copies_of_extra_keys, joined_extra
from .long_short_kernels import DynamicProjection, layer_norm_in_place, segments_heads_first
from .long_short_plan import BACKENDS, AttentionPlan, LayerPlan, MaskPlan, plan_attention
from .long_short_rules import (
    check_attn_implementation,
    masked_sdpa,
    project_rows,
    projection_scores,
    validate_long_short_args,
)
from .long_short_tiles import (
    ExtraKeys,
    JointInputs,
    global_maps_layout,
    pad_seq,
    probabilities,
    sdpa,
    take,
    weighted,
)

__all__ = [
    "BACKENDS",
    "AttentionPlan",
    "BatchFirstState",
    "CausalState",
    "ExtraKeys",
    "JointInputs",
    "LongShortSelfAttention",
    "plan_attention",
]


class BatchFirstState:
    """A decoding cache whose tensors (named by ``_tensors``) are batch first, so beam search can reorder them."""

    _tensors: tuple = ()

    def map_batch(self, fn: Callable[[Tensor], Tensor]) -> None:
        """Apply ``fn`` to every cached tensor (index_select for beam search, repeat_interleave, ...)."""
        for name in self._tensors:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, fn(value))


@dataclass
class CausalState(BatchFirstState):
    """What causal decoding keeps per layer, batch first (so beam search can reorder it).

    ``keys``/``values``/``valid``: window keys (after ``LN_L``) of positions ``[seen - L, seen)``, enough for the
    segment of the next token and the one before it. ``rows_*``: projected rows of every finished segment of
    ``l`` tokens (after ``LN_G``), r per segment in segment order. ``pending``: the inputs X of the unfinished segment
    (its scores ``X W^P`` are computed when it is complete). A decoding step therefore costs O(w + r * seen / l).
    ``offsets``: each row's first real token (a row of padding only so far: ``seen``), from which its window and
    projection segments are counted; None while every row starts at position 0.
    """

    seen: int = 0
    keys: Tensor | None = None  # (B, L, H, d_qk)
    values: Tensor | None = None  # (B, L, H, d_v)
    valid: Tensor | None = None  # (B, L) bool
    rows_k: Tensor | None = None  # (B, N, H, d_qk)
    rows_v: Tensor | None = None  # (B, N, H, d_v)
    rows_valid: Tensor | None = None  # (B, N) bool
    pending: Tensor | None = None  # (B, p, D)
    offsets: Tensor | None = None  # (B,) long
    _tensors: tuple = field(
        default=("keys", "values", "valid", "rows_k", "rows_v", "rows_valid", "pending", "offsets"), repr=False
    )


def _concatenated(parts: list[ExtraKeys]) -> ExtraKeys | None:
    """The extra keys of ``parts`` as one set, in order; None without parts."""
    if len(parts) < 2:
        return parts[0] if parts else None
    return ExtraKeys(
        **{name: torch.cat([getattr(part, name) for part in parts], 1) for name in ("keys", "values", "valid")}
    )


class LongShortSelfAttention(nn.Module):
    """Multi-head Long-Short self-attention with its query/key/value/output projections.

    Args:
        hidden_size: model width d.
        num_heads: heads H; the value head dim is d / H.
        window_size: segment length w of the sliding window (0 disables the short-term branch, bidirectional).
        projection_rank: rows r of the dynamic projection per head (0 disables the long-range branch).
        causal: autoregressive attention (Eq. 5, Appendix D).
        segment_length: projection segment length l (causal only, ``1 <= l <= w``).
        use_dual_ln: DualLN (Eq. 7); off gives the paper's ablation (no LN on keys/values).
        qk_head_dim: LMSA compression: a query/key head dim smaller than the value head dim.
        attention_dropout: dropout on the joint attention probabilities.
        bias: biases on the query/key/value/output projections.
        layer_norm_eps: epsilon of the DualLN layers.
        global_projections: separate query/key/value projections for the global tokens' own attention (Longformer's
            ``query_global``/``key_global``/``value_global``); off, they use ``query``/``key``/``value``.
        recompute_window_tiles: in training, save for the backward pass about what fused dense attention saves. On
            CPU (the ``"lean"`` backend, ``long_short_kernels``): the window tiles are built one chunk of groups at
            a time and again in the backward pass, ``LN_L`` is written over its input and keeps its output only, and
            the projection's scores and weights P are built a few heads at a time, and again in the backward pass:
            less memory (``bench/RESULTS.md``), as fast on one thread, slower with several threads on a busy CPU. Where
            the fused path compiles the layer (CUDA), its backward pass computes P again instead (and the keys' and
            values' Linear outputs where they are kept) (``compiled_attention_layer(recompute=True)``). Off by default.
        attn_implementation: ``"sdpa"`` (Transformers' default): the fastest exact path where the tensors are,
            FlexAttention with a block-sparse mask on CUDA (``long_short_blocks.FUSED_DEVICES``; the grouped SDPA
            path while attention dropout is active), grouped ``scaled_dot_product_attention`` elsewhere; ``"eager"``:
            grouped ``scaled_dot_product_attention`` everywhere (the portable reference); ``"flex_attention"``:
            FlexAttention everywhere, forward only on CPU, no attention dropout. Any way, ``output_attentions`` and
            cached decoding steps use the SDPA/explicit path, and so do the global tokens' own rows and the cls
            token's output (dense over the n tokens, no window to mask). ``forward`` takes it too, for a model whose
            choice changes after it is built (``long_short_plan``).
        compile_attention: where the fused path runs on ``FUSED_DEVICES`` (CUDA), compile the rest of the
            layer around its attention kernel (``compiled_attention_layer``: the projections, DualLN, Eq. 3, the output
            projection), shared by every layer of the same settings in the process: fewer kernel launches, and what
            the backward pass needs recomputed rather than kept where that is cheaper. Not for calls with a decoding
            cache, nor inside a ``torch.compile`` of the caller's. False: only the attention kernel is compiled.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        window_size: int,
        projection_rank: int,
        *,
        causal: bool = False,
        segment_length: int | None = None,
        use_dual_ln: bool = True,
        qk_head_dim: int | None = None,
        attention_dropout: float = 0.0,
        bias: bool = True,
        layer_norm_eps: float = 1e-5,
        global_projections: bool = False,
        attn_implementation: str = "sdpa",
        recompute_window_tiles: bool = False,
        compile_attention: bool = True,
    ):
        super().__init__()
        check_attn_implementation(attn_implementation)
        self.attn_implementation = attn_implementation
        self.recompute_window_tiles = recompute_window_tiles
        self.compile_attention = compile_attention
        validate_long_short_args(
            hidden_size=hidden_size,
            num_heads=num_heads,
            window_size=window_size,
            projection_rank=projection_rank,
            causal=causal,
            segment_length=segment_length,
            qk_head_dim=qk_head_dim,
            attention_dropout=attention_dropout,
        )
        if global_projections and causal:
            raise ValueError(
                "global_projections serve global tokens, which only bidirectional attention has; "
                "leave it False with causal=True."
            )
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.qk_head_dim = qk_head_dim or self.head_dim
        self.window_size = window_size
        self.projection_rank = projection_rank
        self.causal = causal
        self.segment_length = segment_length if projection_rank else None
        self.use_dual_ln = use_dual_ln
        self.attention_dropout = attention_dropout

        qk_width = num_heads * self.qk_head_dim
        self.query = nn.Linear(hidden_size, qk_width, bias=bias)
        self.key = nn.Linear(hidden_size, qk_width, bias=bias)
        self.value = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.output = nn.Linear(hidden_size, hidden_size, bias=bias)
        # W^P of Eq. 3: r score columns per head, computed from the layer input.
        self.dynamic_projection = nn.Linear(hidden_size, num_heads * projection_rank) if projection_rank else None
        self.global_query = self.global_key = self.global_value = None
        if global_projections:
            self.global_query = nn.Linear(hidden_size, qk_width, bias=bias)
            self.global_key = nn.Linear(hidden_size, qk_width, bias=bias)
            self.global_value = nn.Linear(hidden_size, hidden_size, bias=bias)
        # DualLN (Eq. 7): LN_L (local) and LN_G (global) over the full width; LMSA's narrower keys get their own pair.
        self.dual_ln_local = self.dual_ln_global = self.dual_ln_local_key = self.dual_ln_global_key = None
        if use_dual_ln:
            self.dual_ln_local = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
            self.dual_ln_global = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
            if qk_width != hidden_size:
                self.dual_ln_local_key = nn.LayerNorm(qk_width, eps=layer_norm_eps)
                self.dual_ln_global_key = nn.LayerNorm(qk_width, eps=layer_norm_eps)

    # ------------------------------------------------------------------ helpers
    def _dual_ln_norm(self, *, local: bool, is_key: bool) -> nn.LayerNorm | None:
        """LN_L (``local``) or LN_G of the keys (``is_key``, their own under LMSA) or values; None without DualLN."""
        if not self.use_dual_ln:
            return None
        norm, key_norm = (
            (self.dual_ln_local, self.dual_ln_local_key) if local else (self.dual_ln_global, self.dual_ln_global_key)
        )
        return key_norm if is_key and key_norm is not None else norm

    def _dual_ln(self, x: Tensor, *, local: bool, is_key: bool, in_place: bool = False) -> Tensor:
        """LN_L (``local``) or LN_G over the full width of x (..., H * d), the keys' own pair under LMSA; ``in_place``:
        written over x, which nothing else needs, saving its output rather than its input for the backward pass
        (``layer_norm_in_place``; its input recoverable from its output)."""
        norm = self._dual_ln_norm(local=local, is_key=is_key)
        if norm is None:
            return x
        return layer_norm_in_place(x, norm) if in_place else norm(x)

    def _local_keys_values(self, hidden_states: Tensor, layer: LayerPlan, normalize: bool) -> tuple[Tensor, Tensor]:
        """``LN_L(x W_K)`` and ``LN_L(x W_V)`` (Eq. 7), (B, n, H, d). ``layer.lean``: the Linears computed on the (B n)
        rows, so that each output is a tensor of its own rather than a view, which each LayerNorm is written over where
        its input is recoverable (``layer.local_norm``). ``normalize=False``: ``x W_K`` and ``x W_V``, whose ``LN_L``
        comes where the keys are joined with the projected rows."""
        B, n, _ = hidden_states.shape
        rows = hidden_states.flatten(0, 1) if layer.lean else hidden_states
        keys_values = []
        for linear, is_key in ((self.key, True), (self.value, False)):
            x = linear(rows)
            if normalize:
                x = self._dual_ln(x, local=True, is_key=is_key, in_place=layer.lean and layer.local_norm)
            keys_values.append(self._split(x.view(B, n, -1)))
        return tuple(keys_values)

    def _normalized_local(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """``LN_L`` of the Linears' outputs k, v (B, n, H, d) that ``_local_keys_values(normalize=False)`` gave."""
        return tuple(
            self._split(self._dual_ln(x.flatten(2), local=True, is_key=is_key)) for x, is_key in ((k, True), (v, False))
        )

    def _split(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.num_heads, -1))

    def _project(
        self, hidden: Tensor, keys: Tensor, values: Tensor, valid: Tensor | None, segment: int, lean: bool = False
    ) -> ExtraKeys:
        """Eq. 3 / Eq. 5 (``project_rows`` on the scores ``X W^P``) on each segment of ``segment`` tokens, then
        ``LN_G``: hidden X (B, S*segment, D), keys/values (B, S*segment, H, d), valid (B, S*segment), or None when
        every token is valid -> S*r rows, segment-major. ``lean``: through ``DynamicProjection``, which never holds
        the scores or P of all heads."""
        B, n = keys.shape[:2]
        S = n // segment
        seg_valid = None if valid is None else valid.view(B, S, segment)
        keys_first, values_first = segments_heads_first(keys, S), segments_heads_first(values, S)
        if lean:
            rows = DynamicProjection.apply(
                hidden.unflatten(1, (S, segment)),
                self.dynamic_projection.weight,
                self.dynamic_projection.bias,
                keys_first,
                values_first,
                seg_valid,
            )
        else:
            rows = project_rows(self._projection_scores(hidden, S), keys_first, values_first, seg_valid)
        rows_k, rows_v = (x.permute(0, 1, 3, 2, 4).flatten(1, 2) for x in rows)  # (B, S*r, H, d)
        return ExtraKeys(
            keys=self._split(self._dual_ln(rows_k.flatten(2), local=False, is_key=True)),
            values=self._split(self._dual_ln(rows_v.flatten(2), local=False, is_key=False)),
            valid=self._rows_valid(seg_valid, B, S, keys.device),
        )

    def _projection_scores(self, hidden: Tensor, segments: int) -> Tensor:
        """The scores ``X W^P`` of Eq. 3 of hidden X (B, S*l, D) in S segments: (B, S, H, r, l), each segment's l
        scores contiguous (``projection_scores``)."""
        scores = projection_scores(self.dynamic_projection, hidden)  # (B, H r, S l)
        return scores.unflatten(1, (self.num_heads, -1)).unflatten(-1, (segments, -1)).permute(0, 3, 1, 2, 4)

    def _rows_valid(self, seg_valid: Tensor | None, batch: int, segments: int, device: torch.device) -> Tensor:
        """(B, S*r): a projected row exists where its segment (valid (B, S, l), or None: all valid) has a valid
        token."""
        if seg_valid is None:
            return torch.ones(batch, segments * self.projection_rank, dtype=torch.bool, device=device)
        return seg_valid.any(-1).repeat_interleave(self.projection_rank, dim=1)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        *,
        global_attention_mask: Tensor | None = None,
        cls_hidden: Tensor | None = None,
        state: CausalState | None = None,
        output_attentions: bool = False,
        attn_implementation: str | None = None,
        plan: AttentionPlan | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Args:
            hidden_states: (B, n, d); with ``state``, the n new tokens that follow ``state.seen`` earlier ones.
            attention_mask: (B, n) with 1/True for real tokens; with ``state``, (B, seen + n) too.
            global_attention_mask: (B, n) with 1/True for global tokens (bidirectional; Longformer's meaning; a padded
                token is never global). Every other token sees a global token's key/value ``LN_G(x W_K)``,
                ``LN_G(x W_V)`` (the official LRA cls key) beside the projected rows, in its one softmax; the window
                segments are laid out over the other tokens in their order and the projection (Eq. 3) pools them only,
                so a global token is seen once. A global token attends in one softmax to every real token's
                ``LN_L`` key (itself included; with ``global_projections`` its own projections) and the projected
                rows. Work O(n (2w + r + k)) for k global tokens; no n x n tensor.
            cls_hidden: (B, 1, d) global token (bidirectional): it joins the projected keys and attends to the
                other tokens' outputs (official LRA/vision "post-CLS"); the output then has 1 + n rows. Not with
                ``global_attention_mask``.
            state: ``CausalState`` to read and extend (causal decoding).
            output_attentions: also return the joint probabilities, (B, H, n, R + S): for each query its weights
                over the R projected rows (cls first; causal: all finished segments' rows) and then the S window
                keys of its segment in position order (bidirectional S = w + 2e; causal S = 2w, or the whole cached
                window when fewer than w tokens are fed). With global tokens, K the most global tokens of a sample in
                the batch, (B, H, n, K + R + S + K): columns [the global tokens' keys | R projected rows | S window
                keys | the weights that the K global tokens' queries give this token]; a sample with k < K global
                tokens has them, in position order, in the last k of each K block. A global token's row holds its
                weights over the global tokens and the projected rows (window columns 0); its weight on another token
                t sits in row t's last K columns (Longformer's ``global_attentions``, transposed). Every output row,
                a global token's included, is computed from these maps, so gradients reach them (``retain_grad``).
            attn_implementation: this call's implementation (Transformers models pass their config's, which
                ``set_attn_implementation`` changes); None: the one the module was built with.
            plan: the ``AttentionPlan`` that a model made once for all its layers (``plan_attention``), in place of
                the masks, ``output_attentions`` and ``attn_implementation``; None: the layer makes its own.

        Returns ``(output, attentions or None)``; rows of padded tokens are the output bias (context 0).
        """
        if plan is None:
            plan = plan_attention(
                [self],
                hidden_states,
                attention_mask=attention_mask,
                global_attention_mask=global_attention_mask,
                cls_hidden=cls_hidden,
                cached_tokens=None if state is None else state.seen,
                output_attentions=output_attentions,
                attn_implementation=attn_implementation,
            )
        elif attention_mask is not None or global_attention_mask is not None or output_attentions:
            raise ValueError(
                "Pass either a plan or the masks and output_attentions, not both: the plan holds them (make it with "
                "plan_attention(..., attention_mask=..., global_attention_mask=..., output_attentions=...))."
            )
        layer = plan.for_layer(self, cached=state is not None)
        attend = LongShortSelfAttention._attend
        if plan.compiled:
            attend = compiled_attention_layer(attend, recompute=self.recompute_window_tiles)
        return attend(self, hidden_states, masks=plan.masks, layer=layer, cls_hidden=cls_hidden, state=state)

    def _attend(
        self, hidden_states: Tensor, *, masks: MaskPlan, layer: LayerPlan, cls_hidden: Tensor | None, state
    ) -> tuple[Tensor, Tensor | None]:
        """The layer after the plan: the projections, the attention and the output projection (as
        ``compiled_attention_layer`` runs it). ``LN_L`` is applied where the keys are joined with the projected rows
        when its input is recoverable there (``layer.local_norm``), here otherwise."""
        joined_norm = layer.joins_keys and layer.local_norm
        q = self._split(self.query(hidden_states))
        k, v = self._local_keys_values(hidden_states, layer, normalize=not joined_norm)
        if self.causal and state is None and torch.compiler.is_exporting():
            context, attn = self._causal_exported(q=q, k=k, v=v, hidden=hidden_states, masks=masks, layer=layer)
        elif self.causal:
            context, attn = self._causal(
                q=q, k=k, v=v, hidden=hidden_states, masks=masks, state=state, layer=layer, joined_norm=joined_norm
            )
        else:
            context, attn = self._bidirectional(
                q=q,
                k=k,
                v=v,
                hidden_states=hidden_states,
                masks=masks,
                cls_hidden=cls_hidden,
                layer=layer,
                joined_norm=joined_norm,
            )
        return self.output(context.flatten(2)), attn

    def _joint_softmax(
        self, inputs: JointInputs, *, q_valid: Tensor | None, layer: LayerPlan, layout=None
    ) -> tuple[Tensor, Tensor | None]:
        """Queries attend to [extra keys; window keys] in one softmax (Eq. 6), on the layer's backend. q_valid (B, m),
        or None when every query is real; ``layout``: the caller's maps made from the probabilities and read back
        (``"maps"`` only). Returns the context (B, m, H, d_v), zero for invalid queries, and the maps or None."""
        context, maps = layer.attend(self, inputs, layer, layout)
        if q_valid is not None:
            context = context * q_valid[:, :, None, None].to(context.dtype)
        return context, maps

    def _global_keys(self, hidden: Tensor, valid: Tensor) -> ExtraKeys:
        """Global tokens (B, k, d) as every token sees them: ``LN_G`` of their raw key/value (official LRA cls)."""
        return ExtraKeys(
            keys=self._split(self._dual_ln(self.key(hidden), local=False, is_key=True)),
            values=self._split(self._dual_ln(self.value(hidden), local=False, is_key=False)),
            valid=valid,
        )

    def _bidirectional(self, *, q, k, v, hidden_states, masks: MaskPlan, cls_hidden, layer: LayerPlan, joined_norm):
        """The n tokens attend in the plan's order (the others first, then the K global tokens, which the window and
        the projection skip). ``joined_norm``: k, v are the Linears' outputs, normalized by ``LN_L`` where they are
        joined with the projected rows."""
        if masks.padding:  # a traced call's slots for its global tokens (``long_short_plan._mask_plan``)
            q, k, v, hidden_states = (pad_seq(x, 0, masks.padding) for x in (q, k, v, hidden_states))
        B, n = q.shape[:2]
        K = masks.global_count
        masked = masks.valid is not None
        valid = masks.valid if masked else torch.ones(B, n, dtype=torch.bool, device=hidden_states.device)
        local, projection_inputs, is_global, order = valid, hidden_states, None, masks.order
        if K:
            q, k, v = (take(x, order) for x in (q, k, v))
            valid, is_global, local = masks.ordered_valid, masks.ordered_global, masks.local
            projection_inputs = take(hidden_states, order) if self.projection_rank else None
        extra = []  # global tokens' keys first, then the projected rows
        if cls_hidden is not None:
            extra.append(self._global_keys(cls_hidden, valid.new_ones(B, 1)))
        if K:
            extra.append(self._global_keys(take(hidden_states, order[:, n - K :]), is_global[:, n - K :]))
        width = n if self.window_size else 0  # projection only: no window keys
        projected, extra = None, _concatenated(extra)  # one set: global keys, then projected rows
        if self.projection_rank:
            projection_valid = local if masked or K else None
            if layer.joins_keys:  # rows in one tensor with the window keys
                extra, projected = joined_extra(
                    self,
                    projection_inputs,
                    k,
                    v,
                    projection_valid,
                    prefix=extra,
                    local_norm=joined_norm,
                    copies=copies_of_extra_keys(self, n),
                )
                k, v = (x[:, :n] for x in extra.joined)
            else:
                projected = self._project(projection_inputs, k, v, projection_valid, segment=n, lean=layer.lean)
                extra = _concatenated([part for part in (extra, projected) if part is not None])
        layout = None
        if K:
            g_q, g_k, g_v, g_keep = self._global_inputs(
                hidden_states=hidden_states, order=order, q=q, k=k, v=v, valid=valid, count=K, projected=projected
            )
            if layer.output_attentions:
                maps = probabilities(self, g_q, g_k, g_keep)
                *layout, global_from_maps = global_maps_layout(maps, is_global, order)
        inputs = JointInputs(
            q=q,
            q_start=0,
            k=k[:, :width],
            v=v[:, :width],
            k_valid=local[:, :width],
            k_start=0,
            extra=extra,
            all_valid=not masked and not K,
        )
        context, attn = self._joint_softmax(inputs, q_valid=local if masked or K else None, layer=layer, layout=layout)
        if cls_hidden is not None:
            context = torch.cat([self._cls_output(cls_hidden, context, valid), context], dim=1)
        if K:  # the global tokens' rows (the last K slots in ``order``), then the tokens back in position order
            if layer.output_attentions:
                out = weighted(global_from_maps(attn), g_v, g_q.dtype)
            else:
                out = sdpa(self, g_q, g_k, g_v, g_keep)
            rows = is_global[:, n - K :, None, None]
            context = torch.cat([context[:, : n - K], torch.where(rows, out.transpose(1, 2), context[:, n - K :])], 1)
            context = take(context, torch.argsort(order, dim=1))
        if masks.padding:
            context = context[:, : n - masks.padding]
        return context, attn

    def _global_inputs(self, *, hidden_states, order, q, k, v, valid, count, projected):
        """In the token ``order`` of ``_bidirectional`` the last ``count`` slots hold the global tokens: each attends
        to the projected rows and every real token in one softmax. Returns their queries, those keys and values
        (heads first, projected rows first) and the keep mask, for ``_sdpa`` or ``_probabilities``."""
        n, K = q.shape[1], count
        if self.global_query is not None:
            hidden_states = take(hidden_states, order)
            q_g = self._split(self.global_query(hidden_states[:, n - K :]))
            k = self._split(self._dual_ln(self.global_key(hidden_states), local=True, is_key=True))
            v = self._split(self._dual_ln(self.global_value(hidden_states), local=True, is_key=False))
        else:
            q_g = q[:, n - K :]
        R = projected.keys.shape[1] if projected is not None else 0
        if R:
            k, v, valid = (
                torch.cat(pair, 1) for pair in ((projected.keys, k), (projected.values, v), (projected.valid, valid))
            )
        keep = valid[:, None, None, :]
        keep = keep | ~keep.any(-1, keepdim=True)  # a sample of padding only: finite, discarded
        return q_g.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), keep

    def _cls_output(self, cls_hidden, context, valid):
        """The cls token attends to its own raw key/value and to the other tokens' contexts (official post-CLS)."""
        q = self._split(self.query(cls_hidden)).transpose(1, 2)  # (B, H, 1, d)
        keys = torch.cat([self._split(self.key(cls_hidden)), context], 1).transpose(1, 2)
        values = torch.cat([self._split(self.value(cls_hidden)), context], 1).transpose(1, 2)
        keep = torch.cat([valid.new_ones(valid.shape[0], 1), valid], 1)[:, None, None, :]
        out = masked_sdpa(q, keys.to(q.dtype), values.to(q.dtype), keep)
        return out.transpose(1, 2)

    def _causal(self, *, q, k, v, hidden, masks: MaskPlan, state: CausalState | None, layer: LayerPlan, joined_norm):
        """Causal attention of n new tokens at positions ``[p0, p0 + n)`` given what ``state`` holds; extends it (None:
        a forward pass without a cache, from position 0). ``joined_norm``: k, v are the Linears' outputs, normalized
        by ``LN_L`` where they are joined with the projected rows, and here otherwise.

        Each row counts its window and projection segments from its first real token (``_first_real``), so a row's
        output does not depend on left padding beside it: the same rule in a full forward and in every cached call."""
        B, n = q.shape[:2]
        w, r, l = self.window_size, self.projection_rank, self.segment_length
        state = state if state is not None else CausalState()
        p0, end = state.seen, state.seen + n
        valid = q_valid = masks.valid
        offsets = self._first_real(masks.leading, state)
        all_valid = q_valid is None and p0 == 0  # every key is a real token
        seg_start, done = ((p0 // l) * l, (end // l) * l) if r else (0, 0)
        joins = layer.joins_keys and offsets is None and done > seg_start
        if joined_norm and not joins:
            k, v = self._normalized_local(k, v)
        if valid is None:
            valid = torch.ones(B, n, dtype=torch.bool, device=hidden.device)
        # Window keys of positions [k_start, end): the cached tail and the new tokens.
        k_all, v_all, valid_all = (
            torch.cat([old, new], 1) if old is not None else new
            for old, new in ((state.keys, k), (state.values, v), (state.valid, valid))
        )
        k_start = end - k_all.shape[1] if state.keys is not None else p0  # an int, not a symbolic 0, when compiled

        # Projected rows, r per segment in segment order: the finished segments' plus those the new tokens complete.
        rows_k, rows_v, rows_valid, pending = state.rows_k, state.rows_v, state.rows_valid, None
        joined = None
        if r:
            all_hidden = torch.cat([state.pending, hidden], 1) if state.pending is not None else hidden
            if offsets is None:
                if joins:  # rows and window keys in one tensor
                    joined, projected = joined_extra(
                        self,
                        all_hidden[:, :done],
                        k_all,
                        v_all,
                        None if all_valid else valid_all[:, :done],
                        None,
                        l,
                        local_norm=joined_norm,
                    )
                    rows_k, rows_v, rows_valid = projected.keys, projected.values, projected.valid
                    k_all, v_all = (x[:, : k_all.shape[1]] for x in joined.joined)
                elif done > seg_start:
                    span = slice(seg_start - k_start, done - k_start)
                    new_k, new_v, new_valid = self._project(
                        all_hidden[:, : done - seg_start],
                        k_all[:, span],
                        v_all[:, span],
                        None if all_valid else valid_all[:, span],
                        l,
                        lean=layer.lean,
                    )[:3]
                    if rows_k is not None:
                        new_k, new_v, new_valid = (
                            torch.cat(pair, 1) for pair in ((rows_k, new_k), (rows_v, new_v), (rows_valid, new_valid))
                        )
                    rows_k, rows_v, rows_valid = new_k, new_v, new_valid
                pending = all_hidden[:, done - seg_start :]
            else:
                rows_k, rows_v, rows_valid = self._project_per_row(
                    state=state,
                    hidden=all_hidden,
                    keys=k_all,
                    values=v_all,
                    valid=valid_all,
                    k_start=k_start,
                    end=end,
                    offsets=offsets,
                    lean=layer.lean,
                )
                pending = all_hidden[:, max(0, all_hidden.shape[1] - l + 1) :]  # every row's unfinished segment
        extra = None
        if rows_k is not None:
            segment = torch.arange(rows_k.shape[1], device=q.device) // r
            # built whole: under torch.compile, ``_replace``'s tuple cannot be rebuilt across a graph break (torch 2.11)
            extra = ExtraKeys(rows_k, rows_v, rows_valid, segment, joined=None if joined is None else joined.joined)
        inputs = JointInputs(
            q=q,
            q_start=p0,
            k=k_all,
            v=v_all,
            k_valid=valid_all,
            k_start=k_start,
            extra=extra,
            offsets=offsets,
            all_valid=all_valid,
        )
        context, attn = self._joint_softmax(inputs, q_valid=q_valid, layer=layer)

        # Keep the keys of the current and the previous window segment of every row, and the unfinished segment's
        # inputs.
        keep_from = max(k_start, (end // w - 1) * w if offsets is None else end - 2 * w + 1)
        state.keys, state.values, state.valid = (t[:, keep_from - k_start :] for t in (k_all, v_all, valid_all))
        state.rows_k, state.rows_v, state.rows_valid, state.pending = rows_k, rows_v, rows_valid, pending
        state.seen, state.offsets = end, offsets
        return context, attn

    def _causal_exported(self, *, q, k, v, hidden, masks: MaskPlan, layer: LayerPlan):
        """``_causal`` without a cache in an exported graph (``torch.export``, as ONNX exports): the same function,
        laid out so that no shape depends on how the length compares with w or l. A row with left padding is shifted
        to start at column 0 (its rules count from its first real token, ``_first_real``) and back after; Eq. 5
        projects the inputs zero-padded to whole segments, two at least, the unfinished last one seen by no query."""
        B, n = q.shape[:2]
        r, l = self.projection_rank, self.segment_length
        valid = masks.valid if masks.valid is not None else torch.ones(B, n, dtype=torch.bool, device=q.device)
        positions = torch.arange(n, device=q.device)[None]
        if masks.leading is not None:  # slot j holds the row's token j + leading
            source = positions + masks.leading[:, None]
            q, k, v, hidden, valid = (take(x, source.clamp(max=n - 1)) for x in (q, k, v, hidden, valid))
            valid = valid & (source < n)
        extra = None
        if r:
            segments = torch.sym_max((n + l - 1) // l, 2)
            whole = (pad_seq(x, 0, segments * l - n) for x in (hidden, k, v, valid))
            rows = self._project(*whole, l)
            extra = ExtraKeys(rows.keys, rows.values, rows.valid, torch.arange(segments * r, device=q.device) // r)
        inputs = JointInputs(q=q, q_start=0, k=k, v=v, k_valid=valid, k_start=0, extra=extra)
        context, attn = self._joint_softmax(inputs, q_valid=valid, layer=layer)
        if masks.leading is not None:  # back to the positions: token j of the row from slot j - leading
            target = positions - masks.leading[:, None]
            context = take(context, target.clamp(min=0)) * (target >= 0)[..., None, None].to(context.dtype)
        return context, attn

    @staticmethod
    def _first_real(leading: Tensor | None, state: CausalState) -> Tensor | None:
        """Each row's first real token, the position its segments count from (B,): a row of padding only so far gets
        the position after this call's tokens, and moves to its first real token when one comes. None while every
        row's first token is real. ``leading``: this call's padding before each row's first real token (the plan's,
        read once a forward pass; under ``torch.compile``, which cannot branch on values, kept even when all are 0,
        which gives the same results), None where no row has any."""
        if (state.seen == 0 and leading is None) or (state.seen > 0 and state.offsets is None):
            return None
        if state.seen == 0:
            return leading
        return torch.where(state.offsets == state.seen, state.seen + (0 if leading is None else leading), state.offsets)

    def _project_per_row(self, *, state, hidden, keys, values, valid, k_start, end, offsets, lean):
        """Eq. 5 for rows whose segments start at their own ``offsets``: the segments of l tokens that the new tokens
        complete in each row, projected (``_project``) and written into the row's segment slots (r rows per segment,
        segment s at slots ``[s r, (s + 1) r)``); a row's slots past its finished segments are invalid.
        hidden (B, A, D) holds the inputs of positions ``[end - A, end)``, keys/values/valid those of
        ``[k_start, end)``."""
        B, A = hidden.shape[:2]
        l, r = self.segment_length, self.projection_rank
        p0 = state.seen
        if end // l == 0:  # no segment can have ended yet
            return state.rows_k, state.rows_v, state.rows_valid
        first = torch.div(p0 - offsets, l, rounding_mode="floor").clamp(min=0)
        last = torch.div(end - offsets, l, rounding_mode="floor").clamp(min=0)
        count = (end - p0) // l + 1  # at most so many segments of a row end among the new tokens
        segment = first[:, None] + torch.arange(count, device=offsets.device)  # (B, count)
        done = segment < last[:, None]
        position = (offsets[:, None, None] + segment[..., None] * l + torch.arange(l, device=offsets.device)).flatten(
            1
        )  # (B, count l)
        token_done = done.repeat_interleave(l, dim=1)
        at_hidden = torch.where(token_done, position - (end - A), 0)
        at_keys = torch.where(token_done, position - k_start, 0)
        new = self._project(
            take(hidden, at_hidden),
            take(keys, at_keys),
            take(values, at_keys),
            take(valid, at_keys) & token_done,
            l,
            lean=lean,
        )
        width = r * (end // l)
        slot = torch.where(done, segment, end // l)[..., None] * r + torch.arange(r, device=offsets.device)
        slot = slot.flatten(1)  # (B, count r); the segments not done write to a spare slot, dropped
        merged = []
        for old, part in ((state.rows_k, new.keys), (state.rows_v, new.values), (state.rows_valid, new.valid)):
            grown = part.new_zeros(B, width + r, *part.shape[2:])
            if old is not None:
                grown = torch.cat([old, grown[:, old.shape[1] :]], 1)
            index = slot.view(B, -1, *(1,) * (part.dim() - 2)).expand_as(part)
            merged.append(grown.scatter(1, index, part)[:, :width])
        return merged

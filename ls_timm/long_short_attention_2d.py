"""2-D Long-Short attention over feature maps (Zhu et al., "Long-Short Transformer", NeurIPS 2021, Sec. 3, 4.3).

Every patch query takes one softmax over three key/value sets (Eq. 6):

* short-term (Sec. 3.2, 2-D as in the official ``imagenet/`` code): the map is cut into ``w x w`` query blocks;
  a block sees the ``(w + 2e) x (w + 2e)`` key tile centred on it, ``e = max(w // 2, 1)`` (13 x 13 for w = 7,
  2w x 2w for even w); keys outside the map are masked;
* long-range (Eq. 3): ``P = softmax_HW(X W^P)`` compresses the keys/values of all patches to ``r`` rows per head;
* global tokens (cls): every patch sees them; a global token attends to its own key and to the patch *outputs*
  (the official "post-cls" form).

DualLN (Eq. 7) normalises keys/values of all tokens (``dual_ln_local``) and the projected rows (``dual_ln_global``)
over the full width. Visibility is defined once, as a function of 2-D positions (``window_keep_2d``); two layouts
hand it to a single ``F.scaled_dot_product_attention`` call (fused kernels, no score tensor in Python):

* blocked: the w x w query blocks are gathered (``index_select``) against their key tiles plus the projected and
  global rows, with a (blocks x keys) mask; O(HW (w + 2e)^2 + HW r) work and memory;
* dense (maps of at most ``dense_max_tokens`` patches, where blocks of a few queries cost more than they save):
  all patch queries against all keys with the (HW x keys) visibility mask.

Maps whose sides are not multiples of ``w`` get partial last blocks: positions outside the map are masked keys and
dropped queries, so any input size works.

This is the one home of the 2-D math in ``ls_timm``; ``vil_ls`` and ``cvt_ls`` only choose its options.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LongShortAttention2d", "validate_ls_2d_args", "window_keep_2d"]


def validate_ls_2d_args(
    *, dim: int, num_heads: int, window_size: int, projection_rank: int, qk_dim: int | None = None
) -> None:
    """Raise ``ValueError`` naming the offending argument and the fix."""
    for name, value, low in (("dim", dim, 1), ("num_heads", num_heads, 1), ("window_size", window_size, 1),
                             ("projection_rank", projection_rank, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")
    if dim % num_heads:
        raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads}); pick a head count that divides it.")
    if qk_dim is not None and (not isinstance(qk_dim, int) or qk_dim < num_heads or qk_dim % num_heads):
        raise ValueError(f"qk_dim (LMSA query/key width) must be a positive multiple of num_heads ({num_heads}), "
                         f"got {qk_dim!r}.")


def window_keep_2d(q_yx: Tensor, k_yx: Tensor, window: int, size: tuple[int, int]) -> Tensor:
    """Whether the query at 2-D position ``q_yx[..., i, :]`` sees the key at ``k_yx[..., j, :]``: (..., Q, K) bool.

    A query in block ``(y // w, x // w)`` sees keys whose coordinates lie in ``[s - e, s + w + e)`` per axis, with
    ``s`` the block start and ``e = max(w // 2, 1)``, and inside the ``size = (H, W)`` map.
    """
    ext = max(window // 2, 1)
    q = q_yx.unsqueeze(-2)
    k = k_yx.unsqueeze(-3)
    start = torch.div(q, window, rounding_mode="floor") * window
    inside = (k >= 0) & (k < torch.tensor(size, device=k.device))
    return ((k >= start - ext) & (k < start + window + ext) & inside).all(-1)


def _grid(h: int, w: int, device=None) -> Tensor:
    """(h, w, 2) integer (y, x) coordinates."""
    ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    return torch.stack([ys, xs], -1)


def vil_window_bias_index(window: int) -> Tensor:
    """Index into the official ViL-LS window bias table for (query in block, key in tile): (w^2, (w + 2p)^2).

    Reproduces ``imagenet/models/layers/transformer_ls.py`` exactly, including its non-injective row multiplier
    ``2p + w`` (p = w // 2), so the released tables load unchanged. Table rows: ``2(w + p - 1)(2p + w + 1) + 1``.
    """
    pad = window // 2
    rel = _grid(window, window).view(-1, 1, 2) - (_grid(window + 2 * pad, window + 2 * pad) - pad).view(1, -1, 2)
    rel = rel + pad + window - 1
    return rel[..., 0] * (2 * pad + window) + rel[..., 1]


def _gather_rows(x: Tensor, index: Tensor) -> Tensor:
    """Rows ``index`` (any shape) of ``x`` viewed as (rows, d): shape ``index.shape + (d,)``. One gather over dim 0
    is 2-3x faster on CPU than ``index_select`` along an inner dim, and lands in the layout the caller needs."""
    d = x.shape[-1]
    return x.reshape(-1, d).index_select(0, index.flatten()).view(*index.shape, d)


class StdConv2d(nn.Conv2d):
    """Conv2d with weight standardisation (Qiao et al., arXiv:1903.10520): each filter is normalised to zero mean,
    unit variance before use (CvT*-LS's dynamic projection, Appendix E). Closed form: ``F.batch_norm`` on the
    weights is orders of magnitude slower on CPU for depthwise filters."""

    def __init__(self, *args, eps: float = 1e-5, **kwargs):
        super().__init__(*args, **kwargs)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        w = (w - w.mean((1, 2, 3), keepdim=True)) * torch.rsqrt(w.var((1, 2, 3), unbiased=False, keepdim=True) + self.eps)
        return self._conv_forward(x, w, self.bias)


class LongShortAttention2d(nn.Module):
    """Long-Short self-attention on ``num_prefix_tokens`` global tokens followed by an (H, W) patch map.

    Args:
        dim: token width C.
        num_heads: heads; value head dim C / heads.
        window_size: query block side w of the short-term branch.
        projection_rank: rows r of the dynamic projection per head (Eq. 3; 0 disables the long-range branch).
        num_prefix_tokens: global tokens in front of the patches (0 or more).
        qkv_bias: biases of the query/key/value projections.
        qk_dim: LMSA ("Low-relation multi-head self-attention", its Table 1) total width of queries and keys,
            narrower than the values (default ``dim``); the keys get their own DualLN pair.
        conv_proj: CvT-style query/key/value projections: a depthwise 3x3 conv + BatchNorm per branch on the map
            (global tokens bypass it), then a Linear per branch; otherwise one fused ``qkv`` Linear (ViL).
        conv_dynamic_proj: ``W^P`` as a depthwise-separable conv whose 3x3 depthwise weights are standardised
            (Appendix E, CvT*-LS); otherwise a Linear (ViL-LS).
        window_bias: the official ViL-LS relative position bias table on the window scores.
        attn_drop, proj_drop: dropout on the attention probabilities and on the output.
    """

    # Maps of at most this many patches attend through one dense masked call (measured faster on CPU than
    # blocks of few queries, e.g. CvT stage 3 at 224: 14 x 14, w = 2); both layouts give the same result.
    dense_max_tokens: int = 256

    def __init__(
        self,
        dim: int,
        num_heads: int,
        window_size: int,
        projection_rank: int,
        num_prefix_tokens: int = 0,
        qkv_bias: bool = True,
        qk_dim: int | None = None,
        conv_proj: bool = False,
        conv_dynamic_proj: bool = False,
        window_bias: bool = False,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        validate_ls_2d_args(dim=dim, num_heads=num_heads, window_size=window_size, projection_rank=projection_rank,
                            qk_dim=qk_dim)
        qk_dim = qk_dim or dim
        if num_prefix_tokens and qk_dim != dim:
            raise ValueError("qk_dim (LMSA) needs num_prefix_tokens=0: a global token attends to the patch outputs, "
                             "which have the value width.")
        self.num_heads = num_heads
        self.window_size = window_size
        self.projection_rank = projection_rank
        self.num_prefix_tokens = num_prefix_tokens
        self.splits = (qk_dim, qk_dim, dim)
        self.attn_drop = attn_drop

        if conv_proj:
            # Depthwise 3x3 + BN per branch (CvT's "dw_bn"), q/k/v at stride 1.
            self.conv_proj = nn.ModuleList([nn.Sequential(
                nn.Conv2d(dim, dim, 3, padding=1, groups=dim, bias=False, **dd), nn.BatchNorm2d(dim, **dd))
                for _ in range(3)])
            self.q = nn.Linear(dim, qk_dim, bias=qkv_bias, **dd)
            self.k = nn.Linear(dim, qk_dim, bias=qkv_bias, **dd)
            self.v = nn.Linear(dim, dim, bias=qkv_bias, **dd)
        else:
            self.conv_proj = None
            self.qkv = nn.Linear(dim, sum(self.splits), bias=qkv_bias, **dd)
        self.dp_conv = StdConv2d(dim, dim, 3, padding=1, groups=dim, bias=False, **dd) if projection_rank and conv_dynamic_proj \
            else None
        self.dynamic_proj = nn.Linear(dim, projection_rank * num_heads, **dd) if projection_rank else None
        self.dual_ln_local = nn.LayerNorm(dim, **dd)
        self.dual_ln_global = nn.LayerNorm(dim, **dd)
        # LMSA: narrower keys get their own DualLN pair.
        self.dual_ln_local_k = nn.LayerNorm(qk_dim, **dd) if qk_dim != dim else None
        self.dual_ln_global_k = nn.LayerNorm(qk_dim, **dd) if qk_dim != dim else None
        if window_bias:
            if window_size < 2:
                raise ValueError(f"window_bias needs window_size >= 2 (the official table), got {window_size}.")
            pad = window_size // 2
            rows = 2 * (window_size + pad - 1) * (2 * pad + window_size + 1) + 1
            self.relative_position_bias_table = nn.Parameter(torch.zeros(rows, num_heads, **dd))
            self.register_buffer("relative_position_index", vil_window_bias_index(window_size), persistent=False)
        else:
            self.relative_position_bias_table = None
        self.proj = nn.Linear(dim, dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    def _qkv(self, x: Tensor, x_map: Tensor | None):
        """Queries, keys, values of all tokens: (B, N, qk_dim), (B, N, qk_dim), (B, N, C)."""
        if self.conv_proj is None:
            return self.qkv(x).split(self.splits, -1)
        g, out = self.num_prefix_tokens, []
        for conv, lin in zip(self.conv_proj, (self.q, self.k, self.v)):
            tokens = conv(x_map).flatten(2).transpose(1, 2)  # contiguous: the conv keeps channels-last
            out.append(lin(torch.cat([x[:, :g], tokens], 1) if g else tokens))  # global tokens bypass the conv
        return tuple(out)

    def _heads(self, x: Tensor) -> Tensor:
        """(B, N, heads * d) -> (B, heads, N, d)."""
        return x.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)

    def _project(self, x: Tensor, x_map: Tensor | None, k: Tensor, v: Tensor):
        """Eq. 3 with DualLN: rows ``LN_G(P^T K)``, ``LN_G(P^T V)`` of shape (B, heads, r, d)."""
        if self.dp_conv is None:
            patches = x[:, self.num_prefix_tokens:]
        else:
            patches = self.dp_conv(x_map).flatten(2).transpose(1, 2)
        scores = self.dynamic_proj(patches).transpose(1, 2).unflatten(1, (self.num_heads, -1))  # (B, heads, r, HW)
        prob = scores.softmax(-1, dtype=torch.float32)
        rows_k = (prob @ k.float()).to(k.dtype).transpose(1, 2).flatten(2)  # (B, r, heads * d)
        rows_v = (prob @ v.float()).to(v.dtype).transpose(1, 2).flatten(2)
        ln_k = self.dual_ln_global if self.dual_ln_global_k is None else self.dual_ln_global_k
        return self._heads(ln_k(rows_k)), self._heads(self.dual_ln_global(rows_v))

    def _layout(self, feat_size: tuple[int, int], rows: int, device):
        """Index tensors of the blocked layout: G = gh * gw blocks of Q = w * w queries, each against its
        T x T key tile (T = w + 2e), the ``rows`` projected rows and the global tokens (K = T^2 + rows + g keys).

        Returns ``q_index`` (G * Q) into the tokens, ``k_index`` (G, K) into [tokens; projected rows], ``keep``
        (G, K) key visibility and ``out_index`` (HW): the slot of each patch among the G * Q block queries.
        Positions outside the map (padding of the last blocks, tile borders) point at token 0 and are masked.
        """
        (H, W), w, g = feat_size, self.window_size, self.num_prefix_tokens
        e = max(w // 2, 1)
        gh, gw, T = -(-H // w), -(-W // w), w + 2 * e
        size = torch.tensor([H, W], device=device)
        blocks = _grid(gh, gw, device).view(-1, 1, 2) * w  # block starts (G, 1, 2)
        q_yx = blocks + _grid(w, w, device).view(1, -1, 2)  # (G, Q, 2)
        k_yx = blocks + (_grid(T, T, device) - e).view(1, -1, 2)  # (G, T^2, 2)
        keep = window_keep_2d(blocks, k_yx, w, feat_size)[:, 0]  # a block's queries share their keys: (G, T^2)

        def token(yx: Tensor, valid: Tensor) -> Tensor:
            return torch.where(valid, g + yx[..., 0] * W + yx[..., 1], 0)

        G = gh * gw
        extra = torch.cat([torch.arange(g + H * W, g + H * W + rows, device=device), torch.arange(g, device=device)])
        k_index = torch.cat([token(k_yx, keep), extra.expand(G, -1)], 1)
        keep = torch.cat([keep, keep.new_ones(G, rows + g)], 1)
        q_index = token(q_yx, ((q_yx >= 0) & (q_yx < size)).all(-1)).flatten()
        yx = _grid(H, W, device).flatten(0, 1)
        out_index = ((yx[:, 0] // w) * gw + yx[:, 1] // w) * (w * w) + (yx[:, 0] % w) * w + yx[:, 1] % w
        return q_index, k_index, keep, out_index

    def _attend_blocked(self, q: Tensor, k_all: Tensor, v_all: Tensor, feat_size: tuple[int, int]) -> Tensor:
        """Every w x w query block against its key tile + projected/global rows, as (B, heads * G, ...) groups of
        one SDPA call. q (B, heads, N, d); k_all/v_all (B, heads, N + R, d) = [tokens; rows]. -> (B, HW, heads, d)."""
        B, heads, N, _ = q.shape
        w, L = self.window_size, k_all.shape[2]
        q_index, k_index, keep, out_index = self._layout(feat_size, L - N, q.device)
        G, K = k_index.shape
        b = torch.arange(B, device=q.device).view(B, 1, 1)
        h = torch.arange(heads, device=q.device).view(1, heads, 1)
        # rows of q as (B, N, heads) and of k_all / v_all as (B, heads, L), gathered in (B, heads, block, slot) order
        q_blocks = _gather_rows(q.transpose(1, 2), (b * N + q_index) * heads + h).view(B, heads * G, w * w, -1)
        kv_rows = (b * heads + h) * L + k_index.view(1, 1, -1)
        keys = _gather_rows(k_all, kv_rows).view(B, heads * G, K, -1)
        values = _gather_rows(v_all, kv_rows).view(B, heads * G, K, -1)
        if self.relative_position_bias_table is None:
            mask = keep.expand(heads, G, K).reshape(1, heads * G, 1, K)
        else:  # ViL-LS: the window bias on the T^2 tile keys, -inf where hidden
            bias = self.relative_position_bias_table[self.relative_position_index].permute(2, 0, 1).to(q.dtype)
            tile = bias.shape[-1]
            mask = torch.cat([bias.unsqueeze(1).expand(heads, G, w * w, tile),
                              bias.new_zeros(heads, G, w * w, K - tile)], -1)
            mask = mask.masked_fill(~keep[:, None, :], float("-inf")).reshape(1, heads * G, w * w, K)
        out = F.scaled_dot_product_attention(q_blocks, keys, values, attn_mask=mask,
                                             dropout_p=self.attn_drop if self.training else 0.0)
        # back to raster order, (B, HW, heads, d): row (b, h, slot) of the output for every patch
        return _gather_rows(out, (b.view(B, 1, 1) * heads + h.view(1, 1, heads)) * (G * w * w)
                            + out_index.view(1, -1, 1))

    def _attend_dense(self, q: Tensor, k_all: Tensor, v_all: Tensor, feat_size: tuple[int, int]) -> Tensor:
        """All patch queries against all keys [global; patches; rows] with the (HW, N + R) visibility mask: one SDPA
        call, cheaper than many tiny blocks on small maps. Same shapes as ``_attend_blocked``."""
        (H, W), w, g = feat_size, self.window_size, self.num_prefix_tokens
        rows = k_all.shape[2] - q.shape[2]
        yx = _grid(H, W, q.device).flatten(0, 1)
        keep = window_keep_2d(yx, yx, w, feat_size)  # (HW, HW)
        if self.relative_position_bias_table is None:
            mask = torch.cat([keep.new_ones(H * W, g), keep, keep.new_ones(H * W, rows)], 1)
        else:  # the tile coordinates of every key around each query's block, then the official bias index
            e = max(w // 2, 1)
            T = w + 2 * e
            tile = yx.unsqueeze(0) - (torch.div(yx, w, rounding_mode="floor") * w - e).unsqueeze(1)  # (HW, HW, 2)
            tile = (tile[..., 0] * T + tile[..., 1]).clamp(0, T * T - 1)
            local = (yx[:, 0] % w) * w + yx[:, 1] % w
            bias = self.relative_position_bias_table[self.relative_position_index[local.unsqueeze(1), tile]]
            bias = bias.permute(2, 0, 1).to(q.dtype).masked_fill(~keep, float("-inf"))
            heads = bias.shape[0]
            mask = torch.cat([bias.new_zeros(heads, H * W, g), bias, bias.new_zeros(heads, H * W, rows)], 2)
        out = F.scaled_dot_product_attention(q[:, :, g:], k_all, v_all, attn_mask=mask.view(1, -1, H * W, mask.shape[-1]),
                                             dropout_p=self.attn_drop if self.training else 0.0)
        return out.transpose(1, 2)

    def forward(self, x: Tensor, feat_size: tuple[int, int]) -> Tensor:
        """x (B, g + H*W, C): g global tokens then the map in raster order, ``feat_size = (H, W)``; same shape out.

        Maps of at most ``dense_max_tokens`` patches use the dense masked layout, larger ones the blocked layout.
        """
        B, N, C = x.shape
        g = self.num_prefix_tokens
        x_map = None
        if self.conv_proj is not None or self.dp_conv is not None:  # the patch tokens as a channels-last map
            x_map = x[:, g:].transpose(1, 2).reshape(B, C, *feat_size).contiguous(memory_format=torch.channels_last)
        q, k, v = self._qkv(x, x_map)
        ln_k = self.dual_ln_local if self.dual_ln_local_k is None else self.dual_ln_local_k
        q, k, v = self._heads(q), self._heads(ln_k(k)), self._heads(self.dual_ln_local(v))
        if self.projection_rank:  # the projected rows (Eq. 3) follow the tokens
            rows_k, rows_v = self._project(x, x_map, k[:, :, g:], v[:, :, g:])
            k_all, v_all = torch.cat([k, rows_k], 2), torch.cat([v, rows_v], 2)
        else:
            k_all, v_all = k, v
        attend = self._attend_dense if feat_size[0] * feat_size[1] <= self.dense_max_tokens else self._attend_blocked
        out = attend(q, k_all, v_all, feat_size)  # (B, HW, heads, d)
        if g:  # post-cls: a global token attends to its own key/value and to the patch outputs
            patches = out.transpose(1, 2)
            glob = F.scaled_dot_product_attention(
                q[:, :, :g], torch.cat([k[:, :, :g], patches], 2), torch.cat([v[:, :, :g], patches], 2))
            out = torch.cat([glob.transpose(1, 2), out], 1)
        return self.proj_drop(self.proj(out.reshape(B, N, C)))

"""2-D Long-Short attention over feature maps (Zhu et al., "Long-Short Transformer", NeurIPS 2021, Sec. 3, 4.3).

Every patch query takes one softmax over three key/value sets (Eq. 6):

* short-term (Sec. 3.2, 2-D as in the official ``imagenet/`` code): the map is cut into ``w x w`` query blocks;
  a block sees the ``(w + 2e) x (w + 2e)`` key tile centred on it, ``e = max(w // 2, 1)`` (13 x 13 for w = 7,
  2w x 2w for even w); keys outside the map are masked;
* long-range (Eq. 3): ``P = softmax_HW(X W^P)`` compresses the keys/values of all patches to ``r`` rows per head;
* global tokens (cls): every patch sees them; a global token attends to its own key and to the patch *outputs*
  (the official "post-cls" form).

DualLN (Eq. 7) normalises keys/values of all tokens (``dual_ln_local``) and the projected rows (``dual_ln_global``)
over the full width. Queries, keys and values stay in token rows (B, L, heads * d), keys and values ordered
[patches; projected rows; global tokens]. Visibility is defined once, as a function of 2-D positions
(``window_keep_2d``); two layouts hand it to ``F.scaled_dot_product_attention`` (fused kernels, no score tensor in
Python), on strided (.., heads, L, d) views:

* blocked: the w x w query blocks and their key tiles plus the projected and global rows are gathered as whole
  token rows (``index_select``), with a (blocks x keys) mask; O(HW (w + 2e)^2 + HW r) work. On CPU the blocks go
  in chunks of ``chunk_bytes`` gathered keys/values, each attended while still in cache (bounded workspace);
* strips (maps of at most ``strip_max_tokens`` patches, where blocks of a few queries cost more than they save):
  the map is cut into strips of w whole rows (one strip of all rows when w does not divide H); a strip's queries
  are a view, and its keys/values [e halo rows above; extra keys; its rows; extra keys; e halo rows below] are one
  overlapping strided view of a buffer that holds every patch row once and the extra rows once per strip (the
  first copy in a strip is the previous strip's, hidden). No gathers, one call; O(HW (w + 2e) W + HW r) work.

Both layouts' index tensors and masks depend on the map size only (``window_layout``), so they are built once per
size and shared by every layer of a stage. Maps whose sides are not multiples of ``w`` get partial last blocks:
positions outside the map are masked keys and dropped queries, so any input size works.

The fused path (``_attend_flex``: ``attn_implementation="sdpa"`` on ``FUSED_DEVICES``, i.e. CUDA, or
``"flex_attention"``) makes one FlexAttention call instead, over the patches in window-tile order (each w x w query
block's tokens contiguous, which leaves FlexAttention far fewer 128-token blocks to visit than raster order) and the
extra keys, with a block-sparse mask built from the tile geometry (``long_short_blocks_2d``); compiled on CUDA with
static shapes (code specialised to each map and batch size, its index arithmetic constant), and a compile boundary.
There the rest of the layer (projections, DualLN, Eq. 3, the tile order, the output projection) is compiled around it
too (``ls_hf``'s ``compiled_attention_layer``). With ``window_kernel`` (off by default) the fused path runs the
Triton window kernels instead (``_attend_window_kernel``, ``window_kernel_2d``, forward and backward): the patches
read in raster order, no tile order and no block mask, operators of the compiled layer's graph.

A stage makes its blocks' attention plan once (``plan_attention_2d``: the backend from ``BACKENDS_2D``, whether the
layer is compiled, the tile block mask), as ``ls_hf``'s models do.

This is the one home of the 2-D math in ``ls_timm``; ``vil_ls`` and ``cvt_ls`` only choose its options.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask

from ls_hf.long_short_blocks import flex_attend
from ls_hf.long_short_fused import compiled_attention_layer
from ls_hf.long_short_plan import AttentionPlan, MaskPlan, fused_by_default, runs_fused
from ls_hf.long_short_rules import (
    cached_outside_compile,
    check_attn_implementation,
    check_flex_call,
    project_rows,
    projection_scores,
    window_extent,
    window_rule,
)

from .conv_layers import ConvBn, StdConv2d
from .long_short_blocks_2d import (
    cached_tile_block_mask,
    from_tile_order,
    tile_position,
    tile_slots,
    to_tile_order,
)
from .window_kernel_2d import bias_table_rows, has_window_kernel, window_attention_2d

__all__ = [
    "BACKENDS_2D",
    "LongShortAttention2d",
    "WindowLayout",
    "merged_heads",
    "plan_attention_2d",
    "validate_ls_2d_args",
    "window_keep_2d",
    "window_layout",
]


def validate_ls_2d_args(
    *, dim: int, num_heads: int, window_size: int, projection_rank: int, qk_head_dim: int | None = None
) -> None:
    """Raise ``ValueError`` naming the offending argument and the fix."""
    for name, value, low in (
        ("dim", dim, 1),
        ("num_heads", num_heads, 1),
        ("window_size", window_size, 1),
        ("projection_rank", projection_rank, 0),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")
    if dim % num_heads:
        raise ValueError(
            f"dim ({dim}) must be divisible by num_heads ({num_heads}); pick a head count that divides it."
        )
    if qk_head_dim is not None and (
        not isinstance(qk_head_dim, int) or isinstance(qk_head_dim, bool) or qk_head_dim < 1
    ):
        raise ValueError(
            f"qk_head_dim (LMSA query/key width per head) must be None or an integer >= 1, got {qk_head_dim!r}."
        )


def window_keep_2d(q_yx: Tensor, k_yx: Tensor, window: int, size: tuple[int, int]) -> Tensor:
    """Whether the query at 2-D position ``q_yx[..., i, :]`` sees the key at ``k_yx[..., j, :]``: (..., Q, K) bool.

    A query in block ``(y // w, x // w)`` sees keys whose coordinates lie in ``[s - e, s + w + e)`` per axis, with
    ``s`` the block start and ``e = window_extent(w)`` (the 1-D bidirectional rule of ``ls_hf`` on each axis), and
    inside the ``size = (H, W)`` map.
    """
    k = k_yx.unsqueeze(-3)
    return window_rule(q_yx.unsqueeze(-2), k, window, causal=False).all(-1) & _inside(k, size)


def merged_heads(out: Tensor) -> Tensor:
    """SDPA's output (N, heads, L, d) as token rows (N, L, heads * d), copied before the view: an export records the
    fused CPU kernel's layout of the output, which ONNX's decomposition of SDPA does not keep, so a ``reshape`` there
    would be recorded as a view that no longer holds."""
    N, heads, L, d = out.shape
    return out.transpose(1, 2).clone(memory_format=torch.contiguous_format).view(N, L, heads * d)


def _inside(yx: Tensor, size: tuple[int, int]) -> Tensor:
    """Whether the 2-D positions ``yx`` (..., 2) lie inside the ``size = (H, W)`` map: (...) bool."""
    return ((yx >= 0) & (yx < torch.tensor(size, device=yx.device))).all(-1)


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
    return _vil_bias_row(rel[..., 0], rel[..., 1], window)


def _vil_bias_row(dy: Tensor, dx: Tensor, window: int) -> Tensor:
    """Row of the official ViL-LS window bias table for the query-minus-key offsets ``(dy, dx)`` (elementwise)."""
    pad = window // 2
    return (dy + pad + window - 1) * (2 * pad + window) + dx + pad + window - 1


class WindowLayout(NamedTuple):
    """Where the patch queries and keys of one map size meet (``window_layout``): G groups (blocks or strips) of Q
    query slots against K key slots, of which ``patch_slots`` hold patches and the rest extra keys."""

    target: Tensor | None  # blocked: (G, Q) raster position of each query slot, -1 outside the map (padding)
    k_index: Tensor | None  # blocked: (G, K) rows of [patches; extra keys]; tile keys outside the map read patch 0
    keep: Tensor  # bool visibility: blocked (G, 1, 1, K), a block's queries sharing their keys; strips (G, 1, Q, K)
    patch_slots: Tensor  # (K - extra,) the key slots holding patches, in the order of ``bias_index``
    halo: int  # strips: the halo rows above and below each strip's own rows (0 for one strip)
    bias_index: Tensor | None  # with the ViL-LS bias: (G or 1, Q, K - extra) rows of its table for the patch keys


@cached_outside_compile(maxsize=64)
def window_layout(
    feat_size: tuple[int, int], window: int, extra: int, blocked: bool, bias: bool, device: torch.device
) -> WindowLayout:
    """The ``WindowLayout`` of an (H, W) map, cached: it depends on the geometry only, so every layer of a stage shares
    it. Blocked: w x w query blocks, each against its T x T key tile (T = w + 2e) and the ``extra`` keys; strips: see
    ``LongShortAttention2d._strip_view`` for the key slots. Built outside inference mode, so that a layout first made
    there serves training too."""
    (H, W), w = feat_size, window
    e = window_extent(w)
    with torch.inference_mode(False):
        if blocked:
            starts = _grid(-(-H // w), -(-W // w), device).view(-1, 1, 2) * w  # block starts (G, 1, 2)
            q_yx = starts + _grid(w, w, device).view(1, -1, 2)  # (G, Q, 2)
            k_yx = starts + (_grid(w + 2 * e, w + 2 * e, device) - e).view(1, -1, 2)  # (G, T^2, 2)
            target = torch.where(_inside(q_yx, feat_size), q_yx[..., 0] * W + q_yx[..., 1], -1)
            k_index = torch.cat(
                [
                    torch.where(_inside(k_yx, feat_size), k_yx[..., 0] * W + k_yx[..., 1], 0),
                    torch.arange(H * W, H * W + extra, device=device).expand(len(k_yx), -1),
                ],
                1,
            )
            patch_slots, halo = torch.arange(k_yx.shape[1], device=device), 0
            extra_slots, slots = k_yx.shape[1], k_yx.shape[1] + extra
            visible = window_keep_2d(starts, k_yx, w, feat_size)  # a block's queries share their keys
        else:
            rows = w if H % w == 0 else H  # strip height
            halo = e if rows < H else 0
            starts = torch.arange(0, H, rows, device=device).view(-1, 1, 1) * torch.tensor([1, 0], device=device)
            q_yx = starts + _grid(rows, W, device).view(1, -1, 2)  # (G, Q, 2)
            k_yx = starts + (_grid(rows + 2 * halo, W, device) - torch.tensor([halo, 0], device=device)).view(1, -1, 2)
            target = k_index = None
            own = torch.arange((rows + 2 * halo) * W, device=device)  # slots: [halo; extra; rows; extra; halo]
            patch_slots = own + extra * (own >= halo * W) + extra * (own >= (rows + halo) * W)
            extra_slots, slots = (rows + halo) * W + extra, len(own) + 2 * extra
            visible = window_keep_2d(q_yx, k_yx, w, feat_size)
        keep = visible.new_zeros(*visible.shape[:-1], slots)
        keep[..., patch_slots] = visible
        keep[..., extra_slots : extra_slots + extra] = True
        keep = keep.unsqueeze(1)
        bias_index = vil_window_bias_index(w).to(device) if bias else None  # (query in block, key in its tile)
        if bias and blocked:  # the keys of every block are its tile in order
            bias_index = bias_index.unsqueeze(0)
        elif bias:  # the tile position of every key around each query's block, hidden keys clamped (w >= 2: e = w // 2)
            T = w + 2 * e
            tile = k_yx.unsqueeze(1) - (torch.div(q_yx, w, rounding_mode="floor") * w - e).unsqueeze(2)
            tile = (tile[..., 0] * T + tile[..., 1]).clamp(0, T * T - 1)
            bias_index = bias_index[((q_yx[..., 0] % w) * w + q_yx[..., 1] % w).unsqueeze(-1), tile]
    return WindowLayout(target, k_index, keep, patch_slots, halo, bias_index)


# Parameter names of LongShortAttention2d before it took ls_hf's (LongShortSelfAttention's) -> their names now.
EARLIER_NAMES = {
    "dynamic_proj.": "dynamic_projection.",
    "dual_ln_local_k.": "dual_ln_local_key.",
    "dual_ln_global_k.": "dual_ln_global_key.",
}


def _rename_earlier_keys(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """``load_state_dict`` pre-hook: state dicts saved under ``EARLIER_NAMES`` load under the names of today."""
    for key in [key for key in state_dict if key.startswith(prefix)]:
        for old, new in EARLIER_NAMES.items():
            if key.startswith(prefix + old):
                state_dict[prefix + new + key[len(prefix + old) :]] = state_dict.pop(key)


class LongShortAttention2d(nn.Module):
    """Long-Short self-attention on ``num_prefix_tokens`` global tokens followed by an (H, W) patch map.

    Args:
        dim: token width C.
        num_heads: heads; value head dim C / heads.
        window_size: query block side w of the short-term branch.
        projection_rank: rows r of the dynamic projection per head (Eq. 3; 0 disables the long-range branch).
        num_prefix_tokens: global tokens in front of the patches (0 or more).
        qkv_bias: biases of the query/key/value projections.
        qk_head_dim: LMSA ("Low-relation multi-head self-attention", its Table 1) width of a query/key head,
            narrower than the value head ``dim / num_heads`` (its default), as ``ls_hf``'s ``LongShortSelfAttention``;
            the keys then get their own DualLN pair.
        conv_proj: CvT-style query/key/value projections: a depthwise 3x3 conv + BatchNorm per branch on the map
            (global tokens bypass it), then a Linear per branch; otherwise one fused ``qkv`` Linear (ViL).
        conv_dynamic_proj: ``W^P`` as a depthwise-separable conv whose 3x3 depthwise weights are standardised
            (Appendix E, CvT*-LS); otherwise a Linear (ViL-LS).
        window_bias: the official ViL-LS relative position bias table on the window scores.
        use_dual_ln: DualLN (Eq. 7); False is the paper's ablation (CvT*-LS-13 without DualLN, Appendix E): no LN on
            the keys/values of the window or of the projected rows.
        attn_drop, proj_drop: dropout on the attention probabilities and on the output.
        attn_implementation: chosen at each call from where the input is, as ``ls_hf``'s ``LongShortSelfAttention``:
            ``"sdpa"`` (the default): the fused path (``_attend_flex``) where ``fused_by_default`` says (CUDA, not
            float64, no active attention dropout), the strip/blocked SDPA layouts otherwise; ``"eager"``: the SDPA
            layouts everywhere (the portable reference); ``"flex_attention"``: the fused path everywhere, forward only
            on CPU, no attention dropout. The global tokens' own rows stay on SDPA (dense, no window to mask). The
            kernel is compiled on ``ls_hf``'s ``FUSED_DEVICES`` (CUDA); its call is a compile boundary
            (``_flex_in_tile_order``), so a caller's ``torch.compile`` of the model breaks there and runs it as
            outside.
        compile_attention: where the fused path runs on ``FUSED_DEVICES`` (CUDA), compile the rest of the layer around
            its attention kernel (``compiled_attention_layer``), shared by every layer of the same settings in the
            process: fewer kernel launches. Not inside a ``torch.compile`` of the caller's. False: only the attention
            kernel is compiled.
    """

    # Maps of at most this many patches attend in strips, larger ones in blocks; both give the same result. CvT*-LS-13
    # stage-3 attention at batch 8 on CPU, strips against blocks: 14 x 14 (w = 2) 15.3 against 19.6 ms, 24 x 24
    # (w = 3) 60 against 65; 28 x 28 (w = 4) a tie; 56 x 56 (w = 8) blocks 2.4x faster.
    strip_max_tokens: int = 576
    # A map whose height w does not divide is one strip (every query against every patch key): blocks win sooner
    # (21 x 21, w = 2: 51.7 ms against 48.5 in blocks; 17 x 17 a tie).
    one_strip_max_tokens: int = 256
    # Blocked layout: blocks are attended in chunks gathering about this many key/value bytes. On CPU a chunk's tiles
    # are still in cache when SDPA reads them (CvT stage attention at 448 measured 1.5-2.3x faster than one call);
    # elsewhere the chunks only bound the workspace (GPUs not measured). torch.compile takes all blocks in one call.
    chunk_bytes: int = 4 << 20
    accelerator_chunk_bytes: int = 1 << 30
    # Whether the fused path (CUDA) runs the Triton window kernels (``window_kernel_2d``: the patches read in raster
    # order, no tile order, no block mask; forward and backward) instead of FlexAttention: off by default, as they are
    # exact but not yet timed on a GPU; True, for the class or one module, turns them on.
    window_kernel: bool = False

    def __init__(
        self,
        dim: int,
        num_heads: int,
        window_size: int,
        projection_rank: int,
        num_prefix_tokens: int = 0,
        qkv_bias: bool = True,
        qk_head_dim: int | None = None,
        conv_proj: bool = False,
        conv_dynamic_proj: bool = False,
        window_bias: bool = False,
        use_dual_ln: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        attn_implementation: str = "sdpa",
        compile_attention: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        check_attn_implementation(attn_implementation)
        self.attn_implementation = attn_implementation
        self.compile_attention = compile_attention
        validate_ls_2d_args(
            dim=dim,
            num_heads=num_heads,
            window_size=window_size,
            projection_rank=projection_rank,
            qk_head_dim=qk_head_dim,
        )
        self.qk_head_dim = qk_head_dim or dim // num_heads
        qk_width = num_heads * self.qk_head_dim
        if num_prefix_tokens and qk_width != dim:
            raise ValueError(
                "qk_head_dim (LMSA) needs num_prefix_tokens=0: a global token attends to the patch "
                "outputs, which have the value width."
            )
        self.num_heads = num_heads
        self.window_size = window_size
        self.projection_rank = projection_rank
        self.num_prefix_tokens = num_prefix_tokens
        self.splits = (qk_width, qk_width, dim)
        self.attn_drop = attn_drop

        if conv_proj:
            # Depthwise 3x3 + BN per branch (CvT's "dw_bn"), q/k/v at stride 1.
            self.conv_proj = nn.ModuleList(
                [
                    ConvBn(nn.Conv2d(dim, dim, 3, padding=1, groups=dim, bias=False, **dd), nn.BatchNorm2d(dim, **dd))
                    for _ in range(3)
                ]
            )
            self.q = nn.Linear(dim, qk_width, bias=qkv_bias, **dd)
            self.k = nn.Linear(dim, qk_width, bias=qkv_bias, **dd)
            self.v = nn.Linear(dim, dim, bias=qkv_bias, **dd)
        else:
            self.conv_proj = None
            self.qkv = nn.Linear(dim, sum(self.splits), bias=qkv_bias, **dd)
        self.dp_conv = (
            StdConv2d(dim, dim, 3, padding=1, groups=dim, bias=False, **dd)
            if projection_rank and conv_dynamic_proj
            else None
        )
        self.dynamic_projection = nn.Linear(dim, projection_rank * num_heads, **dd) if projection_rank else None
        norm = functools.partial(nn.LayerNorm, **dd) if use_dual_ln else (lambda width: nn.Identity())
        self.dual_ln_local = norm(dim)
        self.dual_ln_global = norm(dim)
        # LMSA: narrower keys get their own DualLN pair.
        self.dual_ln_local_key = norm(qk_width) if qk_width != dim else None
        self.dual_ln_global_key = norm(qk_width) if qk_width != dim else None
        if window_bias:
            if window_size < 2:
                raise ValueError(f"window_bias needs window_size >= 2 (the official table), got {window_size}.")
            rows = bias_table_rows(window_size)
            self.relative_position_bias_table = nn.Parameter(torch.zeros(rows, num_heads, **dd))
        else:
            self.relative_position_bias_table = None
        self.proj = nn.Linear(dim, dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        self.register_load_state_dict_pre_hook(_rename_earlier_keys)

    def _qkv(self, tokens: Tensor, x_map: Tensor | None = None):
        """Queries, and keys and values through ``LN_L`` (DualLN, Eq. 7), of ``tokens`` (B, n, C): (B, n, qk) twice
        and (B, n, C). With ``x_map`` (the tokens as a channels-last map) the CvT conv projections run first; global
        tokens (no map) go through the Linear layers only."""
        if self.conv_proj is None:
            q, k, v = self.qkv(tokens).split(self.splits, -1)
        else:  # a channels-last conv output flattens to contiguous (B, HW, C) rows
            branches = (
                [tokens] * 3 if x_map is None else [conv(x_map).flatten(2).transpose(1, 2) for conv in self.conv_proj]
            )
            q, k, v = (lin(t) for lin, t in zip((self.q, self.k, self.v), branches))
        ln_k = self.dual_ln_local if self.dual_ln_local_key is None else self.dual_ln_local_key
        return q, ln_k(k), self.dual_ln_local(v)

    def _heads(self, x: Tensor) -> Tensor:
        """(B, N, heads * d) -> (B, heads, N, d), a view."""
        return x.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)

    def _project(self, patches: Tensor, x_map: Tensor | None, k: Tensor, v: Tensor):
        """Eq. 3 with DualLN: the rows ``LN_G(P^T K)``, ``LN_G(P^T V)``, (B, r, heads * d) each (row i holds every
        head's i-th row), from the patch tokens and their keys/values (B, HW, .)."""
        if self.dp_conv is not None:
            patches = self.dp_conv(x_map).flatten(2).transpose(1, 2)
        scores = projection_scores(self.dynamic_projection, patches)  # (B, heads * r, HW)
        rows_k, rows_v = (
            rows.transpose(1, 2).flatten(2)
            for rows in project_rows(scores.unflatten(1, (self.num_heads, -1)), self._heads(k), self._heads(v))
        )  # (B, heads, r, HW) scores
        ln_k = self.dual_ln_global if self.dual_ln_global_key is None else self.dual_ln_global_key
        return ln_k(rows_k), self.dual_ln_global(rows_v)

    def _layout(self, feat_size: tuple[int, int], extra: int, blocked: bool, device) -> WindowLayout:
        """The cached ``window_layout`` of this module's window (traced afresh under torch.compile)."""
        return window_layout(
            feat_size, self.window_size, extra, blocked, self.relative_position_bias_table is not None, device
        )

    def _mask(self, layout: WindowLayout, dtype: torch.dtype) -> Tensor:
        """The SDPA mask of a layout: its ``keep`` (bool), or with the ViL-LS window bias on the patch keys
        (G, heads, Q, K) float, -inf where hidden."""
        if layout.bias_index is None:
            return layout.keep
        bias = (
            self.relative_position_bias_table[layout.bias_index].permute(0, 3, 1, 2).to(dtype)
        )  # (G or 1, heads, Q, T)
        bias = bias.new_zeros(*bias.shape[:-1], layout.keep.shape[-1]).index_copy(-1, layout.patch_slots, bias)
        return bias.masked_fill(~layout.keep, float("-inf"))

    def _chunks(self, B: int, G: int, block_bytes: int, device) -> list[tuple[int, int, int, int]]:
        """(first image, last image + 1, first block, last block + 1) chunks of the (B, G) blocks of ``block_bytes``
        gathered keys/values each, within the budget (``chunk_bytes``): several whole images per chunk, or parts of
        one image when an image alone exceeds it."""
        if torch.compiler.is_compiling():
            return [(0, B, 0, G)]
        budget = self.chunk_bytes if device.type == "cpu" else self.accelerator_chunk_bytes
        image_bytes = G * block_bytes
        if image_bytes <= budget:
            n = min(B, budget // image_bytes)
            return [(b, min(b + n, B), 0, G) for b in range(0, B, n)]
        parts = -(-image_bytes // budget)
        m = -(-G // parts)
        return [(b, b + 1, g, min(g + m, G)) for b in range(B) for g in range(0, G, m)]

    def _attend_blocked(
        self, q: Tensor, keys: tuple[Tensor, Tensor], values: tuple[Tensor, Tensor], feat_size: tuple[int, int]
    ) -> Tensor:
        """Every w x w query block against its key tile and the extra keys, in one softmax per query.

        q (B, HW, qk) patch queries; keys/values: (patches (B, HW, .), extra keys (B, X, .)); -> (B, HW, C). The
        blocks are taken in chunks (``_chunks``); each gathers its queries and keys as whole rows (all heads at once)
        and hands (blocks, heads, slots, d) strided views to one SDPA call, whose output rows are copied to their
        raster positions (padding slots to a sink row past the end).
        """
        keys, values = (torch.cat(t, 1) if t[1].shape[1] else t[0] for t in (keys, values))
        B, HW, _ = q.shape
        L, C, device = keys.shape[1], values.shape[-1], q.device
        target, k_index, *_ = layout = self._layout(feat_size, L - HW, True, device)
        (G, Q), K = target.shape, k_index.shape[1]
        mask = self._mask(layout, q.dtype)
        chunks = self._chunks(B, G, K * (keys.shape[-1] + C) * keys.element_size(), device)
        images = max(b1 - b0 for b0, b1, *_ in chunks)
        masks = mask.repeat(images, 1, 1, 1) if images > 1 else mask  # one tensor that every whole-image chunk views
        # row indices into the (B * rows, width) views, per image and block; padding slots read patch 0 and write to
        # the sink row
        image = torch.arange(B, device=device).view(B, 1, 1)
        q_rows, kv_rows = image * HW + target.clamp(min=0), image * L + k_index
        out_rows = torch.where(target >= 0, image * HW + target, B * HW)
        q, keys, values = q.reshape(B * HW, -1), keys.reshape(B * L, -1), values.reshape(B * L, C)
        out = values.new_empty(B * HW + 1, C)
        for b0, b1, g0, g1 in chunks:
            n = (b1 - b0) * (g1 - g0)
            kv = kv_rows[b0:b1, g0:g1].flatten()
            q_c = q.index_select(0, q_rows[b0:b1, g0:g1].flatten()).view(n, Q, self.num_heads, -1)
            k_c = keys.index_select(0, kv).view(n, K, self.num_heads, -1)
            v_c = values.index_select(0, kv).view(n, K, self.num_heads, -1)
            out_c = F.scaled_dot_product_attention(
                q_c.transpose(1, 2),
                k_c.transpose(1, 2),
                v_c.transpose(1, 2),
                attn_mask=masks[:n] if g1 - g0 == G else mask[g0:g1],
                dropout_p=self.attn_drop if self.training else 0.0,
            )
            out.index_copy_(0, out_rows[b0:b1, g0:g1].flatten(), merged_heads(out_c).view(-1, C))
        return out[:-1].view(B, HW, C)

    def _attend_flex(
        self,
        q: Tensor,
        keys: tuple[Tensor, Tensor],
        values: tuple[Tensor, Tensor],
        feat_size: tuple[int, int],
        block_mask: BlockMask | None = None,
    ) -> Tensor:
        """``_attend_blocked`` (same arguments) in one FlexAttention call: the queries and the patch keys/values in
        window-tile order, the extra keys after them, the window as a block-sparse mask from the tile geometry (the
        plan's, ``tile_block_mask``) and the ViL-LS window bias as a score_mod (``long_short_blocks_2d``)."""
        w = self.window_size
        q, k, v = (to_tile_order(t, feat_size, w, heads=self.num_heads) for t in (q, keys[0], values[0]))
        k, v = (torch.cat([tiles, self._heads(rows.to(q.dtype))], 2) for tiles, rows in ((k, keys[1]), (v, values[1])))
        if block_mask is None:
            block_mask = self._tile_block_mask(feat_size, q.device)
        return from_tile_order(self._flex_in_tile_order(q, k, v, tuple(feat_size), block_mask), feat_size, w)

    def _tile_block_mask(self, feat_size: tuple[int, int], device: torch.device) -> BlockMask:
        """The tile block mask of an (H, W) map with this module's window and extra keys (cached per shape)."""
        extra = self.projection_rank + self.num_prefix_tokens
        return cached_tile_block_mask(tuple(feat_size), self.window_size, extra, device)

    @torch.compiler.disable
    def _flex_in_tile_order(
        self, q: Tensor, k: Tensor, v: Tensor, feat_size: tuple[int, int], block_mask: BlockMask
    ) -> Tensor:
        """FlexAttention of the queries in tile order over [patch keys in tile order; extra keys], with the tile block
        mask and the window bias. A compile boundary: inside a caller's compiled graph the call runs as outside one
        (lowered inside a larger graph, inductor's CPU kernel refused the heads-first queries, torch 2.14)."""
        score_mod = self._window_bias_mod(feat_size)
        return flex_attend(q, k, v, block_mask, score_mod=score_mod, static_shapes=True)

    def _window_bias_mod(self, feat_size: tuple[int, int]):
        """The ViL-LS window bias as FlexAttention's score_mod in tile order: its table read at the query-minus-key
        offset for the patch keys (None without the table); the map size a constant, as in ``tile_mask_mod``."""
        table = self.relative_position_bias_table
        if table is None:
            return None
        w, W, patches = self.window_size, feat_size[1], tile_slots(feat_size, self.window_size)

        def window_bias(score, b, h, q_idx, kv_idx):
            (qy, qx), (ky, kx) = tile_position(q_idx, W, w), tile_position(kv_idx, W, w)
            row = _vil_bias_row(qy - ky, qx - kx, w).clamp(0, table.shape[0] - 1)
            return torch.where(kv_idx >= patches, score, score + table[row, h].to(score.dtype))

        return window_bias

    def _attend_window_kernel(
        self,
        q: Tensor,
        keys: tuple[Tensor, Tensor],
        values: tuple[Tensor, Tensor],
        feat_size: tuple[int, int],
        block_mask: BlockMask | None = None,
    ) -> Tensor:
        """``_attend_blocked`` (same arguments) in one call of the Triton window kernel (``window_attention_2d``): the
        patches read in raster order, each query's window and the extra keys in one softmax, the ViL-LS window bias
        added to the patch keys' scores; its backward pass in one call of the backward kernel."""
        return window_attention_2d(
            q,
            keys[0],
            values[0],
            keys[1],
            values[1],
            map_height=feat_size[0],
            map_width=feat_size[1],
            window=self.window_size,
            num_heads=self.num_heads,
            bias_table=self.relative_position_bias_table,
        )

    def _in_strips(self, feat_size: tuple[int, int]) -> bool:
        """Whether an (H, W) map attends in strips (``strip_max_tokens``, ``one_strip_max_tokens``), else in blocks."""
        H, W = feat_size
        one_strip = H % self.window_size != 0
        return H * W <= (min(self.strip_max_tokens, self.one_strip_max_tokens) if one_strip else self.strip_max_tokens)

    def _strip_view(self, patches: Tensor, extra: Tensor, strips: int, halo: int) -> Tensor:
        """The key (or value) slots of every strip, (B * strips, heads, K, d), from patch rows (B, HW, c) and extra
        rows (B, X, c): [``halo`` patch rows above; extra rows (the previous strip's copy, hidden); own rows; extra
        rows; ``halo`` patch rows below] of strip i start at row ``i * (own + X)`` of one buffer that holds, per strip,
        its own rows then the extra rows. Strips overlap in the buffer, so the view copies nothing; the rows before
        the first strip's own rows and after the last's are zeros (hidden, finite)."""
        B, HW, c = patches.shape
        own, X = HW // strips, extra.shape[1]
        period, front = own + X, halo + X
        buf = patches.new_empty((B * strips - 1) * period + own + 2 * front, c)
        buf[:front] = 0
        buf[front + B * strips * period :] = 0
        body = buf[front : front + B * strips * period].view(B, strips, period, c)
        body[:, :, :own] = patches.view(B, strips, own, c)
        body[:, :, own:] = extra.unsqueeze(1)
        heads, d = self.num_heads, c // self.num_heads
        return buf.as_strided((B * strips, heads, own + 2 * front, d), (period * c, d, c, 1))

    def _attend_strips(
        self, q: Tensor, keys: tuple[Tensor, Tensor], values: tuple[Tensor, Tensor], feat_size: tuple[int, int]
    ) -> Tensor:
        """The queries of every strip against its key slots (``_strip_view``), one SDPA call over all strips. Same
        arguments as ``_attend_blocked``."""
        B, HW, _ = q.shape
        layout = self._layout(feat_size, keys[1].shape[1], False, q.device)
        strips, halo_rows = layout.keep.shape[0], layout.halo * feat_size[1]
        mask = self._mask(layout, q.dtype)
        k, v = (self._strip_view(*t, strips, halo_rows) for t in (keys, values))
        q = q.reshape(B * strips, HW // strips, self.num_heads, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask.repeat(B, 1, 1, 1) if B > 1 else mask,
            dropout_p=self.attn_drop if self.training else 0.0,
        )
        return merged_heads(out).view(B, HW, -1)

    def _attend_sdpa(
        self,
        q: Tensor,
        keys: tuple[Tensor, Tensor],
        values: tuple[Tensor, Tensor],
        feat_size: tuple[int, int],
        block_mask: BlockMask | None = None,
    ) -> Tensor:
        """The SDPA layouts: maps of at most ``strip_max_tokens`` patches (``one_strip_max_tokens`` when w does not
        divide H) in strips, larger ones in blocks."""
        attend = self._attend_strips if self._in_strips(feat_size) else self._attend_blocked
        return attend(q, keys, values, feat_size)

    def forward(self, x: Tensor, feat_size: tuple[int, int], *, plan: AttentionPlan | None = None) -> Tensor:
        """x (B, g + H*W, C): g global tokens then the map in raster order, ``feat_size = (H, W)``; same shape out.

        ``plan``: the attention plan that a stage made once for its blocks (``plan_attention_2d``); None: the layer
        makes its own. Its backend (``BACKENDS_2D``) makes one FlexAttention call, one window kernel call, or uses
        the strip or blocked SDPA layout. Keys and values stay in token rows (B, L, heads * d): the patches', and the
        extra rows [projected rows; global tokens].
        """
        if plan is None:
            plan = plan_attention_2d([self], x, feat_size)
        block_mask = plan.block_masks.get((self.window_size, self.projection_rank + self.num_prefix_tokens))
        layer = LongShortAttention2d._layer
        if plan.compiled:
            layer = compiled_attention_layer(layer, static_shapes=True)
        return layer(self, x, tuple(feat_size), attend=BACKENDS_2D[plan.backend], block_mask=block_mask)

    def _layer(
        self, x: Tensor, feat_size: tuple[int, int], *, attend: Callable, block_mask: BlockMask | None
    ) -> Tensor:
        """The layer after the plan: the projections, the attention on its backend ``attend`` (the fused path's
        FlexAttention or window kernel call with the plan's ``block_mask``, or the strip or blocked SDPA layout) and
        the output projection (as ``compiled_attention_layer`` runs it, with static shapes: each map size and batch
        size compiles code of its own, whose tile-order copies index with constants; an image model meets few
        shapes)."""
        B, _, C = x.shape
        g = self.num_prefix_tokens
        patches = x[:, g:]
        x_map = None
        if self.conv_proj is not None or self.dp_conv is not None:  # the patch tokens as a channels-last map
            x_map = patches.transpose(1, 2).reshape(B, C, *feat_size).contiguous(memory_format=torch.channels_last)
        q, k, v = self._qkv(patches, x_map)
        extra_k, extra_v = [k[:, :0]], [v[:, :0]]  # zero rows of the right widths, for maps with no extra keys
        if self.projection_rank:  # the projected rows (Eq. 3), seen by every patch
            rows_k, rows_v = self._project(patches, x_map, k, v)
            extra_k.append(rows_k)
            extra_v.append(rows_v)
        if g:
            q_g, k_g, v_g = self._qkv(x[:, :g])
            extra_k.append(k_g)
            extra_v.append(v_g)
        extra_k, extra_v = (torch.cat(t, 1) if len(t) > 2 else t[-1] for t in (extra_k, extra_v))
        out = attend(self, q, (k, extra_k), (v, extra_v), feat_size, block_mask)
        if g:  # post-cls: a global token attends to its own key/value and to the patch outputs
            glob = F.scaled_dot_product_attention(
                self._heads(q_g), self._heads(torch.cat([k_g, out], 1)), self._heads(torch.cat([v_g, out], 1))
            )
            out = torch.cat([merged_heads(glob), out], 1)
        return self.proj_drop(self.proj(out))


# How the 2-D joint softmax runs, by the name ``plan_attention_2d`` picks; each takes the module, the patch queries,
# (patch, extra) keys and values, the map size and the plan's block mask (or None), and returns the patch outputs.
BACKENDS_2D: dict[str, Callable] = {
    "sdpa": LongShortAttention2d._attend_sdpa,
    "flex": LongShortAttention2d._attend_flex,
    "window_kernel": LongShortAttention2d._attend_window_kernel,
}


def plan_attention_2d(modules: Sequence[LongShortAttention2d], x: Tensor, feat_size: tuple[int, int]) -> AttentionPlan:
    """The plan of one call of ``modules`` (a stage's attention layers, the same settings) on x (B, g + H*W, C) of an
    (H, W) map: its backend, the one place that picks it (``"flex"``, the fused path, with ``"flex_attention"``, and
    with ``"sdpa"`` where ``fused_by_default`` says (CUDA, not float64, no active attention dropout); there
    ``"window_kernel"`` with ``window_kernel``, except where autograd records under
    ``torch.use_deterministic_algorithms`` (the kernels' backward adds gradients atomically, in an order that varies);
    else ``"sdpa"``, the strip or blocked layouts), whether the layers run compiled around their kernel, and the
    fused path's tile block masks."""
    module = modules[0]
    H, W = feat_size
    tokens = module.num_prefix_tokens + H * W
    if x.dim() != 3 or x.shape[1] != tokens or x.shape[2] != module.proj.in_features:
        raise ValueError(
            f"x must be (batch, num_prefix_tokens + H * W, dim) = (batch, {module.num_prefix_tokens} + {H} * {W}, "
            f"{module.proj.in_features}) for feat_size={tuple(feat_size)}, got {tuple(x.shape)}: pass the map's "
            f"(H, W) with its tokens."
        )
    if module.attn_implementation == "flex_attention":
        for layer in modules:
            check_flex_call(
                x,
                layer.proj.weight,
                training=layer.training,
                dropout=layer.attn_drop,
                dropout_name="attn_drop",
                dropout_setting="attn_drop_rate",
            )
        backend = "flex"
    elif module.attn_implementation != "sdpa" or not fused_by_default(
        x, dropout=module.training and module.attn_drop > 0
    ):
        backend = "sdpa"
    elif (
        module.window_kernel
        and has_window_kernel()
        and not (torch.is_grad_enabled() and torch.are_deterministic_algorithms_enabled())
    ):
        backend = "window_kernel"
    else:
        backend = "flex"
    compiled = backend != "sdpa" and module.compile_attention and runs_fused(x) and not torch.compiler.is_compiling()
    block_masks = {}
    if backend == "flex":
        for layer in modules:
            block_masks[(layer.window_size, layer.projection_rank + layer.num_prefix_tokens)] = layer._tile_block_mask(
                feat_size, x.device
            )
    return AttentionPlan(
        masks=MaskPlan(), backend=backend, compiled=compiled, block_masks=block_masks, recoverable_norms=frozenset()
    )

"""The 2-D Long-Short attention (Zhu et al., "Long-Short Transformer", NeurIPS 2021, Sec. 3.2-3.3, 4.3, Eq. 6) in
Triton kernels that read the patches where the layer wrote them, in raster order: a forward kernel and its backward.

Each program takes a rectangle of the map's queries (``query_rectangle``: whole w x w query blocks, or rows of one)
for one image and head, and runs one online softmax over the keys of the rectangle's windows, read straight from
the patch rows (the window's rows and columns, clipped to the map), then over the extra keys (projected rows, global
tokens) that every query sees. A key is seen where the window rule (``window_bounds`` on each axis) holds; with the
ViL-LS bias, its table row (``_vil_bias_row``) is added to the score. No tile order, no gathered copies, no
block mask: the work is the rectangle's windows and the extra keys.

The backward kernel runs the same programs over the same keys (FlashAttention-2's backward pass, from the forward's
log-sum-exp per query): a program writes its queries' gradient and adds its share of the keys', values' and bias
table's gradients with atomic additions (float32; float64 for float64), as a key is seen by the queries of several
rectangles. ``window_attention_2d`` is differentiable (``torch.library`` custom operators with an autograd formula and
fake implementations, so a compiled graph holds them as operators of its own).

Triton compiles the kernels for CUDA; with ``TRITON_INTERPRET=1`` set before Triton is imported they run in Triton's
interpreter, on the CPU too, which is how the tests check them against the SDPA layouts. This file imports nothing
from Transformers or timm.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from ls_hf.long_short_rules import window_extent

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # torch builds without Triton (macOS, CPU-only wheels): the kernels are not available
    triton = tl = InterpretedFunction = None

__all__ = [
    "LaunchGeometry",
    "bias_table_rows",
    "has_window_kernel",
    "kernel_constants",
    "launch_geometry",
    "query_rectangle",
    "window_attention_2d",
]

# Queries a program takes at most (its rectangle of the map), and keys per step of its loop.
RECTANGLE_QUERIES = 64
KEY_BLOCK = 64
LOG2_E = math.log2(math.e)


def has_window_kernel() -> bool:
    """Whether Triton is installed, so that ``window_attention_2d`` can run."""
    return triton is not None


def query_rectangle(window: int) -> tuple[int, int]:
    """(rows, columns) of the map rectangle whose queries one program takes: as many whole w x w query blocks as fit
    in ``RECTANGLE_QUERIES`` queries, in a square, or where a block holds more, as many of its rows as fit and divide
    w (a rectangle within one block)."""
    if window * window >= RECTANGLE_QUERIES:
        rows = [d for d in range(1, window + 1) if window % d == 0 and d * window <= RECTANGLE_QUERIES]
        return max(rows, default=1), window
    side = math.isqrt(RECTANGLE_QUERIES // (window * window)) * window
    return side, side


def _most_keys_per_axis(length: int, rectangle: int, window: int) -> int:
    """The most positions along one axis of ``length`` that the windows of a rectangle's ``rectangle`` queries span,
    inside the map, over the rectangles (as the kernel bounds them: ``window_bounds`` of its first and last query)."""
    e = window_extent(window)
    return max(
        min((min(start + rectangle, length) - 1) // window * window + window + e, length)
        - max(start // window * window - e, 0)
        for start in range(0, length, rectangle)
    )


def _dot_block(n: int) -> int:
    """The block that holds ``n`` rows or columns of a dot product: the least power of 2 >= n, at least 16 (the least
    dimension of Triton's ``tl.dot``)."""
    return max(16, 1 << max(n - 1, 0).bit_length())


class LaunchGeometry(NamedTuple):
    """How the kernels cover an (H, W) map: programs of ``rectangle`` queries (``query_rectangle``), ``block_q`` lanes
    each, ``rects_per_row`` across the map, ``programs`` per image and head, each running ``window_steps`` blocks of
    ``KEY_BLOCK`` patch keys (the most any rectangle's window needs) and ``extra_steps`` of extra keys."""

    rectangle: tuple[int, int]
    block_q: int
    rects_per_row: int
    programs: int
    window_steps: int
    extra_steps: int

    @property
    def steps(self) -> int:
        """Key blocks a program runs: its window's, then the extra keys'."""
        return self.window_steps + self.extra_steps


def launch_geometry(feat_size: tuple[int, int], window: int, extra: int) -> LaunchGeometry:
    """The ``LaunchGeometry`` of an (H, W) map with ``extra`` keys."""
    (H, W), (rect_h, rect_w) = feat_size, query_rectangle(window)
    rects_per_row = -(-W // rect_w)
    window_keys = _most_keys_per_axis(H, rect_h, window) * _most_keys_per_axis(W, rect_w, window)
    return LaunchGeometry(
        (rect_h, rect_w),
        _dot_block(rect_h * rect_w),
        rects_per_row,
        -(-H // rect_h) * rects_per_row,
        -(-window_keys // KEY_BLOCK),
        -(-extra // KEY_BLOCK),
    )


def _jit(fn):
    """``triton.jit`` where Triton is installed (the functions are never called without it)."""
    return triton.jit(fn) if triton is not None else fn


@_jit
def _rectangle(
    num_heads, map_h, map_w, rects_per_row, programs,
    WINDOW: tl.constexpr, EXTENT: tl.constexpr, RECT_H: tl.constexpr, RECT_W: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The program's image and head, its rectangle's queries (their rows in raster order, whether inside the map),
    the ``region`` of patch keys the rectangle's windows span (what ``_window_keys`` reads: each query's map row and
    column and window start on each axis, [lo, lo + w + 2e) as ``window_bounds`` gives it; the region's top row, left
    column, bottom row (excluded) and width; the map's width) and the ``window_steps`` blocks of keys it holds. One
    program per (image x head, rectangle), the grid flat (no axis limit of 65,535), neighbouring rectangles next to
    each other (they share keys in the cache)."""
    rect, image_head = tl.program_id(0) % programs, tl.program_id(0) // programs
    image, head = image_head // num_heads, image_head % num_heads
    top, left = rect // rects_per_row * RECT_H, rect % rects_per_row * RECT_W
    lane = tl.arange(0, BLOCK_Q)
    qy, qx = top + lane // RECT_W, left + lane % RECT_W
    q_ok = (lane < RECT_H * RECT_W) & (qy < map_h) & (qx < map_w)
    y_lo, x_lo = qy // WINDOW * WINDOW - EXTENT, qx // WINDOW * WINDOW - EXTENT
    key_top, key_left = tl.maximum(top // WINDOW * WINDOW - EXTENT, 0), tl.maximum(left // WINDOW * WINDOW - EXTENT, 0)
    last_y, last_x = tl.minimum(top + RECT_H, map_h) - 1, tl.minimum(left + RECT_W, map_w) - 1
    key_bottom = tl.minimum(last_y // WINDOW * WINDOW + WINDOW + EXTENT, map_h)
    region_w = tl.minimum(last_x // WINDOW * WINDOW + WINDOW + EXTENT, map_w) - key_left
    window_steps = tl.cdiv((key_bottom - key_top) * region_w, BLOCK_K)
    region = (qy, qx, q_ok, y_lo, x_lo, key_top, key_left, key_bottom, region_w, map_w)
    return image.to(tl.int64), head, qy * map_w + qx, q_ok, region, window_steps


@_jit
def _window_bias(Table, bias_row, seen, head, num_heads, HAS_BIAS: tl.constexpr, ACC: tl.constexpr):
    """The ViL-LS window bias of each seen (query, key) from its table row, or 0 without the table."""
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(Table + bias_row * num_heads + head, mask=seen, other=0.0).to(ACC)
    return bias


@_jit
def _window_keys(
    step, region, Table, head, num_heads,
    WINDOW: tl.constexpr, EXTENT: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Block ``step`` of the ``region``'s patch keys (``_rectangle``), row by row: their rows in raster order, which
    exist, which each query sees (the window rule), each (query, key)'s ViL-LS bias row (``_vil_bias_row`` of the
    query-minus-key offsets; EXTENT = w // 2 where the table exists) and its bias (``_window_bias``)."""
    qy, qx, q_ok, y_lo, x_lo, key_top, key_left, key_bottom, region_w, map_w = region
    j = step * BLOCK_K + tl.arange(0, BLOCK_K)
    ky, kx = key_top + j // region_w, key_left + j % region_w
    k_ok = j < (key_bottom - key_top) * region_w
    seen = (
        (q_ok[:, None] & k_ok[None, :])
        & (ky[None, :] >= y_lo[:, None])
        & (ky[None, :] < y_lo[:, None] + WINDOW + 2 * EXTENT)
        & (kx[None, :] >= x_lo[:, None])
        & (kx[None, :] < x_lo[:, None] + WINDOW + 2 * EXTENT)
    )
    bias_row = (qy[:, None] - ky[None, :] + EXTENT + WINDOW - 1) * (2 * EXTENT + WINDOW) + (
        qx[:, None] - kx[None, :] + EXTENT + WINDOW - 1
    )
    return ky * map_w + kx, k_ok, seen, bias_row, _window_bias(Table, bias_row, seen, head, num_heads, HAS_BIAS, ACC)


@_jit
def _extra_keys(step, q_ok, num_extra, BLOCK_K: tl.constexpr):
    """Block ``step`` of the extra keys, which every query sees: their rows, which exist, which each query sees."""
    j = step * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = j < num_extra
    return j, k_ok, q_ok[:, None] & k_ok[None, :]


@_jit
def _tile(Base, image, batch, rows, row, head, ok, HEAD: tl.constexpr, BLOCK: tl.constexpr):
    """Pointers to one head's ``HEAD`` columns (``BLOCK`` lanes) of ``rows`` of one image, and which exist: 32-bit
    offsets from the image's 64-bit base (fewer registers a tile; ``_inputs`` refuses images they cannot address)."""
    d = tl.arange(0, BLOCK)
    return Base + image * batch + rows[:, None] * row + head * HEAD + d[None, :], ok[:, None] & (d < HEAD)[None, :]


@_jit
def _load(Base, image, batch, rows, row, head, ok, HEAD: tl.constexpr, BLOCK: tl.constexpr):
    """One head's columns of ``rows`` of one image (``_tile``), zeros where none are."""
    pointers, exist = _tile(Base, image, batch, rows, row, head, ok, HEAD, BLOCK)
    return tl.load(pointers, mask=exist, other=0.0)


@_jit
def _key_block(
    Keys, Values, strides, image, rows, head, k_ok, q, seen, bias, sm_scale,
    HEAD_QK: tl.constexpr, HEAD_V: tl.constexpr, BLOCK_QK: tl.constexpr, BLOCK_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """A block of keys (``rows`` of one image and head; ``strides``: the keys' image and row strides, the values'),
    the queries' scores against it in base 2 (``q k^T / sqrt(d) + bias``, times log2(e); -inf where unseen) and its
    values."""
    k_batch, k_row, v_batch, v_row = strides
    k = _load(Keys, image, k_batch, rows, k_row, head, k_ok, HEAD_QK, BLOCK_QK)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(ACC) * sm_scale + bias
    scores = tl.where(seen, scores * 1.4426950408889634, float("-inf"))
    return k, _load(Values, image, v_batch, rows, v_row, head, k_ok, HEAD_V, BLOCK_V), scores


@_jit
def _window_block(
    K, V, strides, Table, image, head, num_heads, step, region, q, sm_scale,
    WINDOW: tl.constexpr, EXTENT: tl.constexpr, HEAD_QK: tl.constexpr, HEAD_V: tl.constexpr, BLOCK_QK: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ACC: tl.constexpr,
):  # fmt: skip
    """Block ``step`` of the window's keys, their values and the queries' scores against them (``_key_block``), and
    the block's ``_window_keys``: its rows, which exist, which each query sees, the bias rows."""
    rows, k_ok, seen, bias_row, bias = _window_keys(
        step, region, Table, head, num_heads, WINDOW, EXTENT, BLOCK_K, HAS_BIAS, ACC
    )
    k, v, scores = _key_block(
        K, V, strides, image, rows, head, k_ok, q, seen, bias, sm_scale,
        HEAD_QK, HEAD_V, BLOCK_QK, BLOCK_V, DOT_PRECISION, ACC,
    )  # fmt: skip
    return k, v, scores, (rows, k_ok, seen, bias_row)


@_jit
def _softmax_step(scores, v, m, total, acc, DOT_PRECISION: tl.constexpr, ACC: tl.constexpr):
    """One key block of the online softmax: the running maximum, sum of exponentials and weighted values."""
    m_new = tl.maximum(m, tl.max(scores, 1))
    p = tl.exp2(scores - m_new[:, None])
    scale = tl.exp2(m - m_new)
    acc = acc * scale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION).to(ACC)
    return m_new, total * scale + tl.sum(p, 1), acc


@_jit
def _window_attention_2d_kernel(
    Q, K, V, ExtraK, ExtraV, Table, Out, Lse,
    q_batch, q_row, k_batch, k_row, v_batch, v_row, xk_batch, xk_row, xv_batch, xv_row,
    num_heads, map_h, map_w, num_extra, rects_per_row, programs, sm_scale,
    WINDOW_STEPS: tl.constexpr, EXTRA_STEPS: tl.constexpr, WINDOW: tl.constexpr, EXTENT: tl.constexpr,
    RECT_H: tl.constexpr, RECT_W: tl.constexpr, HEAD_QK: tl.constexpr, HEAD_V: tl.constexpr, BLOCK_QK: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """The forward pass: each query's output (``Out``, contiguous) and log-sum-exp of its scores in base 2 (``Lse``,
    (B, HW, heads)). ``WINDOW_STEPS``: the most key blocks a rectangle's window needs; a program whose window holds
    fewer skips its last steps (a loop bound of the program's own would not run in Triton 3.6's interpreter)."""
    image, head, q_rows, q_ok, region, window_steps = _rectangle(
        num_heads, map_h, map_w, rects_per_row, programs, WINDOW, EXTENT, RECT_H, RECT_W, BLOCK_Q, BLOCK_K
    )
    q = _load(Q, image, q_batch, q_rows, q_row, head, q_ok, HEAD_QK, BLOCK_QK)
    m = tl.full([BLOCK_Q], -1.0e30, ACC)  # finite: a row that has seen nothing yet keeps exp2(m - m_new) = 1
    total = tl.zeros([BLOCK_Q], ACC)
    acc = tl.zeros([BLOCK_Q, BLOCK_V], ACC)
    for step in range(WINDOW_STEPS):
        if step < window_steps:
            _, v, scores, _ = _window_block(
                K, V, (k_batch, k_row, v_batch, v_row), Table, image, head, num_heads, step, region, q, sm_scale,
                WINDOW, EXTENT, HEAD_QK, HEAD_V, BLOCK_QK, BLOCK_V, BLOCK_K, HAS_BIAS, DOT_PRECISION, ACC,
            )  # fmt: skip
            m, total, acc = _softmax_step(scores, v, m, total, acc, DOT_PRECISION, ACC)
    for step in range(EXTRA_STEPS):
        rows, k_ok, seen = _extra_keys(step, q_ok, num_extra, BLOCK_K)
        _, v, scores = _key_block(
            ExtraK, ExtraV, (xk_batch, xk_row, xv_batch, xv_row), image, rows, head, k_ok, q, seen, 0.0, sm_scale,
            HEAD_QK, HEAD_V, BLOCK_QK, BLOCK_V, DOT_PRECISION, ACC,
        )  # fmt: skip
        m, total, acc = _softmax_step(scores, v, m, total, acc, DOT_PRECISION, ACC)
    out_row = num_heads * HEAD_V
    pointers, exist = _tile(Out, image, map_h * map_w * out_row, q_rows, out_row, head, q_ok, HEAD_V, BLOCK_V)
    tl.store(pointers, (acc / tl.where(total > 0, total, 1.0)[:, None]).to(Out.dtype.element_ty), mask=exist)
    lse = m + tl.log2(tl.where(total > 0, total, 1.0))
    tl.store(Lse + (image * map_h * map_w + q_rows) * num_heads + head, lse, mask=q_ok)


@_jit
def _block_gradients(
    GradK, GradV, image, rows, head, k_ok, keys, num_heads, q, k, v, scores, lse, delta, grad_out, grad_q, sm_scale,
    HEAD_QK: tl.constexpr, HEAD_V: tl.constexpr, BLOCK_QK: tl.constexpr, BLOCK_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """A key block's part of the backward pass (FlashAttention-2's): its probabilities from the forward's log-sum-exp
    and the gradient of the natural scores, ``dS = P * (dO v^T - delta)`` (delta the row sums of ``dO * O``); adds
    ``dS k`` to the queries' gradient (``grad_q``, before its 1 / sqrt(d)) and the block's shares of its own,
    ``dS^T q / sqrt(d)`` and ``P^T dO``, to ``GradK`` and ``GradV`` (contiguous (B, keys, heads * d)). Returns the
    queries' gradient and dS."""
    p = tl.exp2(scores - lse[:, None])
    grad_scores = p * (tl.dot(grad_out, tl.trans(v), input_precision=DOT_PRECISION).to(ACC) - delta[:, None])
    grad_q += tl.dot(grad_scores.to(k.dtype), k, input_precision=DOT_PRECISION).to(ACC)
    grad_k = tl.dot(tl.trans(grad_scores.to(q.dtype)), q, input_precision=DOT_PRECISION) * sm_scale
    pointers, exist = _tile(
        GradK, image, keys * num_heads * HEAD_QK, rows, num_heads * HEAD_QK, head, k_ok, HEAD_QK, BLOCK_QK
    )
    tl.atomic_add(pointers, grad_k, mask=exist, sem="relaxed")
    grad_v = tl.dot(tl.trans(p.to(grad_out.dtype)), grad_out, input_precision=DOT_PRECISION)
    pointers, exist = _tile(
        GradV, image, keys * num_heads * HEAD_V, rows, num_heads * HEAD_V, head, k_ok, HEAD_V, BLOCK_V
    )
    tl.atomic_add(pointers, grad_v, mask=exist, sem="relaxed")
    return grad_q, grad_scores


@_jit
def _window_attention_2d_backward_kernel(
    Q, K, V, ExtraK, ExtraV, Table, GradOut, Lse, Delta, GradQ, GradK, GradV, GradExtraK, GradExtraV, GradTable,
    q_batch, q_row, k_batch, k_row, v_batch, v_row, xk_batch, xk_row, xv_batch, xv_row,
    num_heads, map_h, map_w, num_extra, rects_per_row, programs, sm_scale,
    WINDOW_STEPS: tl.constexpr, EXTRA_STEPS: tl.constexpr, WINDOW: tl.constexpr, EXTENT: tl.constexpr,
    RECT_H: tl.constexpr, RECT_W: tl.constexpr, HEAD_QK: tl.constexpr, HEAD_V: tl.constexpr, BLOCK_QK: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """The backward pass over the forward's programs and keys: the queries' gradient (``GradQ``, written), and the
    shares of the keys', values' (``GradK`` ... ``GradExtraV``) and bias table's gradients (``GradTable``), added.
    ``GradOut``, ``GradQ`` and the added gradients contiguous; ``Lse`` and ``Delta`` (B, HW, heads)."""
    image, head, q_rows, q_ok, region, window_steps = _rectangle(
        num_heads, map_h, map_w, rects_per_row, programs, WINDOW, EXTENT, RECT_H, RECT_W, BLOCK_Q, BLOCK_K
    )
    HW = map_h * map_w
    q = _load(Q, image, q_batch, q_rows, q_row, head, q_ok, HEAD_QK, BLOCK_QK)
    out_row = num_heads * HEAD_V
    grad_out = _load(GradOut, image, HW * out_row, q_rows, out_row, head, q_ok, HEAD_V, BLOCK_V)
    lse = tl.load(Lse + (image * HW + q_rows) * num_heads + head, mask=q_ok, other=0.0)
    delta = tl.load(Delta + (image * HW + q_rows) * num_heads + head, mask=q_ok, other=0.0)
    grad_q = tl.zeros([BLOCK_Q, BLOCK_QK], ACC)
    for step in range(WINDOW_STEPS):
        if step < window_steps:
            k, v, scores, block = _window_block(
                K, V, (k_batch, k_row, v_batch, v_row), Table, image, head, num_heads, step, region, q, sm_scale,
                WINDOW, EXTENT, HEAD_QK, HEAD_V, BLOCK_QK, BLOCK_V, BLOCK_K, HAS_BIAS, DOT_PRECISION, ACC,
            )  # fmt: skip
            rows, k_ok, seen, bias_row = block
            grad_q, grad_scores = _block_gradients(
                GradK, GradV, image, rows, head, k_ok, HW, num_heads, q, k, v, scores, lse, delta, grad_out, grad_q,
                sm_scale, HEAD_QK, HEAD_V, BLOCK_QK, BLOCK_V, DOT_PRECISION, ACC,
            )  # fmt: skip
            if HAS_BIAS:
                tl.atomic_add(GradTable + bias_row * num_heads + head, grad_scores, mask=seen, sem="relaxed")
    for step in range(EXTRA_STEPS):
        rows, k_ok, seen = _extra_keys(step, q_ok, num_extra, BLOCK_K)
        k, v, scores = _key_block(
            ExtraK, ExtraV, (xk_batch, xk_row, xv_batch, xv_row), image, rows, head, k_ok, q, seen, 0.0, sm_scale,
            HEAD_QK, HEAD_V, BLOCK_QK, BLOCK_V, DOT_PRECISION, ACC,
        )  # fmt: skip
        grad_q, _ = _block_gradients(
            GradExtraK, GradExtraV, image, rows, head, k_ok, num_extra, num_heads, q, k, v, scores, lse, delta,
            grad_out, grad_q, sm_scale, HEAD_QK, HEAD_V, BLOCK_QK, BLOCK_V, DOT_PRECISION, ACC,
        )  # fmt: skip
    q_width = num_heads * HEAD_QK
    pointers, exist = _tile(GradQ, image, HW * q_width, q_rows, q_width, head, q_ok, HEAD_QK, BLOCK_QK)
    tl.store(pointers, (grad_q * sm_scale).to(GradQ.dtype.element_ty), mask=exist)


# Warps per program of each kernel. Hopper builds (ptxas, bfloat16: cvt_ls_13's stages 1 and 3, vil_ls_medium's first)
# at 4 and 8 warps: the forward kernel spills no register for cvt_ls_13's first stage at 4 (232 registers a thread;
# 56-136 bytes on the others), none at 8; the backward kernel spills 184-476 bytes at 4 warps, 16-36 at 8.
WARPS = {"_window_attention_2d_kernel": 4, "_window_attention_2d_backward_kernel": 8}


def kernel_constants(
    geometry: LaunchGeometry, window: int, head_dims: tuple[int, int], dtype: torch.dtype, *, bias: bool
) -> dict:
    """The kernels' compile-time constants for a launch of ``geometry`` (``launch_geometry``): the key steps, the
    window, the query and value head dims and their blocks (at least 16, a power of 2), the bias table's presence and
    the precision (IEEE dot products for float32 and float64, whose accumulators are float64; Triton's default, TF32,
    which only float32 inputs would feel, for the half-precision dtypes)."""
    d_qk, d_v = head_dims
    return {
        "WINDOW_STEPS": geometry.window_steps,
        "EXTRA_STEPS": geometry.extra_steps,
        "WINDOW": window,
        "EXTENT": window_extent(window),
        "RECT_H": geometry.rectangle[0],
        "RECT_W": geometry.rectangle[1],
        "HEAD_QK": d_qk,
        "HEAD_V": d_v,
        "BLOCK_QK": _dot_block(d_qk),
        "BLOCK_V": _dot_block(d_v),
        "BLOCK_Q": geometry.block_q,
        "BLOCK_K": KEY_BLOCK,
        "HAS_BIAS": bias,
        "DOT_PRECISION": "ieee" if dtype in (torch.float32, torch.float64) else "tf32",
        "ACC": {torch.float32: tl.float32, torch.float64: tl.float64}[_accumulator_dtype(dtype)],
    }


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the kernels' accumulators, log-sum-exps and added gradients (``kernel_constants``' ``ACC``):
    float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_runnable(q: Tensor) -> None:
    """Raises where the kernels cannot run: a torch build without Triton, or CPU tensors outside the interpreter."""
    if not has_window_kernel():
        raise RuntimeError(
            "window_attention_2d needs Triton, which this torch build lacks (CUDA builds of torch on Linux install "
            "it); leave LongShortAttention2d.window_kernel False to use FlexAttention or the SDPA layouts."
        )
    if q.device.type == "cpu" and not isinstance(_window_attention_2d_kernel, InterpretedFunction):
        raise RuntimeError(
            "window_attention_2d got CPU tensors: its Triton kernel runs on the CPU only in Triton's interpreter; set "
            "TRITON_INTERPRET=1 before anything imports triton, or run it on CUDA."
        )


def _launch(kernel, q, k, v, extra_k, extra_v, bias_table, tensors, feat_size, window, num_heads) -> None:
    """Runs ``kernel`` over the programs of an (H, W) map in its ``WARPS``: ``tensors`` its pointers between the bias
    table and the strides, then the strides of q, k, v and the extra keys and values (their last dim contiguous), the
    sizes and ``kernel_constants``."""
    B, _, qk_width = q.shape
    d_qk, d_v = qk_width // num_heads, v.shape[-1] // num_heads
    geometry = launch_geometry(feat_size, window, extra_k.shape[1])
    kernel[(geometry.programs * B * num_heads,)](
        q, k, v, extra_k, extra_v, q if bias_table is None else bias_table, *tensors,
        *(stride for t in (q, k, v, extra_k, extra_v) for stride in t.stride()[:2]),
        num_heads, *feat_size, extra_k.shape[1], geometry.rects_per_row, geometry.programs, d_qk**-0.5,
        **kernel_constants(geometry, window, (d_qk, d_v), q.dtype, bias=bias_table is not None),
        num_warps=WARPS[kernel.__name__],
    )  # fmt: skip


def bias_table_rows(window: int) -> int:
    """Rows of the official ViL-LS window bias table (w >= 2): one per query-minus-key offset (dy, dx) of a window,
    both in [-(w - 1 + e), w - 1 + e], at the row ``_vil_bias_row`` gives it (``2 (w + e - 1)(2e + w + 1) + 1``)."""
    span = 2 * (window - 1 + window_extent(window))
    return span * (2 * window_extent(window) + window) + span + 1


def _inputs(q, k, v, extra_k, extra_v, bias_table, window, num_heads):
    """The kernels' inputs: every last dim contiguous, the table contiguous. Refused: keys and values in another
    dtype than q (``window_attention_2d`` casts them), images whose rows 32-bit offsets cannot address, a table of
    another shape than (``bias_table_rows``, heads) (the kernels would read and write past it)."""
    if any(t.dtype != q.dtype for t in (k, v, extra_k, extra_v)):
        raise ValueError(
            "the window attention operators take q, k, v, extra_k and extra_v in one dtype, got "
            f"{[str(t.dtype) for t in (q, k, v, extra_k, extra_v)]}; call window_attention_2d, which casts the keys "
            "and values to q's dtype."
        )
    if max(t.shape[1] * t.stride(1) for t in (q, k, v, extra_k, extra_v)) >= 2**31:
        raise ValueError(
            "window_attention_2d addresses the rows of an image with 32-bit offsets, and an image of q, k, v or the "
            f"extra keys spans 2**31 elements or more (shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}); "
            "leave LongShortAttention2d.window_kernel False for such maps."
        )
    if bias_table is not None and bias_table.shape != (bias_table_rows(window), num_heads):
        raise ValueError(
            f"bias_table must have shape ({bias_table_rows(window)}, {num_heads}) for window={window} and "
            f"num_heads={num_heads} (one row per query-minus-key offset), got {tuple(bias_table.shape)}."
        )
    q, k, v, extra_k, extra_v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, extra_k, extra_v))
    return q, k, v, extra_k, extra_v, None if bias_table is None else bias_table.contiguous()


@torch.library.custom_op("transformer_ls::window_attention_2d", mutates_args=())
def _window_attention_2d_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    extra_k: Tensor,
    extra_v: Tensor,
    map_height: int,
    map_width: int,
    window: int,
    num_heads: int,
    bias_table: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """``window_attention_2d``'s output, and each query's log-sum-exp of its scores in base 2 (B, HW, heads), which
    the backward pass needs."""
    _check_runnable(q)
    B, HW, _ = q.shape
    inputs = _inputs(q, k, v, extra_k, extra_v, bias_table, window, num_heads)
    out = torch.empty(B, HW, v.shape[-1], device=v.device, dtype=q.dtype)
    lse = torch.empty(B, HW, num_heads, device=v.device, dtype=_accumulator_dtype(q.dtype))
    _launch(_window_attention_2d_kernel, *inputs, (out, lse), (map_height, map_width), window, num_heads)
    return out, lse


@_window_attention_2d_forward.register_fake
def _(q, k, v, extra_k, extra_v, map_height, map_width, window, num_heads, bias_table):
    B, HW, _ = q.shape
    return q.new_empty(B, HW, v.shape[-1]), q.new_empty(B, HW, num_heads, dtype=_accumulator_dtype(q.dtype))


@torch.library.custom_op("transformer_ls::window_attention_2d_backward", mutates_args=())
def _window_attention_2d_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    extra_k: Tensor,
    extra_v: Tensor,
    out: Tensor,
    lse: Tensor,
    map_height: int,
    map_width: int,
    window: int,
    num_heads: int,
    bias_table: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of q, k, v, extra_k, extra_v (in their dtype, q's) and the bias table (in its own; an empty tensor
    without one), contiguous."""
    _check_runnable(q)
    B, HW, _ = q.shape
    acc = _accumulator_dtype(q.dtype)
    inputs = _inputs(q, k, v, extra_k, extra_v, bias_table, window, num_heads)
    delta = (grad_out.to(acc) * out.to(acc)).view(B, HW, num_heads, -1).sum(-1)
    grads = [torch.zeros(t.shape, device=q.device, dtype=acc) for t in inputs[1:5]]
    table_grad = torch.zeros(() if bias_table is None else bias_table.shape, device=q.device, dtype=acc)
    grad_q = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    tensors = (grad_out.contiguous(), lse, delta, grad_q, *grads, table_grad)
    _launch(_window_attention_2d_backward_kernel, *inputs, tensors, (map_height, map_width), window, num_heads)
    table_grad = q.new_empty(0) if bias_table is None else table_grad.to(bias_table.dtype)
    return grad_q, *(grad.to(q.dtype) for grad in grads), table_grad


@_window_attention_2d_backward.register_fake
def _(grad_out, q, k, v, extra_k, extra_v, out, lse, map_height, map_width, window, num_heads, bias_table):
    return (
        *(t.new_empty(t.shape) for t in (q, k, v, extra_k, extra_v)),
        q.new_empty(0) if bias_table is None else bias_table.new_empty(bias_table.shape),
    )


def _save_for_backward(ctx, inputs, output) -> None:
    """What the backward pass takes: the tensors, the output and its log-sum-exp (not differentiable), the sizes."""
    q, k, v, extra_k, extra_v, map_height, map_width, window, num_heads, bias_table = inputs
    ctx.save_for_backward(q, k, v, extra_k, extra_v, bias_table, *output)
    ctx.layout = (map_height, map_width, window, num_heads)
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad_out, _grad_lse):
    """The gradients of the forward operator's tensors from its output's (``_window_attention_2d_backward``)."""
    q, k, v, extra_k, extra_v, bias_table, out, lse = ctx.saved_tensors
    grads = _window_attention_2d_backward(grad_out, q, k, v, extra_k, extra_v, out, lse, *ctx.layout, bias_table)
    return *grads[:5], None, None, None, None, None if bias_table is None else grads[5]


_window_attention_2d_forward.register_autograd(_backward, setup_context=_save_for_backward)


def window_attention_2d(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    extra_k: Tensor,
    extra_v: Tensor,
    *,
    map_height: int,
    map_width: int,
    window: int,
    num_heads: int,
    bias_table: Tensor | None,
) -> Tensor:
    """Every patch query against its window's keys and the extra keys, in one softmax per query (Eq. 6);
    differentiable in every tensor.

    q, k (B, HW, heads * d_qk) and v (B, HW, heads * d) the patches' queries, keys and values in raster order;
    extra_k, extra_v (B, X, ...) the keys and values every query sees; ``bias_table`` (rows, heads) the ViL-LS window
    bias or None -> (B, HW, heads * d) in q's dtype. Keys and values are taken in q's dtype, as SDPA takes them under
    autocast (where DualLN's norms give float32 keys and values beside half-precision queries); their gradients come
    back in their own. The scale is ``d_qk ** -0.5``, as SDPA's."""
    k, v, extra_k, extra_v = (t.to(q.dtype) for t in (k, v, extra_k, extra_v))  # autograd casts their gradients back
    out, _ = _window_attention_2d_forward(
        q, k, v, extra_k, extra_v, map_height, map_width, window, num_heads, bias_table
    )
    return out

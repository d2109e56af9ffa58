"""The 2-D Long-Short attention of inference (Zhu et al., "Long-Short Transformer", NeurIPS 2021, Sec. 3.2-3.3, 4.3,
Eq. 6) in one Triton kernel that reads the patches where the layer wrote them, in raster order.

Each program takes a rectangle of the map's queries (``query_rectangle``: whole w x w query blocks, or rows of one)
for one image and head, and runs one online softmax over the keys of the rectangle's windows, read straight from
the patch rows (the window's rows and columns, clipped to the map), then over the extra keys (projected rows, global
tokens) that every query sees. A key is seen where the window rule (``window_bounds`` on each axis) holds; with the
ViL-LS bias, its table row (``_vil_bias_row``) is added to the score. No tile order, no gathered copies, no
block mask: the work is the rectangle's windows and the extra keys.

Forward only (inference: ``LongShortAttention2d`` calls it where autograd records nothing). Triton compiles it for
CUDA; with ``TRITON_INTERPRET=1`` set before Triton is imported it runs in Triton's interpreter, on the CPU too, which
is how the tests check it against the SDPA layouts. This file imports nothing from Transformers or timm.
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
except ImportError:  # torch builds without Triton (macOS, CPU-only wheels): the kernel is not available
    triton = tl = InterpretedFunction = None

__all__ = [
    "LaunchGeometry",
    "has_window_kernel",
    "kernel_constants",
    "launch_geometry",
    "query_rectangle",
    "window_attention_2d",
]

# Queries a program takes at most (its rectangle of the map), and keys per step of its loop.
RECTANGLE_QUERIES = 64
KEY_BLOCK = 64


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
    """How the kernel covers an (H, W) map: programs of ``rectangle`` queries (``query_rectangle``), ``block_q`` lanes
    each, ``rects_per_row`` across the map, ``programs`` per image and head, each running ``steps`` blocks of
    ``KEY_BLOCK`` keys (the most any rectangle's window needs, then the extra keys')."""

    rectangle: tuple[int, int]
    block_q: int
    rects_per_row: int
    programs: int
    steps: int


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
        -(-window_keys // KEY_BLOCK) - (-extra // KEY_BLOCK),
    )


@(triton.jit if triton is not None else lambda fn: fn)
def _window_attention_2d_kernel(
    Q, K, V, ExtraK, ExtraV, Table, Out,
    q_batch, q_row, k_batch, k_row, v_batch, v_row, xk_batch, xk_row, xv_batch, xv_row, out_batch, out_row,
    num_heads, map_h, map_w, num_extra, rects_per_row, programs, qk_scale, STEPS: tl.constexpr,
    WINDOW: tl.constexpr, EXTENT: tl.constexpr, RECT_H: tl.constexpr, RECT_W: tl.constexpr,
    HEAD_QK: tl.constexpr, HEAD_V: tl.constexpr, BLOCK_QK: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ACC: tl.constexpr,
):  # fmt: skip
    """One program per (image x head, rectangle), the grid flat (no axis limit of 65,535), neighbouring rectangles
    next to each other (they share keys in the cache); scores in base 2 (``qk_scale`` holds log2(e)). ``STEPS``: the
    most key blocks a program visits (its window's, then the extra keys'); a program whose window holds fewer runs its
    last steps on no key (a loop bound of the program's own would not run in Triton 3.6's interpreter)."""
    rect, image_head = tl.program_id(0) % programs, tl.program_id(0) // programs
    image, head = image_head // num_heads, image_head % num_heads
    top, left = rect // rects_per_row * RECT_H, rect % rects_per_row * RECT_W
    lane = tl.arange(0, BLOCK_Q)
    qy, qx = top + lane // RECT_W, left + lane % RECT_W
    q_ok = (lane < RECT_H * RECT_W) & (qy < map_h) & (qx < map_w)
    # each query's window, [lo, lo + w + 2e) on each axis (window_bounds), and the rectangle's: their union in the map
    y_lo, x_lo = qy // WINDOW * WINDOW - EXTENT, qx // WINDOW * WINDOW - EXTENT
    key_top, key_left = tl.maximum(top // WINDOW * WINDOW - EXTENT, 0), tl.maximum(left // WINDOW * WINDOW - EXTENT, 0)
    last_y, last_x = tl.minimum(top + RECT_H, map_h) - 1, tl.minimum(left + RECT_W, map_w) - 1
    key_bottom = tl.minimum(last_y // WINDOW * WINDOW + WINDOW + EXTENT, map_h)
    region_w = tl.minimum(last_x // WINDOW * WINDOW + WINDOW + EXTENT, map_w) - key_left
    window_steps = tl.cdiv((key_bottom - key_top) * region_w, BLOCK_K)

    d_qk, d_v, k_lane = tl.arange(0, BLOCK_QK), tl.arange(0, BLOCK_V), tl.arange(0, BLOCK_K)
    image = image.to(tl.int64)
    q_rows = (qy * map_w + qx).to(tl.int64)
    q = tl.load(
        Q + image * q_batch + q_rows[:, None] * q_row + head * HEAD_QK + d_qk[None, :],
        mask=q_ok[:, None] & (d_qk < HEAD_QK)[None, :],
        other=0.0,
    )
    m = tl.full([BLOCK_Q], -1.0e30, ACC)  # finite: a row that has seen nothing yet keeps exp2(m - m_new) = 1
    total = tl.zeros([BLOCK_Q], ACC)
    acc = tl.zeros([BLOCK_Q, BLOCK_V], ACC)
    for step in range(STEPS):
        if step < window_steps:  # patch keys of the region, row by row
            j = step * BLOCK_K + k_lane
            ky, kx = key_top + j // region_w, key_left + j % region_w
            k_ok = j < (key_bottom - key_top) * region_w
            rows = (ky * map_w + kx).to(tl.int64)
            k_ptr = K + image * k_batch + rows[:, None] * k_row + head * HEAD_QK + d_qk[None, :]
            v_ptr = V + image * v_batch + rows[:, None] * v_row + head * HEAD_V + d_v[None, :]
            seen = (
                k_ok[None, :]
                & (ky[None, :] >= y_lo[:, None])
                & (ky[None, :] < y_lo[:, None] + WINDOW + 2 * EXTENT)
                & (kx[None, :] >= x_lo[:, None])
                & (kx[None, :] < x_lo[:, None] + WINDOW + 2 * EXTENT)
            )
            bias = tl.zeros([BLOCK_Q, BLOCK_K], ACC)
            if HAS_BIAS:  # _vil_bias_row of the query-minus-key offsets (EXTENT = w // 2 where the table exists)
                row = (qy[:, None] - ky[None, :] + EXTENT + WINDOW - 1) * (2 * EXTENT + WINDOW) + (
                    qx[:, None] - kx[None, :] + EXTENT + WINDOW - 1
                )
                bias = tl.load(Table + row * num_heads + head, mask=seen, other=0.0).to(ACC) * 1.4426950408889634
        else:  # the extra keys, which every query sees (none past them)
            j = (step - window_steps) * BLOCK_K + k_lane
            k_ok = j < num_extra
            k_ptr = ExtraK + image * xk_batch + j[:, None] * xk_row + head * HEAD_QK + d_qk[None, :]
            v_ptr = ExtraV + image * xv_batch + j[:, None] * xv_row + head * HEAD_V + d_v[None, :]
            seen = k_ok[None, :] & (lane >= 0)[:, None]
            bias = tl.zeros([BLOCK_Q, BLOCK_K], ACC)
        k = tl.load(k_ptr, mask=k_ok[:, None] & (d_qk < HEAD_QK)[None, :], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(ACC)
        scores = tl.where(seen, scores * qk_scale + bias, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        scale = tl.exp2(m - m_new)
        v = tl.load(v_ptr, mask=k_ok[:, None] & (d_v < HEAD_V)[None, :], other=0.0)
        acc = acc * scale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION).to(ACC)
        total = total * scale + tl.sum(p, 1)
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(
        Out + image * out_batch + q_rows[:, None] * out_row + head * HEAD_V + d_v[None, :],
        out.to(Out.dtype.element_ty),
        mask=q_ok[:, None] & (d_v < HEAD_V)[None, :],
    )


def kernel_constants(
    geometry: LaunchGeometry, window: int, head_dims: tuple[int, int], dtype: torch.dtype, *, bias: bool
) -> dict:
    """The kernel's compile-time constants for a launch of ``geometry`` (``launch_geometry``): the window, the query
    and value head dims and their blocks (at least 16, a power of 2), the bias table's presence and the precision
    (IEEE dot products for float32 and float64, whose accumulators are float64; Triton's default, TF32, which only
    float32 inputs would feel, for the half-precision dtypes)."""
    d_qk, d_v = head_dims
    return {
        "STEPS": geometry.steps,
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
        "ACC": tl.float64 if dtype == torch.float64 else tl.float32,
    }


@torch.library.custom_op("transformer_ls::window_attention_2d", mutates_args=())
def window_attention_2d(
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
) -> Tensor:
    """Every patch query against its window's keys and the extra keys, in one softmax per query (Eq. 6).

    q, k (B, HW, heads * d_qk) and v (B, HW, heads * d) the patches' queries, keys and values in raster order;
    extra_k, extra_v (B, X, ...) the keys and values every query sees; ``bias_table`` (rows, heads) the ViL-LS window
    bias or None -> (B, HW, heads * d) in v's dtype. The scale is ``d_qk ** -0.5``, as SDPA's."""
    if not has_window_kernel():
        raise RuntimeError(
            "window_attention_2d needs Triton, which this torch build lacks (CUDA builds of torch on Linux install "
            "it); leave LongShortAttention2d.window_kernel_devices empty to use FlexAttention or the SDPA layouts."
        )
    if q.device.type == "cpu" and not isinstance(_window_attention_2d_kernel, InterpretedFunction):
        raise RuntimeError(
            "window_attention_2d got CPU tensors: its Triton kernel runs on the CPU only in Triton's interpreter; set "
            "TRITON_INTERPRET=1 before anything imports triton, or run it on CUDA."
        )
    B, HW, qk_width = q.shape
    d_qk, d_v = qk_width // num_heads, v.shape[-1] // num_heads
    extra_k, extra_v = extra_k.to(q.dtype), extra_v.to(q.dtype)
    q, k, v, extra_k, extra_v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, extra_k, extra_v))
    out = torch.empty(B, HW, v.shape[-1], device=v.device, dtype=v.dtype)
    geometry = launch_geometry((map_height, map_width), window, extra_k.shape[1])
    _window_attention_2d_kernel[(geometry.programs * B * num_heads,)](
        q, k, v, extra_k, extra_v, q if bias_table is None else bias_table.contiguous(), out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        extra_k.stride(0), extra_k.stride(1), extra_v.stride(0), extra_v.stride(1), out.stride(0), out.stride(1),
        num_heads, map_height, map_width, extra_k.shape[1], geometry.rects_per_row, geometry.programs,
        d_qk**-0.5 * math.log2(math.e),
        **kernel_constants(geometry, window, (d_qk, d_v), q.dtype, bias=bias_table is not None),
    )  # fmt: skip
    return out


@window_attention_2d.register_fake
def _(q, k, v, extra_k, extra_v, map_height, map_width, window, num_heads, bias_table):
    return v.new_empty(*q.shape[:2], v.shape[-1])

"""Kernels of Long-Short attention: the memory-lean training path's autograd functions, and the home of the
device-specific kernels.

With ``recompute_window_tiles=True``, training on CPU saves for the backward pass about what fused dense attention
saves (``bench/RESULTS.md``):

* ``TiledAttention``: each group of queries attends to its window tile, [the extra rows; its window keys], one chunk
  of groups at a time; the backward pass gathers each chunk's tiles again instead of keeping every tile;
* ``LayerNormInPlace`` (``layer_norm_in_place``): DualLN's ``LN_L`` (Eq. 7) written over the Linears' outputs,
  keeping its output only;
* ``DynamicProjection``: Eq. 3's scores and P built a few heads at a time, and again in the backward pass.

On the fused path, ``JoinedProjectedKeys`` builds the keys and values of the one attention kernel call, [window keys;
global keys; projected rows], and keeps the window keys only there, applying ``LN_L`` too where the gains allow
recovering its input from its output (``recoverable_layer_norms``).

Each matches its plain-autograd counterpart (``tests/test_attention.py``). This file imports nothing from
Transformers or timm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .long_short_rules import projected, projection_weights

__all__ = [
    "FUSED_CPU",
    "LN_MIN_GAMMA",
    "TILE_CHUNK_BYTES",
    "DynamicProjection",
    "JoinedProjectedKeys",
    "LayerNormInPlace",
    "TiledAttention",
    "gather_tiles",
    "layer_norm_in_place",
    "layer_norm_input_grad",
    "recoverable_layer_norms",
    "segments_heads_first",
]

# The fused CPU kernel behind F.scaled_dot_product_attention (torch >= 2.3), called directly so that its log-sum-exp
# is kept for the backward pass (the public function returns only the output). It needs one head dim for q, k and v.
FUSED_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FUSED_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
# The gathered keys and values of one chunk of groups in ``TiledAttention`` (one group of 256 queries at hidden 768,
# w = 256, r = 64), the rows of one chunk in ``LayerNormInPlace``'s passes and the P of one chunk of heads in
# ``DynamicProjection``'s: larger chunks trade memory for fewer, larger operations.
TILE_CHUNK_BYTES = 4 * 2**20


def gather_tiles(rows: Tensor | None, x: Tensor, index: Tensor) -> Tensor:
    """For each of G groups, the R ``rows`` then the entries of ``x`` (B, L, ...) at ``index`` (G, S), where index L
    stands for a zero entry: (B, G, R + S, ...)."""
    B, L = x.shape[:2]
    G, S = index.shape
    window = x.index_select(1, index.clamp(max=max(L - 1, 0)).flatten()).view(B, G, S, *x.shape[2:])
    outside = index == L
    if torch.compiler.is_compiling() or outside.any():  # traced: no branch on the values
        outside = outside.view(1, G, S, *(1,) * (x.dim() - 2))
        # a bool tensor (validity) with & (ONNX Runtime has no bool Where)
        window = window & ~outside if window.dtype == torch.bool else window.masked_fill(outside, 0)
    if rows is None:
        return window
    return torch.cat([rows[:, None].expand(B, G, *rows.shape[1:]), window], 2)


class TiledAttention(torch.autograd.Function):
    """Each group of Q queries attends to its tile, [the R extra rows; its window keys], one chunk of groups at a
    time, saving only the inputs, the output and the log-sum-exp: the backward pass gathers each chunk's tiles again
    (a copy) instead of keeping every tile, which would hold (R + S) / Q copies of the keys and values. On the fused
    CPU kernel (``FUSED_CPU``), whose backward takes the saved output and log-sum-exp.

    q (B, G*Q, H, d_qk); k, v (B, L, H, d) window keys; rows_k, rows_v (B, R, H, d) or None; index (G, S) into k,
    with L standing for a zero key; keep (B, G, Q|1, R + S) -> (B, G*Q, H, d_v), in q's dtype.
    """

    @staticmethod
    def _chunks(step, q, k, v, rows_k, rows_v, index, bias):
        """(groups, q, k, v, bias) per chunk of ``step`` groups, heads first: (B*g, H, Q, d), (B*g, H, R + S, d) twice
        and (B*g, 1, Q|1, R + S)."""
        G = index.shape[0]
        for start in range(0, G, step):
            groups = slice(start, min(start + step, G))
            tiles = (
                gather_tiles(rows, x, index[groups]).to(q.dtype).flatten(0, 1).transpose(1, 2)
                for rows, x in ((rows_k, k), (rows_v, v))
            )
            yield (
                groups,
                q.unflatten(1, (G, -1))[:, groups].flatten(0, 1).transpose(1, 2),
                *tiles,
                bias[:, groups].flatten(0, 1).unsqueeze(1),
            )

    @staticmethod
    def forward(ctx, q, k, v, rows_k, rows_v, index, keep):
        B, _, H, _ = q.shape
        G = index.shape[0]
        bias = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill_(~keep, float("-inf"))
        out = q.new_empty(B, q.shape[1], H, v.shape[-1])
        lse = q.new_empty(B, G, H, q.shape[1] // G, dtype=torch.promote_types(q.dtype, torch.float32))
        tile_bytes = B * bias.shape[-1] * H * (k.shape[-1] + v.shape[-1]) * q.element_size()
        ctx.step = max(1, TILE_CHUNK_BYTES // max(tile_bytes, 1))  # the backward pass takes the same chunks
        for groups, *chunk in TiledAttention._chunks(ctx.step, q, k, v, rows_k, rows_v, index, bias):
            o, chunk_lse = FUSED_CPU(*chunk[:3], attn_mask=chunk[3])
            out.unflatten(1, (G, -1))[:, groups] = o.unflatten(0, (B, -1)).transpose(2, 3)
            lse[:, groups] = chunk_lse.unflatten(0, (B, -1))
        ctx.save_for_backward(q, k, v, rows_k, rows_v, index, bias, out, lse)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, rows_k, rows_v, index, bias, out, lse = ctx.saved_tensors
        B, L = k.shape[:2]
        G = index.shape[0]
        R = 0 if rows_k is None else rows_k.shape[1]
        grad_q = torch.empty_like(q, memory_format=torch.contiguous_format)
        grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
        grad_rows = [None if rows is None else torch.zeros_like(rows) for rows in (rows_k, rows_v)]

        def heads_first(x, groups):  # (B, G*Q, H, d) -> the chunk's (B*g, H, Q, d), contiguous as the kernel made it
            return x.unflatten(1, (G, -1))[:, groups].flatten(0, 1).transpose(1, 2).contiguous()

        chunks = TiledAttention._chunks(ctx.step, q, k, v, rows_k, rows_v, index, bias)
        for groups, *chunk in chunks:
            grads = FUSED_CPU_BACKWARD(
                heads_first(grad_out, groups),
                *chunk[:3],
                heads_first(out, groups),
                lse[:, groups].flatten(0, 1).contiguous(),
                0.0,
                False,
                attn_mask=chunk[3],
            )
            grad_q.unflatten(1, (G, -1))[:, groups] = grads[0].unflatten(0, (B, -1)).transpose(2, 3)
            read = index[groups].clamp(max=max(L - 1, 0)).flatten()  # as ``gather_tiles``: a zero key's gradient is 0
            for grad, tile_grad, rows_grad in zip((grad_k, grad_v), grads[1:], grad_rows):
                tile_grad = tile_grad.unflatten(0, (B, -1)).transpose(2, 3)  # (B, g, R + S, H, d)
                if rows_grad is not None:
                    rows_grad += tile_grad[:, :, :R].sum(1)
                grad.index_add_(1, read, tile_grad[:, :, R:].flatten(1, 2).to(grad.dtype))
        return grad_q, grad_k, grad_v, *grad_rows, None, None


def layer_norm_input_grad(grad_y: Tensor, x_hat: Tensor, rstd: Tensor, weight: Tensor) -> Tensor:
    """LayerNorm's gradient with respect to its input, over the last dim: ``rstd (g - mean(g) - x_hat mean(g x_hat))``
    with ``g = grad_y * weight``, all in one dtype. ``x_hat`` (the normalized input) is overwritten."""
    g = grad_y * weight
    mean_g = g.mean(-1, keepdim=True)
    mean_gx = (g * x_hat).mean(-1, keepdim=True)
    return g.sub_(mean_g).sub_(x_hat.mul_(mean_gx)).mul_(rstd)


class LayerNormInPlace(torch.autograd.Function):
    """LayerNorm over the last dim, written over its input (which nothing else may need: a Linear's fresh output), row
    chunk by row chunk (``TILE_CHUNK_BYTES``): no tensor of the input's size is made or freed. It saves its output
    ``y = gamma * x_hat + beta`` and ``1 / sigma``, and the backward pass recovers ``x_hat = (y - beta) / gamma``:
    DualLN's ``LN_L`` output is kept by the window attention and the projection anyway, so the input (one more copy
    of the keys and values) is not. The backward pass runs in row chunks too, so its temporaries stay small. Needs a
    contiguous input and every ``|gamma| >= LN_MIN_GAMMA`` (``layer_norm_in_place`` checks)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        width = x.shape[-1]
        rows = x.view(-1, width)
        rstd = torch.empty(rows.shape[0], 1, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
        step = max(1, TILE_CHUNK_BYTES // (width * max(x.element_size(), 4)))
        for start in range(0, rows.shape[0], step):
            part = slice(start, start + step)
            y, _, rstd[part] = torch.native_layer_norm(rows[part], (width,), weight, bias, eps)
            rows[part] = y
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, weight, bias, rstd)
        return x

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        y, weight, bias, rstd = ctx.saved_tensors  # read once: gradient checkpointing allows one unpacking
        shape, dtype, width = y.shape, torch.promote_types(y.dtype, torch.float32), y.shape[-1]
        y, grad_y, rstd = y.reshape(-1, width), grad_y.reshape(-1, width), rstd.reshape(-1, 1)
        gamma, beta = weight.to(dtype), bias.to(dtype)
        grad_x = torch.empty_like(y)
        grad_weight = torch.zeros(width, dtype=dtype, device=y.device)
        grad_bias = torch.zeros(width, dtype=dtype, device=y.device)
        step = max(1, TILE_CHUNK_BYTES // (width * max(y.element_size(), 4)))
        for rows in range(0, y.shape[0], step):
            part = slice(rows, rows + step)
            x_hat = (y[part].to(dtype) - beta).div_(gamma)
            g = grad_y[part].to(dtype)
            grad_weight += (g * x_hat).sum(0)
            grad_bias += g.sum(0)
            grad_x[part] = layer_norm_input_grad(g, x_hat, rstd[part].to(dtype), gamma)
        return grad_x.view(shape), grad_weight.to(weight.dtype), grad_bias.to(bias.dtype), None


LN_MIN_GAMMA = 1e-3


def recoverable_layer_norms(norms) -> frozenset[nn.LayerNorm]:
    """Those of ``norms`` whose normalized input ``x_hat = (y - beta) / gamma`` can be recovered from their output y:
    gain and bias present and every ``|gamma| >= LN_MIN_GAMMA``. All gains are read in one read of the device, which
    waits for them (``long_short_plan`` asks once per forward pass for every layer's)."""
    norms = [norm for norm in dict.fromkeys(norms) if norm.weight is not None and norm.bias is not None]
    if not norms:
        return frozenset()
    answers = torch.stack([norm.weight.detach().abs().amin() >= LN_MIN_GAMMA for norm in norms]).tolist()
    return frozenset(norm for norm, answer in zip(norms, answers) if answer)


def layer_norm_in_place(x: Tensor, norm: nn.LayerNorm) -> Tensor:
    """``norm(x)`` written over ``x`` (``LayerNormInPlace``) when ``x`` is contiguous, otherwise ``norm(x)``; for a
    ``norm`` whose gains allow recovering ``x_hat`` from the output (``recoverable_layer_norms``). The caller's ``x``
    must be needed by nothing else."""
    if not x.is_contiguous():
        return norm(x)
    return LayerNormInPlace.apply(x, norm.weight, norm.bias, norm.eps)


class DynamicProjection(torch.autograd.Function):
    """``project_rows`` (Eq. 3) on the scores ``X W^P + b`` computed here, a chunk of heads at a time
    (``TILE_CHUNK_BYTES``), so that neither the scores nor P of all heads is ever made: it saves the inputs (the layer
    input, the keys and values that the window attention keeps anyway) and the r rows, and the backward pass builds
    each chunk's P again. There the gradient of P comes from both ``P K`` and ``P V``, the softmax backward
    ``P * (dP - sum_L(P dP))`` takes ``sum_L(P dP)`` from the rows (``g_K . (P K) + g_V . (P V)`` over the features,
    no (r, L) product), and the scores' gradient goes straight into those of X, W^P and b.

    hidden (..., L, D), weight (H r, D), bias (H r) or None, keys (..., H, L, d_k), values (..., H, L, d_v),
    valid (..., L) or None -> (..., H, r, d_k) and (..., H, r, d_v), in the dtypes of keys and values.
    """

    @staticmethod
    def _head_chunks(ctx, hidden):
        """(heads, their columns of W^P) per chunk, sized so that the backward pass's four P-sized temporaries (P, its
        gradient and two products) take at most ``TILE_CHUNK_BYTES``."""
        rank = ctx.rank
        p_bytes = hidden[..., 0].numel() * rank * max(hidden.element_size(), 4)  # one head's P, float32 at least
        step = max(1, TILE_CHUNK_BYTES // max(4 * p_bytes, 1))
        for start in range(0, ctx.heads, step):
            chunk = slice(start, min(start + step, ctx.heads))
            yield chunk, slice(chunk.start * rank, chunk.stop * rank)

    @staticmethod
    def _weights(ctx, hidden, weight, bias, valid, columns):
        """P of the chunk of heads whose ``columns`` of W^P are given, (..., g, r, L), contiguous, in float32 at
        least; the scores are computed under the forward pass's autocast state, so that the backward pass builds the
        same P."""
        with torch.autocast(hidden.device.type, dtype=ctx.autocast_dtype, enabled=ctx.autocast):
            scores = F.linear(hidden, weight[columns], None if bias is None else bias[columns])
        return projection_weights(scores.unflatten(-1, (-1, ctx.rank)).movedim(-3, -1), valid, in_place=True)

    @staticmethod
    def forward(ctx, hidden, weight, bias, keys, values, valid):
        device = hidden.device.type
        ctx.heads, ctx.rank = keys.shape[-3], weight.shape[0] // keys.shape[-3]
        ctx.autocast, ctx.autocast_dtype = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
        dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        rows_k = keys.new_empty(*keys.shape[:-2], ctx.rank, keys.shape[-1], dtype=dtype)
        rows_v = values.new_empty(*rows_k.shape[:-1], values.shape[-1], dtype=dtype)
        for chunk, columns in DynamicProjection._head_chunks(ctx, hidden):
            prob = DynamicProjection._weights(ctx, hidden, weight, bias, valid, columns)
            rows_k[..., chunk, :, :] = prob @ keys[..., chunk, :, :].to(dtype)
            rows_v[..., chunk, :, :] = prob @ values[..., chunk, :, :].to(dtype)
        ctx.save_for_backward(hidden, weight, bias, keys, values, valid, rows_k, rows_v)
        return rows_k.to(keys.dtype), rows_v.to(values.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_rows_k, grad_rows_v):
        hidden, weight, bias, keys, values, valid, rows_k, rows_v = ctx.saved_tensors
        dtype = rows_k.dtype
        grad_rows_k, grad_rows_v = grad_rows_k.to(dtype), grad_rows_v.to(dtype)
        row_dot = torch.linalg.vecdot(grad_rows_k, rows_k) + torch.linalg.vecdot(grad_rows_v, rows_v)
        inputs = hidden.reshape(-1, hidden.shape[-1]).to(dtype)
        grad_inputs = torch.zeros_like(inputs) if ctx.needs_input_grad[0] else None
        grad_weight = torch.empty(weight.shape, dtype=dtype, device=weight.device)
        grad_bias = None if bias is None else torch.empty(bias.shape, dtype=dtype, device=bias.device)
        grad_keys, grad_values = torch.empty_like(keys), torch.empty_like(values)
        for chunk, columns in DynamicProjection._head_chunks(ctx, hidden):
            prob = DynamicProjection._weights(ctx, hidden, weight, bias, valid, columns)
            g_k, g_v = grad_rows_k[..., chunk, :, :], grad_rows_v[..., chunk, :, :]
            grad_scores = g_k @ keys[..., chunk, :, :].to(dtype).transpose(-1, -2)
            grad_scores += g_v @ values[..., chunk, :, :].to(dtype).transpose(-1, -2)
            grad_scores.sub_(row_dot[..., chunk, :, None]).mul_(prob)
            if valid is not None:  # the excluded tokens' scores (masked) get no gradient
                grad_scores.masked_fill_(~valid[..., None, None, :], 0)
            grad_keys[..., chunk, :, :] = prob.transpose(-1, -2) @ g_k
            grad_values[..., chunk, :, :] = prob.transpose(-1, -2) @ g_v
            del prob  # before the scores' gradient is laid out as rows (a copy)
            grad_scores = grad_scores.movedim(-1, -3).reshape(-1, columns.stop - columns.start)  # (..., L, g r)
            if grad_inputs is not None:
                grad_inputs.addmm_(grad_scores, weight[columns].to(dtype))
            grad_weight[columns] = grad_scores.T @ inputs
            if grad_bias is not None:
                grad_bias[columns] = grad_scores.sum(0)
            del grad_scores  # before the next chunk's P
        return (
            None if grad_inputs is None else grad_inputs.view(hidden.shape).to(hidden.dtype),
            grad_weight.to(weight.dtype),
            None if bias is None else grad_bias.to(bias.dtype),
            grad_keys,
            grad_values,
            None,
        )


def segments_heads_first(x: Tensor, segments: int) -> Tensor:
    """x (B, S*l, H, c) as S segments of l tokens, heads first: a (B, S, H, l, c) view."""
    return x.unflatten(1, (segments, -1)).transpose(2, 3)


def in_copies(x: Tensor, copies: int) -> Tensor:
    """x (B, R, ...) repeated ``copies`` times along dim 1: (B, copies * R, ...), copy-major."""
    return x.unsqueeze(1).expand(x.shape[0], copies, *x.shape[1:]).flatten(1, 2)


class JoinedProjectedKeys(torch.autograd.Function):
    """The keys (or values) of the fused path's one softmax (Eq. 6) in one tensor, [window; prefix; rows]: the window
    keys after ``LN_L``, the global tokens' keys, and the projected rows ``P K`` of Eq. 3 / Eq. 5 after ``LN_G``
    (Eq. 7). The attention kernel keeps this tensor for its backward pass, and so does this function, which reads the
    window from it there: built from ``project_rows`` and a cat, the window would be kept twice more, as the product's
    input and inside the cat. Besides, it keeps P (which P's softmax keeps too) and the r rows before ``LN_G``. The
    forward pass runs the operations of ``project_rows``, ``nn.LayerNorm`` and ``torch.cat``, autocast included; the
    backward pass computes the product's gradients in the product's dtype and the LayerNorms' in float32 at least.

    Given ``LN_L``'s gain and bias, the window is the Linear's output and ``LN_L`` is applied here, in float32 at
    least and written in the window's dtype: its backward pass recovers the normalized window ``(y - beta) / gamma``
    from the output (as ``LayerNormInPlace``; every ``|gamma| >= LN_MIN_GAMMA``, ``recoverable_layer_norms``), so the
    Linear's output is not kept.

    window (B, L, H, d), of which the first S*l tokens are projected (causal: the last, unfinished segment is not),
    prefix (B, G, H, d) or None, weights P (B, S, H, r, l), local_weight and local_bias (H*d) or None (the window is
    normalized already, or DualLN is off), norm_weight and norm_bias (H*d) or None (DualLN off), eps (both
    LayerNorms'), copies (of [prefix; rows], ``extra_key_copies``) -> (B, L + copies * (G + S*r), H, d) in the
    window's dtype, the rows segment-major; the copies' gradients add up.
    """

    @staticmethod
    def forward(ctx, window, prefix, weights, local_weight, local_bias, norm_weight, norm_bias, eps, copies=1):
        B, L, H, d = window.shape
        S, r, l = weights.shape[1], weights.shape[3], weights.shape[4]
        local_rstd = None
        if local_weight is not None:
            dtype = torch.promote_types(window.dtype, torch.float32)
            normed, _, local_rstd = torch.native_layer_norm(
                window.reshape(B, L, H * d).to(dtype), (H * d,), local_weight.to(dtype), local_bias.to(dtype), eps
            )
            window = normed.to(window.dtype).view(B, L, H, d)
        rows = projected(weights, segments_heads_first(window[:, : S * l], S))  # (B, S, H, r, d)
        rows = rows.permute(0, 1, 3, 2, 4).reshape(B, S * r, H * d)
        normed = rows if norm_weight is None else F.layer_norm(rows, (H * d,), norm_weight, norm_bias, eps)
        extra = [
            part.to(window.dtype) for part in (*(() if prefix is None else (prefix,)), normed.view(B, S * r, H, d))
        ]
        joined = torch.cat([window, in_copies(torch.cat(extra, 1), copies)], 1)
        ctx.eps, ctx.window_length, ctx.weights_dtype, ctx.copies = eps, L, weights.dtype, copies
        ctx.prefix_dtype = None if prefix is None else prefix.dtype
        ctx.save_for_backward(joined, weights, rows, local_weight, local_bias, local_rstd, norm_weight, norm_bias)
        return joined

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_joined):
        joined, weights, rows, local_weight, local_bias, local_rstd, norm_weight, norm_bias = ctx.saved_tensors
        B, _, H, d = joined.shape
        S, r, l = weights.shape[1], weights.shape[3], weights.shape[4]
        L = ctx.window_length
        grad_extra = grad_joined[:, L:].unflatten(1, (ctx.copies, -1)).sum(1)  # the copies' gradients added
        G = grad_extra.shape[1] - S * r
        grad_rows = grad_extra[:, G:].flatten(2)
        grad_norm_weight = grad_norm_bias = grad_local_weight = grad_local_bias = None
        if norm_weight is not None:
            dtype = torch.promote_types(rows.dtype, torch.float32)
            var, mean = torch.var_mean(rows.to(dtype), -1, correction=0, keepdim=True)
            rstd = (var + ctx.eps).rsqrt()
            x_hat = (rows.to(dtype) - mean) * rstd
            g = grad_rows.to(dtype)
            grad_norm_weight = (g * x_hat).sum((0, 1)).to(norm_weight.dtype)
            grad_norm_bias = None if norm_bias is None else g.sum((0, 1)).to(norm_bias.dtype)
            grad_rows = layer_norm_input_grad(g, x_hat, rstd, norm_weight.to(dtype))
        grad_rows = grad_rows.to(rows.dtype).view(B, S, r, H, d).transpose(2, 3)  # (B, S, H, r, d)
        window = segments_heads_first(joined[:, : S * l], S).to(rows.dtype)  # its projected segments
        grad_weights = (grad_rows @ window.transpose(-1, -2)).to(ctx.weights_dtype)
        grad_projected = (weights.to(rows.dtype).transpose(-1, -2) @ grad_rows).transpose(2, 3).reshape(B, S * l, H, d)
        dtype = torch.promote_types(grad_joined.dtype, rows.dtype)
        if local_weight is not None:
            dtype = torch.promote_types(dtype, torch.float32)
        grad_window = grad_joined[:, :L].to(dtype, copy=True)
        grad_window[:, : S * l] += grad_projected
        if local_weight is not None:  # through LN_L, from its output: x_hat = (y - beta) / gamma
            gamma, beta = local_weight.to(dtype), local_bias.to(dtype)
            g = grad_window.reshape(B, L, H * d)
            x_hat = (joined[:, :L].reshape(B, L, H * d).to(dtype) - beta).div_(gamma)
            grad_local_weight = (g * x_hat).sum((0, 1)).to(local_weight.dtype)
            grad_local_bias = g.sum((0, 1)).to(local_bias.dtype)
            grad_window = layer_norm_input_grad(g, x_hat, local_rstd.to(dtype), gamma).view(B, L, H, d)
        grad_window = grad_window.to(joined.dtype)  # the window's dtype
        grad_prefix = None if ctx.prefix_dtype is None else grad_extra[:, :G].to(ctx.prefix_dtype)
        return (
            grad_window,
            grad_prefix,
            grad_weights,
            grad_local_weight,
            grad_local_bias,
            grad_norm_weight,
            grad_norm_bias,
            None,
            None,
        )

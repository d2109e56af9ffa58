"""The rules of Long-Short attention (Zhu et al., "Long-Short Transformer", NeurIPS 2021) as pure PyTorch functions.

What a query sees, as functions of token positions: the segment-wise sliding window (``window_rule``, Sec. 3.2,
Appendix D) and, causally, the projected rows of finished segments (``segment_rule``, Eq. 5); the dynamic projection
(``project_rows``, Eq. 3); the argument checks that name the offending parameter; and the fused attention call that
every path shares (``masked_sdpa``). The 1-D attention (``long_short_attention``), its kernels
(``long_short_kernels``) and the 2-D attention of ``ls_timm`` all take their rules from here. This file imports
nothing from Transformers or timm.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

try:  # FlexAttention runs on CPU from torch 2.6 (this package needs torch >= 2.11 anyway)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:
    create_block_mask = flex_attention = None

# The implementations of the joint softmax: Transformers' names ("eager" and "sdpa" run the same SDPA code).
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention")
FLEX_ATTENTION_MIN_TORCH = "2.6"
__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "TransposedScores",
    "cached_outside_compile",
    "check_attn_implementation",
    "check_flex_call",
    "create_block_mask",
    "finished_segments",
    "flex_attention",
    "is_int",
    "is_plain_linear",
    "is_plain_tensor",
    "masked_sdpa",
    "project_rows",
    "projected",
    "projection_scores",
    "projection_weights",
    "segment_keep",
    "segment_rule",
    "takes_grad",
    "validate_long_short_args",
    "window_bounds",
    "window_extent",
    "window_keep",
    "window_rule",
]


def check_attn_implementation(attn_implementation: str) -> None:
    """Refuse an unknown ``attn_implementation`` (``ValueError``), or ``"flex_attention"`` on a torch without
    FlexAttention (``ImportError`` naming the minimum version), before any work."""
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got {attn_implementation!r}.")
    if attn_implementation == "flex_attention" and flex_attention is None:
        raise ImportError(
            f'attn_implementation="flex_attention" needs torch.nn.attention.flex_attention (torch >= '
            f'{FLEX_ATTENTION_MIN_TORCH}), which torch {torch.__version__} lacks; upgrade torch or use "sdpa".'
        )


def takes_grad(x: Tensor, weight: Tensor) -> bool:
    """Whether autograd records a module's call on ``x``: gradients enabled, and ``x`` or the module's ``weight``
    requires them."""
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)


def check_flex_call(
    x: Tensor, weight: Tensor, *, training: bool, dropout: float, dropout_name: str, dropout_setting: str
) -> None:
    """Refuse, before any work, what FlexAttention cannot do: attention dropout in training (``dropout``, the
    module's ``dropout_name``, set by ``dropout_setting``), and backward on CPU (``takes_grad(x, weight)``)."""
    if training and dropout > 0:
        raise ValueError(
            f'attn_implementation="flex_attention" has no attention dropout, but {dropout_name} is {dropout} in '
            f'training mode; set it ({dropout_setting}) to 0 or use attn_implementation="sdpa".'
        )
    if takes_grad(x, weight) and x.device.type == "cpu":
        raise NotImplementedError(
            f'attn_implementation="flex_attention" runs forward only on CPU (torch {torch.__version__} has no '
            f'FlexAttention backward there): train with attn_implementation="sdpa", or run inference under '
            f"torch.no_grad() / torch.inference_mode()."
        )


def cached_outside_compile(maxsize: int) -> Callable[[Callable], Callable]:
    """``functools.lru_cache(maxsize)`` for what depends on shapes alone (window layouts, block masks), looked up only
    outside ``torch.compile``: traced, the function runs afresh, so the compiled graph computes it and no cache is read.
    The decorated function keeps ``cache_clear`` and ``cache_info``."""

    def decorate(fn: Callable) -> Callable:
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def lookup(*args, **kwargs):
            return fn(*args, **kwargs) if torch.compiler.is_compiling() else cached(*args, **kwargs)

        lookup.cache_clear, lookup.cache_info = cached.cache_clear, cached.cache_info
        return lookup

    return decorate


def is_plain_tensor(x: Tensor) -> bool:
    """A ``Tensor`` or ``nn.Parameter``, not a subclass (``DTensor``, a tensor subclass of a sharded model)."""
    return type(x) in (Tensor, torch.nn.Parameter)


def is_int(value) -> bool:
    """An int, and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def validate_long_short_args(
    *,
    hidden_size: int,
    num_heads: int,
    window_size: int,
    projection_rank: int,
    causal: bool = False,
    segment_length: int | None = None,
    qk_head_dim: int | None = None,
    attention_dropout: float = 0.0,
    names: dict | None = None,
) -> None:
    """Raise ``ValueError`` naming the offending parameter (``names`` maps ours to the caller's field names)."""
    names = names or {}

    def name(key):
        return names.get(key, key)

    for key, value, low in (
        ("hidden_size", hidden_size, 1),
        ("num_heads", num_heads, 1),
        ("window_size", window_size, 0),
        ("projection_rank", projection_rank, 0),
    ):
        if not is_int(value) or value < low:
            raise ValueError(f"{name(key)} must be an integer >= {low}, got {value!r}.")
    if hidden_size % num_heads:
        raise ValueError(
            f"{name('hidden_size')} ({hidden_size}) must be divisible by {name('num_heads')} ({num_heads}); "
            f"pick a head count that divides it."
        )
    if qk_head_dim is not None and (not is_int(qk_head_dim) or qk_head_dim < 1):
        raise ValueError(f"{name('qk_head_dim')} must be None or an integer >= 1, got {qk_head_dim!r}.")
    if (
        isinstance(attention_dropout, bool)
        or not isinstance(attention_dropout, (int, float))
        or not 0 <= attention_dropout < 1
    ):
        raise ValueError(
            f"{name('attention_dropout')} is a dropout probability, 0 <= p < 1; got {attention_dropout!r}."
        )
    if not causal:
        if segment_length is not None:
            raise ValueError(
                f"{name('segment_length')} (l={segment_length}) only applies to causal attention (Eq. 5); pass "
                f"causal=True or leave it out."
            )
        if window_size == 0 and projection_rank == 0:
            raise ValueError(
                f"{name('window_size')} and {name('projection_rank')} are both 0, so no query sees any key; "
                f"set at least one of them to a positive integer."
            )
        return
    if window_size < 1:
        raise ValueError(
            f"{name('window_size')} must be >= 1 in causal mode (a token must see itself and its recent past), "
            f"got {window_size}."
        )
    if projection_rank > 0:
        if not is_int(segment_length) or segment_length < 1:
            raise ValueError(f"{name('segment_length')} must be an integer >= 1, got {segment_length!r}.")
        if segment_length > window_size:
            raise ValueError(
                f"{name('segment_length')} (l={segment_length}) must be at most {name('window_size')} "
                f"(w={window_size}): the window must cover the tokens of the current segment that are not yet "
                f"projected (paper Appendix D). Lower l or raise w."
            )


def window_extent(window: int) -> int:
    """Keys ``e = max(w // 2, 1)`` that a bidirectional segment of ``w`` queries sees on each side beyond itself (span
    2w for even w, as the official LRA and ImageNet code); 1-D here and per axis in ``ls_timm``."""
    return max(window // 2, 1)


def window_bounds(t, window: int, causal: bool):
    """The window keys ``[lo, hi)`` of the query at position ``t`` (an int or a tensor), with ``s = (t // w) * w``:
    bidirectional ``[s - e, s + w + e)``, ``e = window_extent(w)``; causal ``[s - w, t + 1)`` (Appendix D, Fig. 5).
    Both ends are non-decreasing in ``t``."""
    start = t // window * window
    if causal:
        return start - window, t + 1
    extent = window_extent(window)
    return start - extent, start + window + extent


def window_rule(q, k, window: int, causal: bool):
    """Whether the query at position ``q`` sees the window key at position ``k`` (``window_bounds``), elementwise on
    broadcastable positions (FlexAttention's mask_mod form). Keys outside the sequence are removed by the caller."""
    low, high = window_bounds(q, window, causal)
    return (k >= low) & (k < high)


def window_keep(q_pos: Tensor, k_pos: Tensor, window: int, causal: bool) -> Tensor:
    """``window_rule`` for every query of ``q_pos`` (..., Q) and key of ``k_pos`` (..., K): (..., Q, K)."""
    return window_rule(q_pos.unsqueeze(-1), k_pos.unsqueeze(-2), window, causal)


def finished_segments(t, segment_length: int):
    """Causal Eq. 5: how many segments of ``l`` tokens the query at position ``t`` sees the projected rows of, those
    before its own: ``t // l``."""
    return t // segment_length


def segment_rule(q, row_segment, segment_length: int):
    """Whether the query at position ``q`` sees a projected row of segment ``row_segment``, ``row_segment < q // l``
    (Eq. 5), elementwise on broadcastable tensors."""
    return row_segment < finished_segments(q, segment_length)


def segment_keep(q_pos: Tensor, row_segment: Tensor, segment_length: int) -> Tensor:
    """``segment_rule`` for every query of ``q_pos`` (..., Q) and row of ``row_segment`` (..., R): (..., Q, R)."""
    return segment_rule(q_pos.unsqueeze(-1), row_segment.unsqueeze(-2), segment_length)


def project_rows(scores: Tensor, keys: Tensor, values: Tensor, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Eq. 3, the dynamic projection: ``P = softmax(X W^P)`` over the L tokens (``projection_weights``; tokens where
    ``valid`` is False excluded) and the projected rows ``P K``, ``P V``, multiplied in the dtype of the keys and
    values (in half precision as the official code under autocast: P rounded once, its products on the
    half-precision GEMM, which accumulates in float32).

    scores (..., H, r, L), keys (..., H, L, d_k), values (..., H, L, d_v), valid (..., L) or None
    -> (..., H, r, d_k) and (..., H, r, d_v), in the dtypes of keys and values. A set without a valid token gets
    finite rows (uniform weights), which the caller marks invalid.
    """
    prob = projection_weights(scores, valid)
    return projected(prob, keys), projected(prob, values)


def is_plain_linear(linear: nn.Module) -> bool:
    """Whether calling ``linear`` computes ``F.linear`` of its own weight and bias and nothing else, so that a product
    with them may stand in for the call: an ``nn.Linear`` itself (not a subclass or a wrapper: a LoRA adapter, a
    quantized layer), of plain tensors (not sharded ones), with no forward or backward hook on it or on every module
    (an offloading hook loads the weights in one)."""
    hooks = nn.modules.module
    return (
        type(linear) is nn.Linear
        and all(x is None or is_plain_tensor(x) for x in (linear.weight, linear.bias))
        and not (linear._forward_hooks or linear._forward_pre_hooks or linear._backward_hooks)
        and not (linear._backward_pre_hooks or hooks._global_forward_hooks or hooks._global_forward_pre_hooks)
        and not (hooks._global_backward_hooks or hooks._global_backward_pre_hooks)
    )


def _per_sample(a: Tensor, b: Tensor) -> Tensor:
    """The products ``a[i] @ b[i]`` of two batches, (B, ., .): one GEMM for one sample, else one batched GEMM."""
    return torch.mm(a[0], b[0])[None] if a.shape[0] == 1 else torch.bmm(a, b)


class TransposedScores(torch.autograd.Function):
    """``W X^T`` for each sample of x (B, n, D) and a weight W (R, D): (B, R, n), contiguous, with x's gradient
    ``dS^T W`` laid out as x is, token-major or a channels-first map's transposed view (autograd's product rule gives
    a token-major x's as a transposed view, which the layer before, its LayerNorm for one, would copy), and W's the
    batch's products summed. Differentiable twice, and under ``torch.func``'s transforms."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, weight: Tensor) -> Tensor:
        return _per_sample(weight.expand(x.shape[0], -1, -1), x.transpose(1, 2))

    @staticmethod
    def setup_context(ctx, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:  # in the product's dtype (autocast's, if it ran under autocast), then x's
            weights = weight.to(grad.dtype).expand(x.shape[0], -1, -1)
            if x.transpose(1, 2).is_contiguous():  # a channels-first map's view: the gradient laid out as it
                grad_x = _per_sample(weights.transpose(1, 2), grad).transpose(1, 2)
            else:
                grad_x = _per_sample(grad.transpose(1, 2), weights)
            grad_x = grad_x.to(x.dtype)
        if ctx.needs_input_grad[1]:
            products = _per_sample(grad, x.to(grad.dtype))
            grad_weight = (products[0] if x.shape[0] == 1 else products.sum(0)).to(weight.dtype)
        return grad_x, grad_weight


def projection_scores(projection: nn.Linear, x: Tensor) -> Tensor:
    """The scores ``X W^P`` of Eq. 3 for tokens x (B, n, D), transposed: (B, H r, n), the n scores of each of the
    H r columns contiguous, so that P's softmax over the tokens reads rows, not a strided column (which inductor
    computes with three kernels and a float32 copy). Computed as ``W^P X^T`` (``TransposedScores``), one product per
    sample in one batched product, reading x as it is laid out (a channels-first map's transposed view): the batch's
    scores side by side, (H r, B n), would make the softmax's rows and P's (B, H, r, n) run in different orders, which
    inductor computes in two passes with a float32 copy. The bias is added after the product, where a compiled
    softmax takes it in (``addmm`` with a bias per row, as this one is, first copies it over its whole output on CUDA,
    for its GEMM to read again). A ``projection`` that is not a plain ``nn.Linear`` (``is_plain_linear``) runs its
    own forward, its output transposed after."""
    if not is_plain_linear(projection):
        return projection(x).transpose(-1, -2)
    scores = TransposedScores.apply(x, projection.weight)
    return scores if projection.bias is None else scores + projection.bias[:, None]


def projected(weights: Tensor, x: Tensor) -> Tensor:
    """Eq. 3's product ``P X`` of weights P (..., r, L) and keys or values x (..., L, d), in x's dtype (P rounded
    once to it): (..., r, d)."""
    return weights.to(x.dtype) @ x


def projection_weights(scores: Tensor, valid: Tensor | None, *, in_place: bool = False) -> Tensor:
    """``P`` of Eq. 3: the softmax of ``scores`` (..., H, r, L) over the valid tokens, accumulated in float32 at
    least. Half-precision scores give P in their dtype: torch's softmax kernels accumulate such inputs in float32 and
    round the result once, as a float32 P cast for its half-precision products is, without a float32 copy of the
    scores or of P. ``in_place``: P in float32 at least, built in a single new contiguous tensor (a copy of the
    scores, masked and turned into the softmax in place), which autograd cannot differentiate."""
    if not in_place:
        if valid is not None:
            scores = scores.masked_fill(~valid[..., None, None, :], torch.finfo(scores.dtype).min)
        return scores.softmax(-1)
    dtype = torch.promote_types(scores.dtype, torch.float32)
    prob = scores.to(dtype, memory_format=torch.contiguous_format, copy=True)
    if valid is not None:
        prob.masked_fill_(~valid[..., None, None, :], torch.finfo(dtype).min)
    prob.sub_(prob.amax(-1, keepdim=True)).exp_()
    return prob.div_(prob.sum(-1, keepdim=True))


# On CUDA, torch tries cuDNN's attention first for a masked SDPA on recent GPUs, and cuDNN builds an execution plan
# for every new shape (hundreds of milliseconds each). The shapes here change with every padded length and with every
# decoding step, so the mask goes to the other fused kernels instead (memory-efficient, else the math fallback).
SDPA_BACKENDS_WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def masked_sdpa(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, dropout_p: float = 0.0) -> Tensor:
    """``F.scaled_dot_product_attention`` of q over the keys where ``keep``, never on cuDNN's backend (CUDA only;
    see ``SDPA_BACKENDS_WITHOUT_CUDNN``)."""
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p)
    with sdpa_kernel(SDPA_BACKENDS_WITHOUT_CUDNN):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p)

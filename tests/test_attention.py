"""Long-Short attention core against the dense oracle, the official implementation's outputs, and its invariants.

Everything here is checked, never timed. Shapes are small so the whole file runs in about a minute with ``-n 2``.
"""

import functools
import json
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ls_hf import long_short_kernels, long_short_rules
from ls_hf.long_short_attention import CausalState, LongShortSelfAttention
from tests.devices import assert_close, cpu64, property_examples, test_dtype
from tests.reference import reference_attention

TOL = 1e-5
FIXTURES = Path(__file__).resolve().parent / "fixtures"  # produced by the official code (fixtures/README.md)
PROPERTY = settings(max_examples=property_examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------------------- helpers
def make(
    hidden=8, heads=2, window=3, rank=2, seed=0, device="cpu", dtype=torch.float64, **kwargs
) -> LongShortSelfAttention:
    """A module (float64 unless ``dtype``) in eval mode whose DualLN weights are perturbed (so a misplaced LN cannot
    hide); the same weights on every device."""
    torch.manual_seed(seed)
    module = LongShortSelfAttention(hidden, heads, window, rank, **kwargs).double().eval()
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.startswith("dual_ln"):
                param.add_(0.3 * torch.randn_like(param))
    return module.to(device, dtype)


def make_mask(kind: str, batch: int, n: int, pad: int, seed: int = 0, device="cpu") -> torch.Tensor | None:
    """None, or a (B, n) 0/1 mask: ``right``/``left`` padding of ``pad`` tokens on the last sample, or ``random``."""
    if kind == "none":
        return None
    mask = torch.ones(batch, n)
    pad = min(pad, n)
    if kind == "right":
        mask[-1, n - pad :] = 0
    elif kind == "left":
        mask[-1, :pad] = 0
    else:
        mask = (torch.rand(batch, n, generator=torch.Generator().manual_seed(seed)) > 0.3).double()
    return mask.to(device)


def inputs(module, batch, n, seed=1):
    """Hidden states and a cls embedding on the module's device, in its dtype (drawn in float64 on the CPU)."""
    generator = torch.Generator().manual_seed(seed)
    hidden, like = module.output.in_features, module.output.weight
    x = torch.randn(batch, n, hidden, generator=generator, dtype=torch.float64)
    cls = torch.randn(batch, 1, hidden, generator=generator, dtype=torch.float64)
    return x.to(like), cls.to(like)


def assert_rows_are_distributions(attn, mask):
    """Every real query's probabilities are >= 0 and sum to 1."""
    sums = attn.sum(-1)  # (B, H, n)
    real = torch.ones_like(sums, dtype=torch.bool) if mask is None else mask.bool()[:, None, :].expand_as(sums)
    assert (attn >= 0).all()
    assert_close(sums[real], torch.ones_like(sums[real]), atol=1e-6)


# DualLN over 2 or 3 features is ill-conditioned: its output flips with the sign of a difference between features
# that bfloat16 can round away. Below float64 the drawn key and value widths are therefore 4 or more (or 1: a
# LayerNorm over one feature returns its bias).
MIN_LN_WIDTH = 2 if test_dtype() == torch.float64 else 4


@st.composite
def heads_and_dims(draw):
    heads = draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([d for d in (2, 3, 4) if heads * d >= MIN_LN_WIDTH]))
    # LMSA: qk_head_dim < head_dim
    qk = draw(st.sampled_from([None, *(q for q in range(1, head_dim) if heads * q == 1 or heads * q >= MIN_LN_WIDTH)]))
    return {"hidden": heads * head_dim, "heads": heads, "qk_head_dim": qk, "use_dual_ln": draw(st.booleans())}


masks = st.sampled_from(["none", "right", "left", "random"])
# the bidirectional grid: head layouts, windows, ranks, lengths, batches and padding
bidirectional_grid = {
    "dims": heads_and_dims(),
    "window": st.integers(0, 6),
    "rank": st.integers(0, 3),
    "n": st.integers(1, 20),
    "batch": st.integers(1, 2),
    "mask_kind": masks,
    "pad": st.integers(1, 8),
}


# ------------------------------------------------------------------------------ oracle (bidirectional)
@PROPERTY
@given(**bidirectional_grid, with_cls=st.booleans(), output_attentions=st.booleans(), seed=st.integers(0, 2**16))
def test_bidirectional_matches_oracle(
    dims, window, rank, n, batch, mask_kind, pad, with_cls, output_attentions, seed, device, dtype
):
    if window == rank == 0:
        rank = 1
    with_cls = with_cls and dims["qk_head_dim"] is None  # cls needs qk_head_dim == head_dim
    module = make(window=window, rank=rank, seed=seed, device=device, dtype=dtype, **dims)
    x, cls = inputs(module, batch, n, seed)
    cls = cls if with_cls else None
    mask = make_mask(mask_kind, batch, n, pad, seed, device)
    with torch.no_grad():
        out, attn = module(x, mask, cls_hidden=cls, output_attentions=output_attentions)
        expected = reference_attention(*cpu64(module, x, mask, cls))
    assert_close(out, expected, atol=TOL)
    if output_attentions:
        assert attn.shape[:3] == (batch, dims["heads"], n)
        assert_rows_are_distributions(attn, mask)
    else:
        assert attn is None


# ------------------------------------------------------------------------------------ oracle (causal)
@st.composite
def causal_configs(draw):
    window = draw(st.integers(1, 6))
    rank = draw(st.integers(0, 3))
    segment = draw(st.integers(1, window)) if rank else None
    return {"window": window, "rank": rank, "segment_length": segment, "causal": True, **draw(heads_and_dims())}


@PROPERTY
@given(
    config=causal_configs(),
    n=st.integers(1, 24),
    batch=st.integers(1, 2),
    mask_kind=masks,
    pad=st.integers(1, 8),
    output_attentions=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_causal_matches_oracle(config, n, batch, mask_kind, pad, output_attentions, seed, device, dtype):
    module = make(seed=seed, device=device, dtype=dtype, **config)
    x, _ = inputs(module, batch, n, seed)
    mask = make_mask(mask_kind, batch, n, pad, seed, device)
    with torch.no_grad():
        out, attn = module(x, mask, output_attentions=output_attentions)
        expected = reference_attention(*cpu64(module, x, mask))
    assert_close(out, expected, atol=TOL)
    if output_attentions:
        assert attn.shape[:3] == (batch, config["heads"], n)
        assert_rows_are_distributions(attn, mask)


def _chunks(draw_sizes, n):
    """Split range(n) into consecutive chunks of the drawn sizes (the last one cut to fit)."""
    bounds, start = [], 0
    for size in draw_sizes:
        if start >= n:
            break
        bounds.append((start, min(n, start + size)))
        start += size
    if start < n:
        bounds.append((start, n))
    return bounds


def decode(module, x, mask, bounds, output_attentions=False):
    """Feed x through a ``CausalState`` chunk by chunk; the mask given so far grows, as in ``generate``."""
    state, outs = CausalState(), []
    for start, end in bounds:
        step_mask = None if mask is None else mask[:, :end]
        out, attn = module(x[:, start:end], step_mask, state=state, output_attentions=output_attentions)
        assert state.seen == end
        if output_attentions:
            assert attn.shape[:3] == (x.shape[0], module.num_heads, end - start)
            assert_rows_are_distributions(attn, None if mask is None else mask[:, start:end])
        outs.append(out)
    return torch.cat(outs, 1)


@PROPERTY
@given(
    config=causal_configs(),
    n=st.integers(1, 30),
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=12),
    one_by_one=st.booleans(),
    batch=st.integers(1, 2),
    mask_kind=st.sampled_from(["none", "left", "random"]),
    pad=st.integers(1, 8),
    output_attentions=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_causal_cache_matches_full_forward(
    config, n, sizes, one_by_one, batch, mask_kind, pad, output_attentions, seed, device, dtype
):
    module = make(seed=seed, device=device, dtype=dtype, **config)
    x, _ = inputs(module, batch, n, seed)
    mask = make_mask(mask_kind, batch, n, pad, seed, device)
    bounds = [(t, t + 1) for t in range(n)] if one_by_one else _chunks(sizes, n)
    with torch.no_grad():
        full, _ = module(x, mask)
        chunked = decode(module, x, mask, bounds, output_attentions)
    assert_close(chunked, full, atol=TOL)


def test_decoding_never_runs_cudnn_attention(device, dtype):
    """cuDNN's attention builds an execution plan for every new shape (hundreds of milliseconds on an H100), and a
    decoding step's keys change shape at every token: the masked attention must run on the other fused kernels."""
    if device.type != "cuda":
        pytest.skip("CUDA only: cuDNN's attention is a CUDA backend")
    module = make(hidden=64, heads=2, window=4, rank=2, segment_length=4, causal=True, device=device, dtype=dtype)
    x, _ = inputs(module, 2, 24)
    mask = make_mask("left", 2, 24, 5, device=device)
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        decoded = decode(module, x, mask, [(0, 9)] + [(t, t + 1) for t in range(9, 24)])
        full, _ = module(x, mask)
    assert_close(decoded, full, atol=TOL)
    ops = {event.key for event in prof.key_averages()}
    assert "aten::scaled_dot_product_attention" in ops
    assert not [op for op in ops if "cudnn" in op.lower()], sorted(ops)


def test_causal_state_map_batch_reorders_the_cache():
    """Beam search reorders the cache with ``map_batch``; decoding then continues on the reordered sequences."""
    module = make(window=3, rank=2, segment_length=2, causal=True)
    x, _ = inputs(module, 2, 11)
    with torch.no_grad():
        state = CausalState()
        module(x[:, :5], state=state)
        state.map_batch(lambda t: t.flip(0))
        tail = torch.cat([module(x.flip(0)[:, t : t + 1], state=state)[0] for t in range(5, 11)], 1)
        full, _ = module(x.flip(0))
    torch.testing.assert_close(tail, full[:, 5:], atol=TOL, rtol=0)


# ---------------------------------------------------------------------------- official implementation
def _fixture_cases():
    return sorted(json.loads((FIXTURES / "lra_attention_ls.json").read_text())["cases"])


OFFICIAL_NAMES = {
    "W_q": "query",
    "W_k": "key",
    "W_v": "value",
    "W_o": "output",
    "dconv_fc": "dynamic_projection",
    "dual_ln_l": "dual_ln_local",
    "dual_ln_s": "dual_ln_global",
}


def _official(case):
    """The fixture's tensors and a float64 module holding case ``case``'s official weights."""
    from safetensors.torch import load_file

    meta = json.loads((FIXTURES / "lra_attention_ls.json").read_text())["cases"][case]
    tensors = load_file(FIXTURES / "lra_attention_ls.safetensors")
    config = meta["config"]
    assert config["num_head"] * config["head_dim"] == config["transformer_dim"]
    module = (
        LongShortSelfAttention(
            config["transformer_dim"], config["num_head"], config["window_size"], config["num_landmarks"]
        )
        .double()
        .eval()
    )
    prefix = f"{case}.param."
    state = {}
    for key, value in tensors.items():
        if key.startswith(prefix) and value.numel():
            official, _, leaf = key[len(prefix) :].rpartition(".")
            state[f"{OFFICIAL_NAMES[official]}.{leaf}"] = value
    module.load_state_dict(state, strict=True)
    return tensors, module


@pytest.mark.parametrize("output_attentions", [False, True])
@pytest.mark.parametrize("case", _fixture_cases())
def test_official_lra_outputs(case, output_attentions):
    """``lra/attention_transformer_ls.py`` outputs (seven cases, float64, padding, cls) reproduced after renaming, to
    1e-6: the official code takes its softmaxes in float32 (up to 6e-7 from float64 ones, its fixture notes)."""
    tensors, module = _official(case)
    with torch.no_grad():
        out, _ = module(
            tensors[f"{case}.x"],
            tensors[f"{case}.mask"],
            cls_hidden=tensors.get(f"{case}.cls"),
            output_attentions=output_attentions,
        )
    torch.testing.assert_close(out, tensors[f"{case}.out"], atol=1e-6, rtol=0)


# --------------------------------------------------------------------------------- padding invariance
@PROPERTY
@given(
    window=st.integers(0, 5),
    rank=st.integers(0, 3),
    n=st.integers(1, 14),
    extra=st.integers(1, 9),
    with_cls=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_bidirectional_padding_invariance(window, rank, n, extra, with_cls, seed):
    """Appending padding tokens, or changing what the padded positions hold, leaves the real tokens' outputs."""
    if window == rank == 0:
        window = 1
    module = make(window=window, rank=rank, seed=seed)
    x, cls = inputs(module, 1, n + extra, seed)
    cls = cls if with_cls else None
    mask = torch.cat([torch.ones(1, n), torch.zeros(1, extra)], 1)
    with torch.no_grad():
        short, _ = module(x[:, :n], cls_hidden=cls)
        padded, _ = module(x, mask, cls_hidden=cls)
        changed, _ = module(torch.where(mask.bool()[..., None], x, 100 * torch.randn_like(x)), mask, cls_hidden=cls)
    rows = n + int(with_cls)
    torch.testing.assert_close(padded[:, :rows], short, atol=TOL, rtol=0)
    torch.testing.assert_close(changed, padded, atol=TOL, rtol=0)


@PROPERTY
@given(config=causal_configs(), n=st.integers(1, 16), pad=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_causal_left_padding_invariance(config, n, pad, seed):
    """Any left padding leaves the real tokens' outputs (windows and projection segments count from the first real
    token); left padding is invisible to what its content is; appended padding changes nothing before it."""
    module = make(seed=seed, **config)
    x, _ = inputs(module, 1, pad + n + 3, seed)
    mask = torch.cat([torch.zeros(1, pad), torch.ones(1, n), torch.zeros(1, 3)], 1)
    noise = torch.where(mask.bool()[..., None], x, 100 * torch.randn_like(x))
    with torch.no_grad():
        plain, _ = module(x[:, pad : pad + n])
        padded, _ = module(x, mask)
        changed, _ = module(noise, mask)
    torch.testing.assert_close(padded[:, pad : pad + n], plain, atol=TOL, rtol=0)
    torch.testing.assert_close(changed, padded, atol=TOL, rtol=0)


# ----------------------------------------------------------------------------------------- causality
@PROPERTY
@given(
    config=causal_configs(),
    n=st.integers(2, 24),
    data=st.data(),
    mask_kind=masks,
    pad=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_causal_no_leakage(config, n, data, mask_kind, pad, seed):
    """Perturbing token t changes no output before t (and does change the output at t when t is real)."""
    t = data.draw(st.integers(0, n - 1), label="t")
    module = make(seed=seed, **config)
    x, _ = inputs(module, 2, n, seed)
    mask = make_mask(mask_kind, 2, n, pad, seed)
    y = x.clone()
    y[:, t] += 3 * torch.randn_like(y[:, t])
    with torch.no_grad():
        before, _ = module(x, mask)
        after, _ = module(y, mask)
    torch.testing.assert_close(after[:, :t], before[:, :t], atol=1e-12, rtol=0)
    real_t = torch.ones(2, dtype=torch.bool) if mask is None else mask[:, t].bool()
    assert ((after[:, t] - before[:, t]).abs().amax(-1) > 1e-9)[real_t].all()


# ----------------------------------------------------------------------------------------- gradients
GRAD_CASES = {  # name: (module kwargs, with cls)
    "bidirectional": ({"window": 3, "rank": 2}, False),
    "bidirectional-cls": ({"window": 2, "rank": 1}, True),
    "bidirectional-lmsa": ({"window": 2, "rank": 2, "qk_head_dim": 3}, False),
    "causal": ({"window": 3, "rank": 2, "segment_length": 2, "causal": True}, False),
    "causal-lmsa": ({"window": 2, "rank": 1, "segment_length": 1, "causal": True, "qk_head_dim": 3}, False),
}


@pytest.mark.parametrize("name", sorted(GRAD_CASES))
def test_gradcheck(name):
    kwargs, with_cls = GRAD_CASES[name]
    module = make(**kwargs)
    x, cls = inputs(module, 2, 7)
    mask = make_mask("right", 2, 7, 2)
    cls = cls.requires_grad_() if with_cls else None
    x.requires_grad_()

    def fn(x, *cls):
        return module(x, mask, cls_hidden=cls[0] if cls else None)[0]

    assert torch.autograd.gradcheck(fn, (x,) if cls is None else (x, cls), fast_mode=True)


@pytest.mark.parametrize("name", sorted(GRAD_CASES))
def test_output_attentions_path_keeps_float64(name):
    """Asking for the probabilities must not lower the precision: in float64 both code paths agree to 1e-12."""
    kwargs, with_cls = GRAD_CASES[name]
    module = make(**kwargs)
    x, cls = inputs(module, 2, 9)
    cls = cls if with_cls else None
    with torch.no_grad():
        fast, _ = module(x, cls_hidden=cls)
        weighted, attn = module(x, cls_hidden=cls, output_attentions=True)
    assert attn.dtype == torch.float64
    torch.testing.assert_close(weighted, fast, atol=1e-12, rtol=0)


@pytest.mark.parametrize("output_attentions", [False, True])
@pytest.mark.parametrize("name", sorted(GRAD_CASES))
def test_parameter_gradients_match_oracle(name, output_attentions):
    """Backward through either code path equals backward through the dense oracle for every parameter."""
    kwargs, with_cls = GRAD_CASES[name]
    module = make(**kwargs)
    x, cls = inputs(module, 2, 9)
    mask = make_mask("left", 2, 9, 3)
    cls = cls if with_cls else None
    weights = torch.randn(2, 9 + (cls is not None), module.output.out_features, dtype=torch.float64)
    grads = []
    for forward in (
        lambda: module(x, mask, cls_hidden=cls, output_attentions=output_attentions)[0],
        lambda: reference_attention(module, x, mask, cls),
    ):
        module.zero_grad()
        (forward() * weights).sum().backward()
        grads.append({k: p.grad.clone() for k, p in module.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for key in grads[0]:
        torch.testing.assert_close(grads[0][key], grads[1][key], atol=TOL, rtol=0, msg=key)


# ------------------------------------------------------------ memory-lean path ("lean") against "sdpa"
def _graph_names(tensor):
    """The names of the autograd nodes behind ``tensor``."""
    names, stack, seen = set(), [tensor.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(node.name())
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def assert_lean_matches_default(module, x, cls=None, **kwargs):
    """The memory-lean path (``recompute_window_tiles``: tiles built chunk by chunk, one group per chunk here, and
    again in the backward pass) against the default (every tile gathered at once, plain autograd): outputs and the
    gradients of the input, the cls token and every parameter agree in float64 to rounding."""
    weights = None
    results = []
    for recompute in (True, False):
        module.recompute_window_tiles = recompute
        module.zero_grad()
        inputs = [t.clone().requires_grad_() for t in (x, cls) if t is not None]
        with patch.object(long_short_kernels, "TILE_CHUNK_BYTES", 1):
            out, _ = module(inputs[0], cls_hidden=inputs[1] if cls is not None else None, **kwargs)
        tiled = "TiledAttentionBackward" in _graph_names(out)
        assert tiled == (recompute and module.qk_head_dim == module.head_dim)
        weights = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(5))
        (out * weights).sum().backward()
        grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
        results.append((out.detach(), [t.grad for t in inputs], grads))
    (out, inputs, grads), (out_e, inputs_e, grads_e) = results
    torch.testing.assert_close(out, out_e, atol=1e-12, rtol=0)
    for grad, grad_e in zip(inputs, inputs_e):
        torch.testing.assert_close(grad, grad_e, atol=1e-12, rtol=1e-10)
    assert grads.keys() == grads_e.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_e[name], atol=1e-12, rtol=1e-10, msg=name)


@PROPERTY
@given(**bidirectional_grid, extra=st.sampled_from(["none", "cls", "global"]), seed=st.integers(0, 2**16))
def test_lean_path_gradients_match_default_bidirectional(dims, window, rank, n, batch, mask_kind, pad, extra, seed):
    if window == rank == 0:
        rank = 1
    if extra == "cls" and dims["qk_head_dim"] is not None:
        extra = "none"
    module = make(window=window, rank=rank, seed=seed, **dims)
    x, cls = inputs(module, batch, n, seed)
    mask = make_mask(mask_kind, batch, n, pad, seed)
    glob = global_mask(batch, n, 0.3, seed) if extra == "global" else None
    assert_lean_matches_default(
        module, x, cls if extra == "cls" else None, attention_mask=mask, global_attention_mask=glob
    )


@PROPERTY
@given(
    config=causal_configs(),
    n=st.integers(1, 24),
    batch=st.integers(1, 2),
    mask_kind=masks,
    pad=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_lean_path_gradients_match_default_causal(config, n, batch, mask_kind, pad, seed):
    module = make(seed=seed, **config)
    x, _ = inputs(module, batch, n, seed)
    assert_lean_matches_default(module, x, attention_mask=make_mask(mask_kind, batch, n, pad, seed))


def tiny_mlm(*, recompute_window_tiles: bool, num_hidden_layers: int = 2):
    """A float64 masked LM in training mode (16 wide, w = 4, r = 2, no dropout), the same weights for both settings of
    ``recompute_window_tiles``; and token ids (2, 23)."""
    from ls_hf import LongShortConfig, LongShortForMaskedLM

    config = LongShortConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=2,
        intermediate_size=32,
        window_size=4,
        projection_rank=2,
        max_position_embeddings=40,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        recompute_window_tiles=recompute_window_tiles,
    )
    torch.manual_seed(0)
    ids = torch.randint(3, 40, (2, 23), generator=torch.Generator().manual_seed(0))
    return LongShortForMaskedLM(config).double().train(), ids


def assert_same_loss_and_gradients(got: tuple, expected: tuple) -> None:
    """``(loss, {name: gradient})`` pairs equal in float64."""
    (loss, grads), (loss_expected, grads_expected) = got, expected
    torch.testing.assert_close(loss, loss_expected, atol=1e-12, rtol=0)
    for name in grads_expected:
        torch.testing.assert_close(grads[name], grads_expected[name], atol=1e-12, rtol=1e-10, msg=name)


def loss_and_gradients(model, loss) -> tuple:
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def test_config_recompute_window_tiles_reaches_every_layer():
    """``LongShortConfig(recompute_window_tiles=True)`` trains through ``TiledAttention`` in every layer, with the
    default model's loss and gradients (float64)."""
    results = []
    for recompute in (True, False):
        model, ids = tiny_mlm(recompute_window_tiles=recompute)
        assert all(layer.attention.self.recompute_window_tiles == recompute for layer in model.long_short.encoder.layer)
        loss = model(input_ids=ids, labels=ids).loss
        assert ("TiledAttentionBackward" in _graph_names(loss)) == recompute
        results.append(loss_and_gradients(model, loss))
    assert_same_loss_and_gradients(*results)


def test_layer_norm_gains_are_read_once_a_forward_pass_for_every_layer():
    """The plan finds the ``LN_L`` layers whose input their output recovers (``recoverable_layer_norms``: every
    ``|gamma| >= LN_MIN_GAMMA``) in one read of the device for all layers of a forward pass, where a path writes
    ``LN_L`` over its input (the lean path: training on the CPU with ``recompute_window_tiles``). A layer whose gain
    is too small keeps ``LN_L``'s input (plain ``LayerNorm``), the others write over it; without gradients nothing
    is read. The loss and gradients are the default model's either way (float64)."""
    from ls_hf import long_short_plan

    results = []
    for recompute in (True, False):
        model, ids = tiny_mlm(recompute_window_tiles=recompute, num_hidden_layers=3)
        norms = [layer.attention.self.dual_ln_local for layer in model.long_short.encoder.layer]
        with torch.no_grad():
            norms[1].weight[3] = 1e-4
        counted = patch.object(
            long_short_plan, "recoverable_layer_norms", wraps=long_short_kernels.recoverable_layer_norms
        )
        in_place = patch.object(
            long_short_kernels.LayerNormInPlace, "apply", wraps=long_short_kernels.LayerNormInPlace.apply
        )
        with counted as reads, in_place as writes:
            loss = model(input_ids=ids, labels=ids).loss
        if recompute:
            assert reads.call_count == 1 and set(reads.call_args.args[0]) == set(norms)
            assert writes.call_count == 2 * 2  # keys and values of layers 0 and 2
        else:
            assert reads.call_count == 0 and writes.call_count == 0
        results.append(loss_and_gradients(model, loss))
        with counted as reads, torch.no_grad():
            model(input_ids=ids)
        assert reads.call_count == 0
    assert_same_loss_and_gradients(*results)
    assert long_short_kernels.recoverable_layer_norms(norms) == frozenset([norms[0], norms[2]])


@pytest.mark.parametrize("chunk_bytes", [1, 2**20])
def test_layer_norm_in_place_matches_layer_norm(chunk_bytes):
    """``LN_L`` written over its input and saving its output: the output and the gradients of the input, gain and
    bias are ``nn.LayerNorm``'s (float64), in row chunks or in one, and the output is the input's own storage; a
    non-contiguous input falls back to ``nn.LayerNorm`` itself (a gain below ``LN_MIN_GAMMA`` never comes here: the
    plan keeps such a layer's ``LN_L`` plain)."""
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(12).double()
    with torch.no_grad():
        norm.weight.add_(0.5 * torch.randn(12))
        norm.bias.add_(torch.randn(12))
    x = torch.randn(3, 5, 12, dtype=torch.float64)
    weights = torch.randn(3, 5, 12, dtype=torch.float64)
    for fallback in (None, "strided"):
        results = []
        for in_place in (True, False):
            norm.zero_grad()
            inp = x.clone().requires_grad_()
            fresh = inp * 1.0 if fallback != "strided" else (inp * 1.0).transpose(0, 1)  # a tensor nothing else needs
            with patch.object(long_short_kernels, "TILE_CHUNK_BYTES", chunk_bytes):
                out = long_short_kernels.layer_norm_in_place(fresh, norm) if in_place else norm(fresh)
                (out * (weights if fallback != "strided" else weights.transpose(0, 1))).sum().backward()
            results.append(
                (
                    out.detach(),
                    inp.grad,
                    norm.weight.grad.clone(),
                    norm.bias.grad.clone(),
                    _graph_names(out),
                    out.data_ptr() == fresh.data_ptr(),
                )
            )
        (*lean, names, same_storage), (*plain, _, _) = results
        assert ("LayerNormInPlaceBackward" in names) == same_storage == (fallback is None)
        for got, expected in zip(lean, plain):
            torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("valid_kind", ["none", "partial", "empty_set"])
@pytest.mark.parametrize("bias", [True, False])
def test_dynamic_projection_matches_autograd(valid_kind, bias):
    """``DynamicProjection`` (the scores computed a chunk of heads at a time, one head per chunk here, and again in
    the backward pass): rows and the gradients of the input, W^P, b, keys and values are those of plain autograd
    through ``F.linear`` and ``project_rows`` (float64), excluded tokens and a set with no valid token included."""
    generator = torch.Generator().manual_seed(0)
    heads, rank, length, width = 3, 4, 7, 8
    hidden = torch.randn(2, 2, length, width, dtype=torch.float64, generator=generator)
    weight = torch.randn(heads * rank, width, dtype=torch.float64, generator=generator)
    keys, values = (torch.randn(2, 2, heads, length, d, dtype=torch.float64, generator=generator) for d in (5, 6))
    params = [
        hidden,
        weight,
        torch.randn(heads * rank, dtype=torch.float64, generator=generator) if bias else None,
        keys,
        values,
    ]
    valid = None if valid_kind == "none" else torch.rand(2, 2, length, generator=generator) > 0.4
    if valid_kind == "empty_set":
        valid[1, 1] = False
    weights = [torch.randn(2, 2, heads, rank, d, dtype=torch.float64, generator=generator) for d in (5, 6)]
    results = []
    for chunked in (True, False):
        tensors = [t if t is None else t.clone().requires_grad_() for t in params]
        if chunked:
            with patch.object(long_short_kernels, "TILE_CHUNK_BYTES", 1):
                rows = long_short_kernels.DynamicProjection.apply(*tensors, valid)
        else:
            scores = F.linear(*tensors[:3]).unflatten(-1, (heads, rank)).movedim(-3, -1)
            rows = long_short_rules.project_rows(scores, *tensors[3:], valid)
        sum((row * weight).sum() for row, weight in zip(rows, weights)).backward()
        results.append([*(row.detach() for row in rows), *(t.grad for t in tensors if t is not None)])
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)


PROJECTION_CASES = {  # (W^P, batch, x laid out channels-first, compiled)
    "plain": ("plain", 3, False, False),
    "no bias": ("no_bias", 3, False, False),
    "one sample": ("plain", 1, False, False),
    "channels-first": ("plain", 3, True, False),
    "compiled": ("plain", 3, False, True),
    "forward hook": ("forward_hook", 3, False, False),
    "backward hook": ("backward_hook", 3, False, False),
    "subclass": ("subclass", 3, False, False),
}


@pytest.mark.parametrize("case", PROJECTION_CASES.values(), ids=PROJECTION_CASES)
def test_projection_scores_are_the_linears_output_transposed(case):
    """``projection_scores`` gives ``W^P``'s output transposed, (B, H r, n), and its gradients, n contiguous for a
    plain Linear: eagerly or compiled (dynamo's eager backend), for one sample or several, token-major or a
    channels-first map's transposed view; a Linear with a hook or of a subclass runs its own forward (a forward hook's
    change of the output shows in the scores, a backward hook's in the input's gradient)."""
    kind, batch, channels_first, compiled = case
    generator = torch.Generator().manual_seed(0)
    projection = torch.nn.Linear(8, 6, bias=kind != "no_bias", dtype=torch.float64)
    if kind == "forward_hook":
        projection.register_forward_hook(lambda module, args, out: 2 * out)
    if kind == "backward_hook":  # doubles the gradient reaching the input
        projection.register_full_backward_hook(lambda module, grad_input, grad_output: (2 * grad_input[0],))
    if kind == "subclass":
        projection.__class__ = type(
            "DoubledLinear", (torch.nn.Linear,), {"forward": lambda self, x: 2 * F.linear(x, self.weight, self.bias)}
        )
    hidden = torch.randn(batch, 5, 8, dtype=torch.float64, generator=generator)
    grad = torch.randn(batch, 6, 5, dtype=torch.float64, generator=generator)
    scores_of = long_short_rules.projection_scores
    if compiled:
        torch._dynamo.reset()
        scores_of = torch.compile(scores_of, backend="eager", fullgraph=True)
    results = []
    for transposed in (True, False):
        x = hidden.transpose(1, 2).contiguous().transpose(1, 2) if channels_first else hidden.clone()
        x.requires_grad_()
        projection.zero_grad()
        incoming = []  # the gradient reaching x, before autograd lays it out as the leaf x
        x.register_hook(lambda grad, seen=incoming: seen.append(grad.stride()))
        if transposed:
            scores = scores_of(projection, x)
        else:
            scale = 2 if kind in ("forward_hook", "subclass") else 1
            scores = scale * F.linear(x, projection.weight, projection.bias).transpose(-1, -2)
        scores.backward(grad)
        x_grad = 2 * x.grad if kind == "backward_hook" and not transposed else x.grad
        results.append([scores.detach(), x_grad, *(p.grad.clone() for p in projection.parameters())])
        if transposed:
            assert scores.shape == (batch, 6, 5) and (scores.stride(-1) == 1) == (kind in ("plain", "no_bias"))
            if kind in ("plain", "no_bias"):  # laid out as x is (a layer's input, or a channels-first map's view)
                assert incoming == [x.stride()]
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)


def test_transposed_scores_differentiate_twice_and_under_vmap():
    """``TransposedScores``' gradients, and their own gradients, against finite differences (float64); under
    ``torch.func.vmap`` with its gradient (``torch.func.grad``), the per-example results of a loop."""
    scores_of = long_short_rules.TransposedScores.apply
    generator = torch.Generator().manual_seed(0)
    x, weight = (torch.randn(*shape, dtype=torch.float64, generator=generator) for shape in ((2, 5, 4), (3, 4)))
    inputs = (x.requires_grad_(), weight.requires_grad_())
    assert torch.autograd.gradcheck(scores_of, inputs)
    assert torch.autograd.gradgradcheck(scores_of, inputs)
    examples = torch.randn(3, 2, 5, 4, dtype=torch.float64, generator=generator)

    def loss(x, weight):
        return scores_of(x, weight).square().sum()

    mapped = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(0, None))(examples, weight.detach())
    looped = [torch.func.grad(loss, argnums=(0, 1))(example, weight.detach()) for example in examples]
    for got, expected in zip(mapped, zip(*looped)):
        torch.testing.assert_close(got, torch.stack(expected), atol=1e-12, rtol=1e-10)


def _joined_by_composition(window, prefix, weights, local_weight, local_bias, norm_weight, norm_bias, eps, copies=1):
    """[window; prefix; LN_G(P window)] as ``project_rows``, ``nn.LayerNorm`` and a cat build it, [prefix; rows]
    ``copies`` times; given LN_L's gain and bias, the window is normalized first."""
    B, L, H, d = window.shape
    S, r, l = weights.shape[1], weights.shape[3], weights.shape[4]
    if local_weight is not None:
        window = F.layer_norm(window.flatten(2), (H * d,), local_weight, local_bias, eps).view(B, L, H, d)
    rows = weights.to(window.dtype) @ long_short_kernels.segments_heads_first(window[:, : S * l], S)
    rows = rows.permute(0, 1, 3, 2, 4).reshape(B, S * r, H * d)
    if norm_weight is not None:
        rows = F.layer_norm(rows, (H * d,), norm_weight, norm_bias, eps)
    return torch.cat([window, *[*(() if prefix is None else (prefix,)), rows.view(B, S * r, H, d)] * copies], 1)


def _joined_inputs(norms: str, prefix: bool, segments: int, unfinished: int = 0, dtype=torch.float64):
    """window (2, S*5 + unfinished, 3, 4) (causal: an unfinished segment is not projected), prefix (2, 2, 3, 4),
    P (2, S, 3, 2, 5) from scores with one excluded token, LN_L's gain and bias (``norms="both"``; the window is then
    the Linear's output) and LN_G's (``"both"`` or ``"global"``; ``"none"``: DualLN off), all leaves that take
    gradients."""
    generator = torch.Generator().manual_seed(0)
    B, H, d, r, l = 2, 3, 4, 2, 5

    def draw(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=generator).to(dtype).requires_grad_()

    valid = torch.ones(B, segments, l, dtype=torch.bool)
    valid[1, 0, 2] = False
    scores = draw(B, segments, H, r, l)
    weights = long_short_rules.projection_weights(scores, valid)
    local_args = (draw(H * d), draw(H * d)) if norms == "both" else (None, None)
    norm_args = (None, None, 0.0) if norms == "none" else (draw(H * d), draw(H * d), 1e-5)
    window, before = draw(B, segments * l + unfinished, H, d), draw(B, 2, H, d) if prefix else None
    return [window, before, weights, *local_args, *norm_args], scores


def _joined_leaves(tensors, scores):
    """The leaves of ``_joined_inputs`` that take gradients: window, prefix, scores and the LayerNorms' parameters."""
    return [t for t in (tensors[0], tensors[1], scores, *tensors[3:7]) if t is not None]


@pytest.mark.parametrize("copies", [1, 3], ids=["one_copy", "copies"])
@pytest.mark.parametrize("segments, unfinished", [(1, 0), (2, 0), (2, 3)], ids=["one", "segments", "unfinished"])
@pytest.mark.parametrize("prefix", [False, True], ids=["rows", "prefix"])
@pytest.mark.parametrize("norms", ["both", "global", "none"], ids=["ln_l_and_ln_g", "ln_g", "no_dual_ln"])
def test_joined_projected_keys_match_autograd(segments, unfinished, prefix, norms, copies):
    """``JoinedProjectedKeys`` ([LN_L(window); prefix; LN_G(P LN_L(window))], Eq. 3 / Eq. 5 and Eq. 7, keeping the
    window only in its output): the output and the gradients of the window, the prefix, the scores behind P and the
    LayerNorms' gains and biases are those of plain autograd through ``F.layer_norm``, ``project_rows``'s product and
    a cat (float64); with LN_L applied there (its backward pass recovering the normalized window from the output) or
    before; one segment, two, and two followed by an unfinished one (causal); [prefix; rows] once or in 3 copies
    (``extra_key_copies``), whose gradients add up."""
    results = []
    for joined_fn in (long_short_kernels.JoinedProjectedKeys.apply, _joined_by_composition):
        tensors, scores = _joined_inputs(norms, prefix, segments, unfinished)
        out = joined_fn(*tensors, copies)
        upstream = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
        out.backward(upstream)
        results.append([out.detach(), *(t.grad for t in _joined_leaves(tensors, scores))])
    assert len(results[0]) == 3 + prefix + {"both": 4, "global": 2, "none": 0}[norms]
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)


def test_joined_projected_keys_under_autocast():
    """Under bfloat16 autocast (float32 leaves) ``JoinedProjectedKeys`` runs the same forward operations as the
    composition, so its output is the same; its gradients are the composition's within bfloat16 rounding. Given
    LN_L too and the window in bfloat16 (as a Linear's output under autocast), its output is LN_L's in float32 rounded
    to bfloat16 once, the dtype the attention kernel takes, where the composition's is float32."""
    eps = torch.finfo(torch.bfloat16).eps
    for norms in ("global", "both"):
        results = []
        for joined_fn in (long_short_kernels.JoinedProjectedKeys.apply, _joined_by_composition):
            tensors, scores = _joined_inputs(norms, prefix=True, segments=2, unfinished=3, dtype=torch.float32)
            if norms == "both":
                tensors[0] = tensors[0].detach().bfloat16().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = joined_fn(*tensors)
            out.float().square().sum().backward()
            results.append([out.detach(), *(t.grad for t in _joined_leaves(tensors, scores))])
        (joined, *grads), (expected_joined, *expected_grads) = results
        if norms == "global":
            torch.testing.assert_close(joined, expected_joined, atol=0, rtol=0)
        else:
            assert joined.dtype == torch.bfloat16
            torch.testing.assert_close(joined, expected_joined.bfloat16(), atol=0, rtol=0)
        for got, expected in zip(grads, expected_grads):
            assert got.dtype == expected.dtype
            torch.testing.assert_close(got, expected, rtol=0, atol=8 * eps * float(expected.abs().max()))


@pytest.mark.slow
@pytest.mark.compiled
def test_joined_projected_keys_compile():
    """``JoinedProjectedKeys`` traces whole under ``torch.compile`` (``fullgraph=True``: forward and backward), as the
    compiled attention layer takes it on CUDA, and gives what it gives uncompiled."""
    torch._dynamo.reset()
    results = []
    for joined_fn in (_joined_twice, torch.compile(_joined_twice, fullgraph=True)):
        tensors, scores = _joined_inputs("both", prefix=True, segments=2)
        out = joined_fn(*tensors)
        out.square().sum().backward()
        results.append([out.detach(), *(t.grad for t in _joined_leaves(tensors, scores))])
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)


def _joined_twice(*tensors):
    """``JoinedProjectedKeys`` inside a larger function."""
    return long_short_kernels.JoinedProjectedKeys.apply(*tensors) * 2


def test_joined_projected_keys_keep_the_window_once():
    """``JoinedProjectedKeys`` keeps its output (which the attention kernel keeps anyway), P and the rows before
    LN_G, and no other tensor of the window's size, LN_L's input included when it applies LN_L; the composition keeps
    a copy of the window for its product, and LN_L's input."""
    kept = {}
    for name, joined_fn in (
        ("joined", long_short_kernels.JoinedProjectedKeys.apply),
        ("composition", _joined_by_composition),
    ):
        for norms in ("global", "both"):
            tensors, _ = _joined_inputs(norms, prefix=True, segments=1)
            window = tensors[0] * 1  # a tensor of its own, as a Linear's or LN_L's output is
            saved, out = _saved_storages(functools.partial(joined_fn, window, *tensors[1:]))
            output = out.untyped_storage().data_ptr()
            kept[name, norms] = sorted(size for ptr, size in saved.items() if ptr != output and size >= window.numel())
    size = window.numel()
    assert kept == {
        ("joined", "global"): [],
        ("joined", "both"): [],
        ("composition", "global"): [size],
        ("composition", "both"): [size, size],
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_projection_weights_round_once(dtype):
    """Eq. 3's P from half-precision scores comes in their dtype (no float32 copy of the scores or of P) and equals
    the float64 softmax rounded once to that dtype, within one rounding, excluded tokens and a set with no valid token
    included; its gradient is the float64 one's within half-precision rounding."""
    generator = torch.Generator().manual_seed(0)
    scores64 = 6 * torch.randn(2, 3, 4, 300, dtype=torch.float64, generator=generator)
    valid = torch.rand(2, 300, generator=generator) > 0.3
    valid[1] = False
    scores = scores64.to(dtype).requires_grad_()
    prob = long_short_rules.projection_weights(scores, valid)
    assert prob.dtype == dtype
    scores_exact = scores.detach().double().requires_grad_()  # the same rounded scores, in float64
    reference = long_short_rules.projection_weights(scores_exact, valid)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(prob.double(), reference, rtol=eps, atol=torch.finfo(dtype).tiny)
    upstream = torch.randn(prob.shape, dtype=torch.float64, generator=generator)
    prob.backward(upstream.to(dtype))
    reference.backward(upstream)
    expected = scores_exact.grad
    torch.testing.assert_close(scores.grad.double(), expected, rtol=0, atol=8 * eps * float(expected.abs().max()))


def _saved_storages(fn) -> tuple[dict[int, int], object]:
    """The distinct storages (data pointer -> elements) that autograd saves for the backward pass while ``fn()`` runs,
    and what it returns."""
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes() // tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = fn()
    return saved, result


def test_recompute_window_tiles_saves_each_token_tensor_once():
    """With ``recompute_window_tiles`` autograd keeps per token what dense fused attention keeps, the input, the
    query, the keys, the values and the attention output (``LN_L``'s output stands for the keys and values; its
    input is not kept; the projection's scores and weights P are built again in the backward pass): no window tile,
    nothing larger than (n, d). The default path keeps more."""
    batch, n, hidden, heads, rank = 1, 64, 16, 2, 3
    module = make(hidden=hidden, heads=heads, window=8, rank=rank).train()
    x, _ = inputs(module, batch, n)
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    token_tensors = {}
    for recompute in (True, False):
        module.recompute_window_tiles = recompute
        saved, _ = _saved_storages(lambda: module(x.clone().requires_grad_()))
        sizes = sorted(size for ptr, size in saved.items() if ptr not in params and size >= n * heads * rank)
        token_tensors[recompute] = sizes
    assert token_tensors[True] == [batch * n * hidden] * 5
    assert sum(token_tensors[False]) > sum(token_tensors[True]) + 2 * batch * n * hidden


# ---------------------------------------------------------------------------------- numerical safety
@pytest.mark.parametrize("causal", [False, True])
def test_bf16_autocast_and_fully_padded_rows_are_finite(causal):
    """bf16 autocast forward + backward, with a fully padded sample and padded rows, produces no NaN/inf."""
    torch.manual_seed(0)
    kwargs = {"causal": True, "segment_length": 4} if causal else {}
    module = LongShortSelfAttention(32, 4, 8, 4, **kwargs)
    x = torch.randn(3, 37, 32, requires_grad=True)
    mask = torch.ones(3, 37)
    mask[1, :20] = 0  # left padding
    mask[2] = 0  # a fully padded sequence
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = module(x, mask)
    out.float().square().sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in module.parameters() if p.grad is not None)


@pytest.mark.parametrize("output_attentions", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_fully_padded_sequence_gives_output_bias(causal, output_attentions):
    kwargs = {"causal": True, "segment_length": 2} if causal else {}
    module = make(window=4, rank=2, **kwargs)
    x, _ = inputs(module, 2, 10)
    mask = torch.zeros(2, 10)
    x.requires_grad_()
    out, attn = module(x, mask, output_attentions=output_attentions)
    out.sum().backward()
    torch.testing.assert_close(out, module.output.bias.expand_as(out), atol=1e-12, rtol=0)
    assert torch.isfinite(x.grad).all() and (attn is None or torch.isfinite(attn).all())


# ------------------------------------------------------------------------------------ output_attentions
def test_output_attentions_layout_bidirectional():
    """(B, H, n, R + S): cls first, then the r projected rows, then w + 2e window keys (w even: 2w)."""
    module = make(hidden=12, heads=3, window=4, rank=2)
    x, cls = inputs(module, 2, 13)
    _, attn = module(x, cls_hidden=cls, output_attentions=True)
    assert attn.shape == (2, 3, 13, 1 + 2 + 8)
    assert_rows_are_distributions(attn, None)
    # The query at position 0 (segment 0) sees window keys [-2, 6): the first two window columns are outside.
    assert (attn[:, :, 0, 3:5] == 0).all() and (attn[:, :, 0, 5:] > 0).all()


def test_output_attentions_layout_short_sequence():
    """The documented layout (S = w + 2e window columns, bidirectional) also holds when n < w."""
    module = make(hidden=8, heads=2, window=4, rank=2)
    x, _ = inputs(module, 1, 3)
    _, attn = module(x, output_attentions=True)
    assert attn.shape == (1, 2, 3, 2 + 8)


def test_output_attentions_layout_causal():
    """Full causal forward: R = r * (n // l) rows of finished segments, then 2w window keys."""
    module = make(hidden=8, heads=2, window=4, rank=2, segment_length=2, causal=True)
    x, _ = inputs(module, 1, 12)
    _, attn = module(x, output_attentions=True)
    assert attn.shape == (1, 2, 12, 2 * (12 // 2) + 8)
    assert_rows_are_distributions(attn, None)
    # Query 0 sees no projected row (no finished segment) and only itself in the window.
    assert attn[0, :, 0, :12].eq(0).all() and attn[0, :, 0].count_nonzero(-1).eq(1).all()


# -------------------------------------------------------------------------------------- configuration
BAD_CONFIGS = [
    ({"window_size": -1}, "window_size"),
    ({"window_size": 2.5}, "window_size"),
    ({"window_size": True}, "window_size"),
    ({"projection_rank": -2}, "projection_rank"),
    ({"projection_rank": 1.0}, "projection_rank"),
    ({"window_size": 0, "projection_rank": 0}, "window_size"),
    ({"hidden_size": 10, "num_heads": 3}, "num_heads"),
    ({"num_heads": 0}, "num_heads"),
    ({"qk_head_dim": 0}, "qk_head_dim"),
    ({"causal": True, "window_size": 0, "segment_length": 1}, "window_size"),
    ({"causal": True, "segment_length": 5}, "segment_length"),
    ({"causal": True, "segment_length": 0}, "segment_length"),
    ({"causal": True, "segment_length": None}, "segment_length"),
    ({"causal": True, "segment_length": 2.0}, "segment_length"),
]


@pytest.mark.parametrize("change, name", BAD_CONFIGS, ids=[f"{n}-{i}" for i, (_, n) in enumerate(BAD_CONFIGS)])
def test_bad_configuration_names_the_parameter(change, name):
    kwargs = {"hidden_size": 8, "num_heads": 2, "window_size": 4, "projection_rank": 2} | change
    with pytest.raises(ValueError, match=name):
        LongShortSelfAttention(**kwargs)


def test_misuse_of_forward_raises():
    causal = make(window=2, rank=1, segment_length=1, causal=True)
    bidirectional = make(window=2, rank=1)
    x, cls = inputs(causal, 1, 4)
    with pytest.raises(ValueError, match="cls_hidden"):
        causal(x, cls_hidden=cls)
    with pytest.raises(ValueError, match="state"):
        bidirectional(x, state=CausalState())


@pytest.mark.parametrize(
    "shape,mask_shape,match",
    [
        ((2, 9, 10), None, r"hidden_states must be \(batch, tokens, 16\), got \(2, 9, 10\)"),
        ((9, 16), None, r"hidden_states must be \(batch, tokens, 16\), got \(9, 16\).*x\[None\]"),
        ((2, 9, 16), (2, 8), r"attention_mask must be \(batch, tokens\) = \(2, 9\).*got \(2, 8\)"),
        ((2, 9, 16), (9,), r"attention_mask must be \(batch, tokens\) = \(2, 9\).*got \(9,\)"),
        ((2, 9, 16), (2, 12), r"= \(2, 9\).*got \(2, 12\): a mask of 12 tokens for 9 tokens of hidden_states"),
    ],
)
def test_wrong_inputs_are_refused_clearly(shape, mask_shape, match):
    """A mask shorter or longer than the input (a longer one was read from its last entries) is refused, naming both
    lengths, before any work."""
    attn = LongShortSelfAttention(16, 2, window_size=4, projection_rank=2)
    mask = None if mask_shape is None else torch.ones(mask_shape)
    with pytest.raises(ValueError, match=match):
        attn(torch.randn(shape), mask)


def test_masks_and_cls_of_another_shape_are_refused():
    """``global_attention_mask`` of another length, ``cls_hidden`` of another batch or more than one token, and with a
    cache an ``attention_mask`` that covers neither the new tokens nor the cached and new ones: each refused, naming
    the shapes; with a cache both lengths are taken."""
    attn = make(hidden=16, heads=2, window=4, rank=2)
    x, cls = inputs(attn, 2, 10)
    with pytest.raises(ValueError, match=r"global_attention_mask must have shape \(batch, tokens\) = \(2, 10\)"):
        attn(x, global_attention_mask=torch.zeros(2, 12))
    for bad in (cls[:1], torch.cat([cls, cls], 1)):
        with pytest.raises(ValueError, match=r"cls_hidden must be \(batch, 1, 16\) = \(2, 1, 16\)"):
            attn(x, cls_hidden=bad)
    causal = make(hidden=16, heads=2, window=4, rank=2, causal=True, segment_length=2)
    state = CausalState()
    with torch.no_grad():
        causal(x[:, :6], state=state)
        causal(x[:, 6:], torch.ones(2, 10), state=state)  # the cached and the new tokens
        with pytest.raises(ValueError, match=r"or \(batch, cached \+ new tokens\) = \(2, 14\).*got \(2, 12\)"):
            causal(x[:, 6:], torch.ones(2, 12), state=state)


def test_segment_length_needs_causal():
    with pytest.raises(ValueError, match="segment_length.*only applies to causal attention.*causal=True"):
        LongShortSelfAttention(16, 2, window_size=4, projection_rank=2, segment_length=2)


# ------------------------------------------------------------------------------------------ global tokens
def global_mask(batch: int, n: int, density: float, seed: int) -> torch.Tensor:
    """A (B, n) 0/1 mask marking about ``density`` of the tokens global (a different count per sample)."""
    return (torch.rand(batch, n, generator=torch.Generator().manual_seed(seed)) < density).long()


def assert_global_layout(attn, mask, glob, R):
    """The documented layout (B, H, n, K + R + S + K): every real non-global row's first K + R + S columns are a
    distribution; a global token's distribution is its own K + R columns plus its column in the other rows' tail."""
    B, _, n, C = attn.shape
    valid = torch.ones(B, n, dtype=torch.bool) if mask is None else mask.bool()
    glob = glob.bool() & valid
    K = int(glob.sum(1).max())
    assert (attn >= 0).all()
    for b in range(B):
        slots = glob[b].nonzero().flatten().tolist()
        slot = {t: K - len(slots) + i for i, t in enumerate(slots)}  # the last k of the K columns, position order
        for t in range(n):
            if not valid[b, t]:
                continue
            if t in slot:
                total = attn[b, :, t, : K + R].sum(-1) + attn[b, :, :, C - K + slot[t]].sum(-1)
                assert attn[b, :, t, K + R : C - K].eq(0).all()
            else:
                total = attn[b, :, t, : C - K].sum(-1)
            assert_close(total, torch.ones_like(total), atol=1e-9)


@PROPERTY
@given(
    **{**bidirectional_grid, "batch": st.integers(1, 3)},
    density=st.sampled_from([0.0, 0.1, 0.3, 1.0]),
    global_projections=st.booleans(),
    output_attentions=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_global_tokens_match_oracle(
    dims, window, rank, n, batch, mask_kind, pad, density, global_projections, output_attentions, seed, device, dtype
):
    """Global tokens (any count per sample, anywhere, with padding) against the dense oracle (float64 by default)."""
    if window == rank == 0:
        rank = 1
    module = make(
        window=window, rank=rank, seed=seed, global_projections=global_projections, device=device, dtype=dtype, **dims
    )
    x, _ = inputs(module, batch, n, seed)
    mask = make_mask(mask_kind, batch, n, pad, seed, device)
    glob = global_mask(batch, n, density, seed).to(device)
    with torch.no_grad():
        out, attn = module(x, mask, global_attention_mask=glob, output_attentions=output_attentions)
        expected = reference_attention(*cpu64(module, x, mask), global_mask=glob.cpu())
    assert_close(out, expected, atol=TOL)
    if output_attentions:
        assert_global_layout(attn.cpu(), None if mask is None else mask.cpu(), glob.cpu(), R=rank)


def test_no_global_token_is_the_plain_attention():
    module = make(window=3, rank=2)
    x, _ = inputs(module, 2, 11)
    mask = make_mask("right", 2, 11, 4)
    with torch.no_grad():
        plain, _ = module(x, mask)
        none_global, _ = module(x, mask, global_attention_mask=torch.zeros(2, 11))
        padded_global, _ = module(x, mask, global_attention_mask=1 - mask)  # padding is never global
    torch.testing.assert_close(none_global, plain, atol=0, rtol=0)
    torch.testing.assert_close(padded_global, plain, atol=0, rtol=0)


@pytest.mark.parametrize("case", ["b", "e", "f"])  # the cases with a cls embedding
def test_global_first_token_reproduces_official_cls_keys(case):
    """The official LRA cls case as one global token at position 0: every other token's output is the official one
    (the cls key/value ``LN_G(x W)`` beside the projected rows, the window and projection over the other tokens), to
    1e-6. The cls token's own output differs by design: the official cls attends to the other tokens' *outputs*
    (``cls_hidden`` keeps that form), a global token to their keys, as a dense attention does (so that a converted
    RoBERTa keeps its function)."""
    tensors, module = _official(case)
    x, mask, cls = (tensors[f"{case}.{name}"] for name in ("x", "mask", "cls"))
    glob = torch.zeros(x.shape[0], 1 + x.shape[1])
    glob[:, 0] = 1
    with torch.no_grad():
        out, _ = module(
            torch.cat([cls, x], 1), torch.cat([torch.ones_like(mask[:, :1]), mask], 1), global_attention_mask=glob
        )
    official = tensors[f"{case}.out"]
    torch.testing.assert_close(out[:, 1:], official[:, 1:], atol=1e-6, rtol=0)
    assert (out[:, 0] - official[:, 0]).abs().max() > 1e-3


@PROPERTY
@given(
    window=st.integers(0, 5),
    rank=st.integers(0, 3),
    n=st.integers(1, 14),
    extra=st.integers(1, 9),
    density=st.sampled_from([0.1, 0.3, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_global_tokens_padding_invariance(window, rank, n, extra, density, seed):
    """Appending padding (marked global or not) or changing what padded positions hold leaves the real outputs."""
    if window == rank == 0:
        window = 1
    module = make(window=window, rank=rank, seed=seed)
    x, _ = inputs(module, 1, n + extra, seed)
    glob = global_mask(1, n + extra, density, seed)
    mask = torch.cat([torch.ones(1, n), torch.zeros(1, extra)], 1)
    with torch.no_grad():
        short, _ = module(x[:, :n], global_attention_mask=glob[:, :n])
        padded, _ = module(x, mask, global_attention_mask=glob)
        changed, _ = module(
            torch.where(mask.bool()[..., None], x, 100 * torch.randn_like(x)), mask, global_attention_mask=glob
        )
    torch.testing.assert_close(padded[:, :n], short, atol=TOL, rtol=0)
    torch.testing.assert_close(changed, padded, atol=TOL, rtol=0)


@pytest.mark.parametrize("output_attentions", [False, True])
@pytest.mark.parametrize("global_projections", [False, True])
def test_global_tokens_gradients(global_projections, output_attentions):
    """gradcheck on the input, and every parameter's gradient equal to the oracle's, with two global tokens in one
    sample and one in the other."""
    module = make(window=2, rank=2, global_projections=global_projections)
    x, _ = inputs(module, 2, 9)
    mask = make_mask("left", 2, 9, 3)
    glob = torch.zeros(2, 9)
    glob[0, [0, 5]] = 1
    glob[1, 4] = 1
    assert torch.autograd.gradcheck(
        lambda x: module(x, mask, global_attention_mask=glob, output_attentions=output_attentions)[0],
        (x.clone().requires_grad_(),),
        fast_mode=True,
    )
    weights = torch.randn(2, 9, module.output.out_features, dtype=torch.float64)
    grads = []
    for forward in (
        lambda: module(x, mask, global_attention_mask=glob, output_attentions=output_attentions)[0],
        lambda: reference_attention(module, x, mask, global_mask=glob),
    ):
        module.zero_grad()
        (forward() * weights).sum().backward()
        grads.append({k: p.grad.clone() for k, p in module.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for key in grads[0]:
        torch.testing.assert_close(grads[0][key], grads[1][key], atol=TOL, rtol=0, msg=key)


def test_global_tokens_misuse_raises():
    causal = make(window=2, rank=1, segment_length=1, causal=True)
    bidirectional = make(window=2, rank=1)
    x, cls = inputs(causal, 1, 4)
    with pytest.raises(ValueError, match="global_attention_mask needs bidirectional"):
        causal(x, global_attention_mask=torch.ones(1, 4))
    with pytest.raises(ValueError, match=r"global_attention_mask must have shape \(batch, tokens\) = \(1, 4\)"):
        bidirectional(x, global_attention_mask=torch.ones(1, 5))
    with pytest.raises(ValueError, match="either cls_hidden"):
        bidirectional(x, global_attention_mask=torch.ones(1, 4), cls_hidden=cls)
    with pytest.raises(ValueError, match="global_projections"):
        LongShortSelfAttention(8, 2, 2, 1, causal=True, segment_length=1, global_projections=True)


@pytest.mark.parametrize("global_projections", [False, True])
def test_global_tokens_maps_are_what_the_output_is_computed_from(global_projections):
    """With global tokens, the returned maps are the tensor the output is computed from: recomputing the output by
    hand from them, in the documented layout (B, H, n, K + R + S + K), gives the module's output, and the gradient
    that ``retain_grad`` leaves on the maps equals that recomputation's gradient (float64, every nonzero weight).
    Sample 0 has two global tokens, sample 1 one (an empty slot in each K block) and left padding."""
    module = make(window=2, rank=2, global_projections=global_projections)
    B, n, H, w, r = 2, 9, module.num_heads, module.window_size, module.projection_rank
    x, _ = inputs(module, B, n)
    mask = make_mask("left", B, n, 3)
    glob = torch.zeros(B, n)
    glob[0, [0, 5]] = glob[1, 4] = 1
    out, maps = module(x, mask, global_attention_mask=glob, output_attentions=True)
    maps.retain_grad()
    weights = torch.randn(B, n, module.output.out_features, dtype=torch.float64)
    (out * weights).sum().backward()

    K, e = 2, max(w // 2, 1)
    S = w + 2 * e
    with torch.no_grad():  # the value behind each column, spelled out from the weights (as tests/reference.py)
        values = torch.zeros(B, n, K + r + S + K, H, module.head_dim, dtype=torch.float64)
        v_local = module.dual_ln_local(module.value(x)).view(B, n, H, -1)
        global_value = module.global_value or module.value
        v_seen_by_global = module.dual_ln_local(global_value(x)).view(B, n, H, -1)
        v_global = module.dual_ln_global(module.value(x)).view(B, n, H, -1)
        scores = module.dynamic_projection(x).view(B, n, H, r)
        for b in range(B):
            real, is_glob = mask[b].bool(), glob[b].bool()
            slots = is_glob.nonzero().flatten().tolist()
            slot = {t: K - len(slots) + i for i, t in enumerate(slots)}  # the last k of the K columns
            others = (~is_glob).nonzero().flatten().tolist()  # the window counts the other tokens, padding included
            pooled = [t for t in others if real[t]]
            proj = torch.einsum("lhr,lhd->rhd", scores[b, pooled].softmax(0), v_local[b, pooled])
            rows = module.dual_ln_global(proj.reshape(r, -1)).view(r, H, -1)
            for t in range(n):
                if t in slot:  # a global token: the global tokens' and the projected rows' columns
                    for g in slots:
                        values[b, t, slot[g]] = v_seen_by_global[b, g]
                    values[b, t, K : K + r] = rows
                    continue
                for g in slots:
                    values[b, t, slot[g]] = v_global[b, g]
                values[b, t, K : K + r] = rows
                start = others.index(t) // w * w - e
                for c, i in enumerate(range(start, start + S)):
                    if 0 <= i < len(others):
                        values[b, t, K + r + c] = v_local[b, others[i]]
                for g in slots:  # the tail: the weight of global token g's query on this token
                    values[b, t, K + r + S + slot[g]] = v_seen_by_global[b, t]

    def by_hand(maps):
        context = torch.zeros(B, n, H, module.head_dim, dtype=torch.float64)
        for b in range(B):
            slots = glob[b].nonzero().flatten().tolist()
            for t in range(n):
                if not mask[b, t]:
                    continue  # padding: context 0
                if t in slots:
                    j = K - len(slots) + slots.index(t)
                    own = torch.einsum("hc,chd->hd", maps[b, :, t, : K + r], values[b, t, : K + r])
                    tail = torch.einsum("hs,shd->hd", maps[b, :, :, -K + j], values[b, :, -K + j])
                    context[b, t] = own + tail
                else:
                    context[b, t] = torch.einsum("hc,chd->hd", maps[b, :, t, :-K], values[b, t, :-K])
        return module.output(context.flatten(2))

    leaf = maps.detach().requires_grad_()
    recomputed = by_hand(leaf)
    torch.testing.assert_close(recomputed, out, atol=1e-12, rtol=0)
    (expected,) = torch.autograd.grad((recomputed * weights).sum(), leaf)
    weighted = maps > 0
    assert weighted.sum() > 0 and maps.grad[weighted].abs().max() > 1e-3
    torch.testing.assert_close(maps.grad[weighted], expected[weighted], atol=1e-12, rtol=0)

"""attn_implementation="flex_attention": the FlexAttention path against the SDPA path (itself checked against the dense
oracle in test_attention.py), eager in float64 over a grid, one small compiled case, the models, and its errors.

Checked, never timed. Eager FlexAttention warns that it materialises the scores; that is expected at these sizes.
"""

import contextlib
import functools
from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_mask
from transformers import AutoModel, AutoModelForCausalLM

import ls_hf.long_short_rules as rules
from ls_hf import (
    LongShortForCausalLM,
    LongShortModel,
    long_short_attention,
    long_short_blocks,
    long_short_fused,
    long_short_plan,
)
from ls_hf.long_short_attention import CausalState, LongShortSelfAttention
from ls_hf.long_short_kernels import recoverable_layer_norms
from ls_hf.long_short_plan import plan_attention
from tests import cuda_lowered
from tests.cuda_lowered import compile_on_cpu
from tests.devices import assert_close
from tests.test_attention import (
    PROPERTY,
    bidirectional_grid,
    causal_configs,
    decode,
    global_mask,
    inputs,
    make,
    make_mask,
)
from tests.test_modeling import tiny_config, tokens

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
EXACT = 1e-10  # float64: the two paths differ only in summation order


def pair(**kwargs):
    """The same float64 module (same seed, same weights) on the SDPA path and on FlexAttention."""
    return make(**kwargs), make(**kwargs, attn_implementation="flex_attention")


def same_output(sdpa, flex, *args, atol=EXACT, **kwargs):
    with torch.no_grad():
        expected, _ = sdpa(*args, **kwargs)
        out, _ = flex(*args, **kwargs)
    assert_close(out, expected, atol=atol)
    return out


@PROPERTY
@given(
    **{**bidirectional_grid, "n": st.integers(1, 24), "mask_kind": st.sampled_from(["none", "right", "random"])},
    extra=st.sampled_from(["none", "cls", "global", "global_projections"]),
    seed=st.integers(0, 2**16),
)
def test_bidirectional_flex_matches_sdpa(dims, window, rank, n, batch, mask_kind, pad, extra, seed, device, dtype):
    """Window, projection, padding, the cls token and global tokens (with and without their own projections)."""
    if window == rank == 0:
        rank = 1
    if extra == "cls" and dims.get("qk_head_dim"):  # the cls query attends to the token outputs
        extra = "none"
    sdpa, flex = pair(
        window=window,
        rank=rank,
        seed=seed,
        global_projections=extra == "global_projections",
        device=device,
        dtype=dtype,
        **dims,
    )
    x, cls = inputs(sdpa, batch, n, seed)
    kwargs = {"cls_hidden": cls} if extra == "cls" else {}
    if extra.startswith("global"):
        kwargs["global_attention_mask"] = global_mask(batch, n, 0.2, seed).to(device)
    same_output(sdpa, flex, x, make_mask(mask_kind, batch, n, pad, seed, device), **kwargs)


@PROPERTY
@given(
    config=causal_configs(),
    n=st.integers(1, 30),
    batch=st.integers(1, 2),
    mask_kind=st.sampled_from(["none", "left", "random"]),
    pad=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_causal_prefill_flex_matches_sdpa(config, n, batch, mask_kind, pad, seed, device, dtype):
    """Causal prefill: the window of Appendix D and the finished segments' rows of Eq. 5, with padding."""
    sdpa, flex = pair(seed=seed, device=device, dtype=dtype, **config)
    x, _ = inputs(sdpa, batch, n, seed)
    same_output(sdpa, flex, x, make_mask(mask_kind, batch, n, pad, seed, device))


@pytest.mark.parametrize("sizes", [[9, 1, 1, 5, 12], [3, 8, 2, 10]])
def test_causal_chunks_and_decoding_steps_match_sdpa(sizes):
    """A cache fed chunks of at least w tokens (FlexAttention, keys from the cached window on) and shorter steps (the
    SDPA path by design) gives the SDPA path's outputs, and both the full forward's."""
    sdpa, flex = pair(hidden=12, heads=3, window=4, rank=2, causal=True, segment_length=2)
    x, _ = inputs(sdpa, 2, sum(sizes))
    mask = make_mask("left", 2, sum(sizes), 3)
    bounds = [(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(len(sizes))]
    with torch.no_grad():
        expected = decode(sdpa, x, mask, bounds)
        out = decode(flex, x, mask, bounds)
        full, _ = flex(x, mask)
    torch.testing.assert_close(out, expected, atol=EXACT, rtol=0)
    torch.testing.assert_close(full, expected, atol=EXACT, rtol=0)


def test_output_attentions_takes_the_explicit_path():
    """Weights asked for: the explicit softmax of the SDPA path, the same maps and outputs."""
    sdpa, flex = pair(window=3, rank=2)
    x, _ = inputs(sdpa, 2, 11)
    mask = make_mask("right", 2, 11, 4)
    with torch.no_grad():
        expected = sdpa(x, mask, output_attentions=True)
        got = flex(x, mask, output_attentions=True)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_model_flex_matches_sdpa(causal):
    """LongShortModel (with global tokens and padding) and LongShortForCausalLM, built with each implementation."""
    config = tiny_config(is_decoder=causal)
    auto_class = AutoModelForCausalLM if causal else AutoModel
    sdpa = auto_class.from_config(config, attn_implementation="sdpa").double().eval()
    flex = auto_class.from_config(config, attn_implementation="flex_attention").double().eval()
    assert type(flex) is (LongShortForCausalLM if causal else LongShortModel)
    flex.load_state_dict(sdpa.state_dict())
    assert flex.config._attn_implementation == "flex_attention"
    assert {m.attn_implementation for m in flex.modules() if isinstance(m, LongShortSelfAttention)} == {
        "flex_attention"
    }
    ids = tokens(length=19)
    mask = torch.ones_like(ids)
    mask[1, 13:] = 0
    kwargs = {} if causal else {"global_attention_mask": global_mask(2, 19, 0.15, seed=3)}
    with torch.no_grad():
        expected = sdpa(ids, attention_mask=mask, **kwargs)
        got = flex(ids, attention_mask=mask, **kwargs)
    key = "logits" if causal else "last_hidden_state"
    torch.testing.assert_close(got[key], expected[key], atol=EXACT, rtol=0)
    if causal:  # generation: a prefill, then decoding steps (the SDPA path) on the cache
        with torch.no_grad():
            prompt = ids[:1, :9]
            assert flex.generate(prompt, max_new_tokens=5, do_sample=False).equal(
                sdpa.generate(prompt, max_new_tokens=5, do_sample=False)
            )


@pytest.mark.slow
@pytest.mark.compiled
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_compiled_flex_matches_sdpa(causal):
    """A caller's torch.compile of the FlexAttention path, float32, with padding (right; causal: left) and the cls
    token (bidirectional); tolerance scaled to the outputs' magnitude. The attention kernel is a compile boundary:
    lowered inside the caller's graph, FlexAttention miscompiled the cls case (inductor's CPU kernel, torch 2.14)."""
    torch.manual_seed(0)
    kwargs = {"causal": causal, "segment_length": 8 if causal else None}
    sdpa = LongShortSelfAttention(32, 2, window_size=16, projection_rank=4, **kwargs).eval()
    flex = LongShortSelfAttention(32, 2, 16, 4, **kwargs, attn_implementation="flex_attention")
    flex.load_state_dict(sdpa.state_dict())
    x, cls = torch.randn(2, 150, 32), torch.randn(2, 1, 32)
    mask = torch.ones(2, 150)
    mask[1, slice(0, 30) if causal else slice(101, None)] = 0
    extra = {} if causal else {"cls_hidden": cls}
    with torch.no_grad():
        expected, _ = sdpa(x, mask, **extra)
        out, _ = torch.compile(flex.eval())(x, mask, **extra)
    scale = expected.abs().max().item()
    torch.testing.assert_close(out, expected, atol=1e-5 * scale, rtol=0)


def counting_boundary_calls(monkeypatch) -> list:
    """A list that grows by one at each call of the FlexAttention kernel that crosses a compile boundary."""
    calls, boundary = [], long_short_blocks._flex_attend_outside_graph
    monkeypatch.setattr(
        long_short_blocks, "_flex_attend_outside_graph", lambda *a, **k: calls.append(1) or boundary(*a, **k)
    )
    return calls


@pytest.fixture
def lowered_as_for_cuda(monkeypatch):
    """While the test runs, inductor generates for CPU tensors the code it generates for CUDA, and Triton's
    interpreter runs its kernels (``tests.cuda_lowered.lowered_as_for_cuda``)."""
    with cuda_lowered.lowered_as_for_cuda(monkeypatch):
        yield


@pytest.mark.slow
@pytest.mark.compiled
@pytest.mark.parametrize("kind", ["cls", "causal"])
def test_compiled_layer_as_lowered_for_cuda(kind, lowered_as_for_cuda, monkeypatch):
    """The default path's compiled layer as inductor lowers it for CUDA (``compiled_attention_layer`` on
    ``FUSED_DEVICES``): FlexAttention's Triton templates inside the layer's one graph, forward and backward, the plan's
    block mask an input of it, every kernel run in Triton's interpreter (float32). Against the grouped SDPA path, with
    right padding and the cls token: the output and the gradients of the input, of W^P (Eq. 3) and of LN_L's gain
    (Eq. 7); then the output without padding at a second length (symbolic). The window is wide enough for key blocks that every query of a block sees (full blocks, which
    skip the mask_mod). No call crosses a compile boundary; two layers of the same settings share every compilation,
    and, given one plan, the padded block mask that it built once for both. Causal left padding runs the layer
    uncompiled around its compiled kernel: compiled around it, torch 2.11 miscompiled the mask of each row's offset
    (``test_compiled_layer_compiles_no_more_for_each_longer_input``)."""
    from torch._dynamo.utils import counters

    boundary_calls = counting_boundary_calls(monkeypatch)
    compile_on_cpu(monkeypatch)
    built = counting_mask_builds(monkeypatch)
    causal = kind == "causal"
    config = {
        "hidden": 32,
        "heads": 2,
        "window": 128,
        "rank": 4,
        "causal": causal,
        "segment_length": 8 if causal else None,
    }
    layers = [make(**config, seed=seed, dtype=torch.float32) for seed in (0, 1)]

    def output_and_gradients(layer, x, backward, **call):
        layer.zero_grad()
        x = x.clone().requires_grad_()
        out, _ = layer(x, **call)
        if not backward:
            return (out.detach(),)
        out.square().sum().backward()
        return out.detach(), x.grad, layer.dynamic_projection.weight.grad, layer.dual_ln_local.weight.grad

    new_graphs, builds = [], []  # per call of the compiled layer: the graphs dynamo compiled, the masks built
    plan_builds = []  # per length: the masks that the plan of both layers built
    # gradients at the first length, of the first layer; every other call runs the same compiled forward pass
    if causal:  # left padding: the layer runs uncompiled (the docstring)
        assert not plan_attention(
            layers, torch.zeros(2, 260, 32), attention_mask=make_mask("left", 2, 260, 40)
        ).compiled
    for n, padding, gradients in ((260, "right", True), (270, "none", False)):
        x, cls = inputs(layers[0], 2, n)
        mask = make_mask(padding, 2, n, 40)
        extra = {} if causal else {"cls_hidden": cls}
        built_before = len(built)
        plan = plan_attention(layers, x, attention_mask=mask, **extra)
        plan_builds.append(len(built) - built_before)
        assert plan.compiled
        for layer in layers:
            backward = gradients and layer is layers[0]
            expected = output_and_gradients(
                layer, x, backward, attention_mask=mask, attn_implementation="eager", **extra
            )
            graphs_before, built_before = counters["stats"]["unique_graphs"], len(built)
            got = output_and_gradients(layer, x, backward, plan=plan, **extra)
            new_graphs.append(counters["stats"]["unique_graphs"] - graphs_before)
            builds.append(len(built) - built_before)
            for tensor, reference in zip(got, expected):
                assert_close(tensor, reference, atol=1e-5 * reference.abs().max().item())
    assert not boundary_calls
    # the padded mask built once by the plan, none by the layers
    assert plan_builds[0] == 1 and builds == [0] * 4
    assert new_graphs[0] == 1  # the first call compiled the layer: one graph, the kernel inside
    assert new_graphs[2] > 0  # the second length compiled again, with symbolic lengths
    assert new_graphs[1::2] == [0, 0]  # the second layer reuses the first one's compilations


@contextlib.contextmanager
def package_compiled_with(monkeypatch, backend, *cached):
    """While it is open, the package's compiled functions ``cached`` (their ``functools.cache``'d builders) are built
    afresh with the ``torch.compile`` backend ``backend``, the CPU standing in for CUDA with the attention kernel in
    the layer's graph (``compile_on_cpu``); built again with inductor after it."""
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: real_compile(fn, **{**kwargs, "backend": backend}))
    for compiled in cached:
        compiled.cache_clear()
    compile_on_cpu(monkeypatch)
    try:
        yield
    finally:
        for compiled in cached:
            compiled.cache_clear()
        torch._dynamo.reset()


def _graphs_compiled_per_length(monkeypatch, layer, lengths, padding: str) -> list[int]:
    """The graphs that the compiled layer (the CPU standing in for CUDA, dynamo's own eager backend, whose guards and
    graphs are the ones inductor gets) compiles for each of ``lengths`` in turn, forward only, ``padding`` 11 tokens
    of the second row; each output matches the grouped SDPA path's."""
    from torch._dynamo.utils import counters

    new_graphs = []
    cached = (long_short_fused.compiled_attention_layer, long_short_blocks.compiled_flex_attention)
    with package_compiled_with(monkeypatch, "eager", *cached):
        for n in lengths:
            x, _ = inputs(layer, 2, n)
            mask = make_mask(padding, 2, n, 11)
            with torch.no_grad():
                expected, _ = layer(x, mask, attn_implementation="eager")
                before = counters["stats"]["unique_graphs"]
                out, _ = layer(x, mask)
                new_graphs.append(counters["stats"]["unique_graphs"] - before)
            torch.testing.assert_close(out, expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
    return new_graphs


@pytest.mark.compiled
def test_compiled_layer_runs_each_modules_hooks(monkeypatch):
    """Every module of the same settings shares the compiled layer; one whose Linear has a forward hook gets code that
    calls it, not the code compiled first for a module without one (dynamo guards on module hooks while the package's
    compiled code runs: ``compile_in_package``): the hook runs and changes the output as on the portable path."""
    layers = [make(hidden=16, heads=2, window=8, rank=2, seed=seed, dtype=torch.float32) for seed in (0, 1)]
    calls = []
    layers[1].value.register_forward_hook(lambda linear, args, out: calls.append(1) or 1.5 * out)
    x, _ = inputs(layers[0], 2, 40)
    cached = (long_short_fused.compiled_attention_layer, long_short_blocks.compiled_flex_attention)
    with package_compiled_with(monkeypatch, "eager", *cached), torch.no_grad():
        layers[0](x)  # compiles the layer without a hook
        expected, _ = layers[1](x, attn_implementation="eager")
        calls.clear()
        out, _ = layers[1](x)
    assert calls == [1]
    torch.testing.assert_close(out, expected, atol=1e-5 * expected.abs().max().item(), rtol=0)


@pytest.mark.compiled
def test_compiled_layer_compiles_no_more_for_each_longer_input(monkeypatch):
    """Uncached generation feeds the layer one token more each step. With left padding (each row's segments counted
    from its first real token), the compiled causal layer makes its lengths symbolic at the second length and the
    count of projected rows at the first segment boundary after it, and compiles nothing for the later lengths. The
    layer compiles to one graph, its kernel inside. ``take_along_dim`` made dynamo specialize on the length, one
    compilation per token."""
    layer = make(hidden=16, heads=2, window=8, rank=2, causal=True, segment_length=4, dtype=torch.float32)
    # segments of 4 tokens: 40 static, 41 symbolic, 44 the rows' count symbolic
    new_graphs = _graphs_compiled_per_length(monkeypatch, layer, range(40, 52), "left")
    # the layer in one graph, the kernel in it (at a compile boundary: one graph before the kernel's call, one after
    # it and the kernel's own)
    assert new_graphs[0] == 1 and new_graphs[1] > 0
    assert new_graphs[5:] == [0] * 7


@pytest.mark.compiled
def test_compiled_layer_compiles_once_for_any_number_of_extra_key_copies(monkeypatch):
    """Bidirectionally the kernel takes the extra keys in one copy per band of queries (``extra_key_copies``; a band
    of 8 here): the compiled layer makes the lengths symbolic at the second length, the copies' count with them, and
    compiles nothing more as the count grows from 5 to 8."""
    monkeypatch.setattr(long_short_fused, "EXTRA_KEY_BAND", 8)
    layer = make(hidden=16, heads=2, window=8, rank=2, dtype=torch.float32)
    assert _graphs_compiled_per_length(monkeypatch, layer, range(40, 60), "right") == [1, 1] + [0] * 18


@pytest.mark.slow
@pytest.mark.compiled
def test_compiled_layer_backward_matches_sdpa_and_recomputes_on_request(monkeypatch):
    """The compiled layer's backward pass (the CPU standing in for CUDA, FlexAttention computed densely there, float64,
    padding): its output and its gradients of the input and of every parameter are the grouped SDPA path's, with the
    cls token by default (``LN_L`` applied where the keys are joined) and with ``recompute_window_tiles`` (compiled with
    torch's activation memory budget, which keeps less for the backward pass: not P), and with global tokens; the
    kernel in the layer's graph, as on CUDA."""
    from tests.test_attention import _saved_storages

    compile_on_cpu(monkeypatch)
    monkeypatch.setattr(long_short_blocks, "FUSED_DTYPES", (torch.float64,))
    monkeypatch.setattr(long_short_blocks, "flex_attend", _dense_flex_attend)
    n, hidden = 150, 32
    kept, grads = {}, {}
    runs = [("eager", "cls"), ("default", "cls"), ("recompute", "cls"), ("eager", "global"), ("default", "global")]
    if torch.torch_version.TorchVersion(torch.__version__) < "2.14":
        # torch 2.11's compiled float64 CPU SDPA backward (the global tokens' own rows) gets a float32 tensor
        # ("expected scalar type Double but found Float"); that kernel is the CPU's alone
        runs = [run for run in runs if run[1] != "global"]
    for name, special in runs:
        module = make(
            hidden=hidden, heads=2, window=16, rank=4, attn_implementation="eager" if name == "eager" else "sdpa"
        )
        module.recompute_window_tiles = name == "recompute"
        x, cls = inputs(module, 2, n)
        x.requires_grad_()
        params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        extra = {"cls_hidden": cls} if special == "cls" else {"global_attention_mask": global_mask(2, n, 0.05, 0)}
        call = functools.partial(module, x, make_mask("right", 2, n, 40), **extra)
        saved, (out, _) = _saved_storages(call)
        kept[name, special] = sum(size for ptr, size in saved.items() if ptr not in params and size >= n * hidden)
        out.square().sum().backward()
        grads[name, special] = {
            "output": out,
            "input": x.grad,
            **{key: p.grad for key, p in module.named_parameters()},
        }
    for name, special in runs:
        assert grads[name, special].keys() == grads["eager", special].keys()
        for key, expected in grads["eager", special].items():
            torch.testing.assert_close(
                grads[name, special][key], expected, atol=1e-9, rtol=1e-7, msg=f"{name}, {special}: {key}"
            )
    assert kept["recompute", "cls"] <= kept["default", "cls"] - 2 * n * hidden


def test_compiled_layer_runs_where_it_can(monkeypatch):
    """``forward`` sends the fused path to ``compiled_attention_layer(LongShortSelfAttention._attend,
    recompute=recompute_window_tiles)`` where the fused path runs by default (the one device rule: ``FUSED_DEVICES``
    in ``FUSED_DTYPES``), global tokens included, and not with ``compile_attention=False``, a decoding cache, another
    path, or FlexAttention asked for elsewhere; the output is the layer's either way. (The compiled region itself is
    checked above; here it runs uncompiled, to count its calls.)"""
    uncompiled_kernel(monkeypatch)
    calls, compiled = [], []

    def counted(*args, **kwargs):
        calls.append(1)
        return LongShortSelfAttention._attend(*args, **kwargs)

    def compiled_attention_layer(layer, *, recompute=False):
        compiled.append((layer, recompute))
        return counted

    monkeypatch.setattr(long_short_attention, "compiled_attention_layer", compiled_attention_layer)
    bidirectional, causal = make(window=3, rank=2), make(window=3, rank=2, causal=True, segment_length=3)
    x, _ = inputs(bidirectional, 2, 13)

    def compiled_calls(module, *args, **kwargs):
        calls.clear()
        with torch.no_grad():
            out, _ = module(*args, **kwargs)
        return len(calls), out

    assert compiled_calls(bidirectional, x)[0] == 0  # the CPU is not a fused device
    assert compiled_calls(bidirectional, x, attn_implementation="flex_attention")[0] == 0
    monkeypatch.setattr(long_short_blocks, "FUSED_DEVICES", ("cpu",))
    assert compiled_calls(bidirectional, x)[0] == 0  # nor is float64 a fused dtype
    monkeypatch.setattr(long_short_blocks, "FUSED_DTYPES", (torch.float64,))
    count, out = compiled_calls(bidirectional, x)
    assert count == 1 and compiled == [(LongShortSelfAttention._attend, False)]
    assert_close(out, compiled_calls(bidirectional, x, attn_implementation="eager")[1], atol=EXACT)
    assert compiled_calls(causal, x)[0] == 1
    count, out = compiled_calls(bidirectional, x, global_attention_mask=global_mask(2, 13, 0.2, 0))
    assert count == 1
    assert_close(
        out,
        compiled_calls(bidirectional, x, global_attention_mask=global_mask(2, 13, 0.2, 0), attn_implementation="eager")[
            1
        ],
        atol=EXACT,
    )
    assert compiled_calls(causal, x, state=CausalState())[0] == 0
    assert compiled_calls(bidirectional, x, attn_implementation="eager")[0] == 0
    assert compiled_calls(bidirectional, x, output_attentions=True)[0] == 0
    bidirectional.recompute_window_tiles = True
    compiled.clear()
    assert compiled_calls(bidirectional, x)[0] == 1 and compiled == [(LongShortSelfAttention._attend, True)]
    bidirectional.compile_attention = False
    assert compiled_calls(bidirectional, x)[0] == 0


def test_backward_matches_sdpa_where_supported(device):
    """Gradients equal the SDPA path's where FlexAttention has a backward (not on CPU)."""
    if device.type == "cpu":
        pytest.skip("FlexAttention has no backward on CPU (torch 2.14/2.15); runs on CUDA")
    sdpa, flex = pair(window=3, rank=2, device=device)
    x, _ = inputs(sdpa, 2, 21)
    x = x.requires_grad_()
    grads = []
    for module in (sdpa, flex):
        module(x, None)[0].square().sum().backward()
        grads.append((x.grad.clone(), module.query.weight.grad.clone()))
        x.grad = None
    for got, expected in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, expected, atol=1e-9, rtol=0)


def _dense_flex_attend(
    query, key, value, block_mask, *, score_mod=None, scale=None, return_lse=False, tokens_first=False, **compiling
):
    """FlexAttention's result computed densely, which autograd differentiates on any device: the softmax over the keys
    that ``block_mask``'s mask_mod keeps (evaluated on every pair) of the scores through ``score_mod`` (called once on
    broadcast index tensors), 0 for a query that sees none; with ``return_lse`` the log-sum-exp of its kept scores
    too (-inf for a query that sees none). ``tokens_first`` as ``flex_attend``'s; its settings of the compiled kernel
    (``compiling``: ``static_shapes``) do not apply."""
    if tokens_first:
        out = _dense_flex_attend(
            *(x.transpose(1, 2) for x in (query, key, value)),
            block_mask,
            score_mod=score_mod,
            scale=scale,
            return_lse=return_lse,
        )
        return (out[0].transpose(1, 2), out[1]) if return_lse else out.transpose(1, 2)
    keep = create_mask(block_mask.mask_mod, query.shape[0], 1, query.shape[2], key.shape[2], device=query.device)
    scores = query @ key.transpose(-1, -2) * (query.shape[-1] ** -0.5 if scale is None else scale)
    if score_mod is not None:
        index = [torch.arange(size, device=query.device) for size in scores.shape]  # b, h, q_idx, kv_idx
        scores = score_mod(scores, *(i.view([-1 if d == dim else 1 for d in range(4)]) for dim, i in enumerate(index)))
    scores = scores.masked_fill(~keep, float("-inf"))
    out = scores.softmax(-1).nan_to_num(0.0) @ value
    return (out, scores.to(torch.promote_types(scores.dtype, torch.float32)).logsumexp(-1)) if return_lse else out


def fused_on_cpu(monkeypatch, kernel=_dense_flex_attend) -> None:
    """The CPU in float64 stands in for CUDA in the device rule (``long_short_blocks.FUSED_DEVICES`` and
    ``FUSED_DTYPES``): the default path is the fused one there, its FlexAttention computed by ``kernel`` (by default
    densely, which autograd differentiates on any device). Its modules are built with ``compile_attention=False``: the
    layer runs uncompiled, the kernel's call a compile boundary."""
    monkeypatch.setattr(long_short_blocks, "FUSED_DEVICES", ("cpu",))
    monkeypatch.setattr(long_short_blocks, "FUSED_DTYPES", (torch.float64,))
    monkeypatch.setattr(long_short_blocks, "flex_attend", kernel)


def uncompiled_kernel(monkeypatch) -> None:
    """FlexAttention's kernel runs uncompiled (eager: the mask_mod on every pair) where ``FUSED_DEVICES`` would have
    it compiled (the CPU standing in for CUDA)."""
    flex_attend = functools.partial(long_short_blocks.flex_attend, compiled=False)
    monkeypatch.setattr(long_short_blocks, "flex_attend", flex_attend)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_fused_path_hands_the_kernel_token_major_contiguous_tensors(causal, monkeypatch):
    """The fused path hands FlexAttention its query, keys and values token-major and contiguous (``tokens_first``),
    as the projections and ``JoinedProjectedKeys`` make them: no tensor that enters the compile boundary around the
    kernel is a heads-first view, whose gradient torch 2.11's AOTAutograd copies into a contiguous tensor."""
    calls = []

    def recording_flex_attend(query, key, value, block_mask, **kwargs):
        calls.append((kwargs.get("tokens_first"), [x.is_contiguous() for x in (query, key, value)]))
        return _dense_flex_attend(query, key, value, block_mask, **kwargs)

    fused_on_cpu(monkeypatch, recording_flex_attend)
    settings = {"window": 4, "causal": True, "segment_length": 2} if causal else {"window": 3}
    default, eager = (
        make(rank=2, hidden=12, heads=3, **settings, attn_implementation=name, compile_attention=False)
        for name in ("sdpa", "eager")
    )
    x, _ = inputs(default, 2, 21)
    torch.testing.assert_close(default(x)[0], eager(x)[0], atol=EXACT, rtol=0)
    assert calls == [(True, [True, True, True])]


@pytest.mark.parametrize("copies", [False, True], ids=["one_copy", "copies"])
@pytest.mark.parametrize("extra", ["none", "cls", "global", "causal"])
@pytest.mark.parametrize(
    "dims",
    [
        {"hidden": 12, "heads": 3},
        {"hidden": 12, "heads": 3, "use_dual_ln": False},
        {"hidden": 12, "heads": 3, "qk_head_dim": 2},
    ],
    ids=["dual_ln", "no_dual_ln", "lmsa"],
)
def test_fused_path_gradients_match_sdpa_on_cpu(dims, extra, copies, monkeypatch):
    """The fused path's outputs and gradients on the CPU, with FlexAttention computed densely (it has no backward
    there): its keys and values built by ``JoinedProjectedKeys`` ([window; cls and global tokens' keys; projected
    rows]; causal: the rows of each finished segment, Eq. 5, the last segment unfinished), bidirectionally in one copy
    or in copies, one per band of 8 queries (``extra_key_copies``: 3 for 21 tokens), give the output and gradients of
    the SDPA path, for the input and every parameter (float64, right padding)."""
    key_lengths = []

    def dense_flex_attend(query, key, value, block_mask, **kwargs):
        key_lengths.append(key.shape[1 if kwargs.get("tokens_first") else 2])
        return _dense_flex_attend(query, key, value, block_mask, **kwargs)

    fused_on_cpu(monkeypatch, dense_flex_attend)
    if copies:
        monkeypatch.setattr(long_short_fused, "EXTRA_KEY_BAND", 8)
    if extra == "cls" and "qk_head_dim" in dims:  # the cls query attends to the token outputs
        extra = "none"
    causal = {"window": 4, "causal": True, "segment_length": 2} if extra == "causal" else {"window": 3}
    default, eager = (
        make(rank=2, **causal, **dims, attn_implementation=name, compile_attention=False) for name in ("sdpa", "eager")
    )
    x, cls = inputs(default, 2, 21)
    kwargs = {"cls_hidden": cls} if extra == "cls" else {}
    if extra == "global":
        kwargs["global_attention_mask"] = global_mask(2, 21, 0.2, seed=0)
    grads = []
    for module in (default, eager):
        x_in = x.clone().requires_grad_()
        out, _ = module(x_in, make_mask("right", 2, 21, 5), **kwargs)
        out.square().sum().backward()
        grads.append(
            {
                "output": out,
                "input": x_in.grad,
                **{name: p.grad for name, p in module.named_parameters() if p.grad is not None},
            }
        )
    assert grads[0].keys() == grads[1].keys()
    assert "dynamic_projection.weight" in grads[0]
    for name, expected in grads[1].items():
        torch.testing.assert_close(grads[0][name], expected, atol=1e-9, rtol=0, msg=name)
    if extra != "causal":  # the kernel's keys: the window's, then the extra keys' copies
        per_copy = (
            2 + (extra == "cls") + (int(kwargs["global_attention_mask"].sum(1).max()) if extra == "global" else 0)
        )
        assert key_lengths == [21 + (3 if copies else 1) * per_copy]


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_fused_path_applies_ln_l_where_it_joins_the_keys(causal, monkeypatch):
    """Where the fused path joins the window keys with the projected rows, ``LN_L`` is applied there
    (``JoinedProjectedKeys``), which recovers its normalized input from its output: autograd keeps neither the key
    nor the value Linear's output (two (n, hidden) tensors fewer). A gain below ``LN_MIN_GAMMA`` in an LN_L turns
    that off (the plan's ``LayerPlan.local_norm``), and so do a decoding cache and, causally, left padding (the keys
    are not joined then); the outputs and gradients are the SDPA path's either way (float64, FlexAttention computed
    densely)."""
    from tests.test_attention import _saved_storages

    fused_on_cpu(monkeypatch)
    n, hidden, unit = 24, 12, 2 * 24 * 12
    settings = {"window": 4, "causal": True, "segment_length": 2} if causal else {"window": 3}
    cases = {"joined": ("right", False), "small gain": ("right", True)}
    if causal:
        cases["left padding"] = ("left", False)
    kept = {}
    for name, (padding, small_gain) in cases.items():
        default, eager = (
            make(hidden=hidden, heads=3, rank=2, **settings, attn_implementation=a, compile_attention=False)
            for a in ("sdpa", "eager")
        )
        if small_gain:
            for module in (default, eager):
                with torch.no_grad():
                    module.dual_ln_local.weight[1] = 1e-4
        x, _ = inputs(default, 2, n)
        mask = make_mask(padding, 2, n, 5)
        layer = plan_attention([default], x, attention_mask=mask).for_layer(default, cached=False)
        assert layer.joins_keys and layer.local_norm == (not small_gain)
        if causal:
            cached = plan_attention([default], x, attention_mask=mask, cached_tokens=0)
            layer = cached.for_layer(default, cached=True)
            assert cached.backend == "flex" and not layer.joins_keys and not layer.local_norm
        grads = []
        for module in (default, eager):
            x_in = x.clone().requires_grad_()
            params = {p.untyped_storage().data_ptr() for p in module.parameters()}
            saved, (out, _) = _saved_storages(functools.partial(module, x_in, mask))
            if module is default:
                kept[name] = sum(size for ptr, size in saved.items() if ptr not in params and size >= unit) / unit
            out.square().sum().backward()
            grads.append({"output": out, "input": x_in.grad, **{k: p.grad for k, p in module.named_parameters()}})
        for key, expected in grads[1].items():
            torch.testing.assert_close(grads[0][key], expected, atol=1e-9, rtol=0, msg=f"{name}: {key}")
    assert kept["joined"] <= kept["small gain"] - 2


def counting_mask_builds(monkeypatch) -> list:
    """A list that gets an entry for each padded block mask built (``long_short_blocks._block_mask``: a mask with
    padding or offsets, which is not cached per shape)."""
    built, build = [], long_short_blocks._block_mask
    monkeypatch.setattr(
        long_short_blocks, "_block_mask", lambda *args, **kwargs: built.append(1) or build(*args, **kwargs)
    )
    return built


def test_the_plan_builds_the_padded_block_mask_once_for_all_layers(monkeypatch):
    """With padding a model's forward pass builds the fused path's block mask once, in its plan, for all its layers
    (one geometry), with global tokens beside the padding and for an inference tensor's mask too; nothing is kept
    across forward passes, so a mask changed in place gives the new mask's output. The output is the grouped SDPA
    path's each time. Bare layers given one plan (``plan_attention``) share its masks, one per geometry: a layer of
    another window gets its own."""
    from ls_hf import LongShortForMaskedLM

    fused_on_cpu(monkeypatch)
    built = counting_mask_builds(monkeypatch)
    torch.manual_seed(0)
    model = LongShortForMaskedLM(tiny_config(num_hidden_layers=3, compile_attention=False)).double().eval()
    ids = tokens(length=24)
    mask = torch.ones_like(ids)
    mask[0, 17:] = 0

    def fused(**masks) -> int:
        """The masks built for the logits on the fused path, which are checked against the grouped SDPA path's."""
        built.clear()
        with torch.no_grad():
            logits = model(input_ids=ids, **masks).logits
            count = len(built)
            with monkeypatch.context() as patch:
                patch.setattr(long_short_blocks, "FUSED_DEVICES", ())
                expected = model(input_ids=ids, **{k: v.clone() for k, v in masks.items()}).logits
        assert_close(logits, expected, atol=EXACT)
        return count

    assert fused(attention_mask=mask) == 1
    assert fused(attention_mask=mask) == 1  # the next forward pass builds its own
    mask[1, 20:] = 0
    assert fused(attention_mask=mask) == 1  # changed in place
    first = torch.zeros_like(ids)
    first[:, 0] = 1
    assert fused(attention_mask=mask, global_attention_mask=first) == 1
    with torch.inference_mode():
        frozen = mask.clone()
    assert fused(attention_mask=frozen) == 1

    layers = [
        make(hidden=16, heads=2, window=window, rank=2, seed=seed, compile_attention=False)
        for window, seed in ((3, 0), (3, 1), (8, 2))
    ]
    x = torch.randn(2, 24, 16, dtype=torch.float64)
    built.clear()
    with torch.no_grad():
        plan = plan_attention(layers, x, attention_mask=mask)
        outs = [layer(x, plan=plan)[0] for layer in layers]
    assert len(built) == 2 and set(plan.block_masks) == {(3, 2), (8, 2)}
    for layer, out in zip(layers, outs):
        with torch.no_grad():
            assert_close(out, layer(x, mask, attn_implementation="eager")[0], atol=EXACT)


def counting_device_reads(monkeypatch) -> Counter:
    """From now on, count every read of a tensor's values on the host (``bool``, ``int``, ``item``, ``tolist``), each
    of which waits for the device on a GPU."""
    reads = Counter()

    def counting(name, original):
        def read(self, *args, **kwargs):
            reads[name] += 1
            return original(self, *args, **kwargs)

        return read

    for name in ("__bool__", "__int__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    return reads


def test_a_forward_pass_reads_the_device_once_for_all_layers(monkeypatch):
    """A model's forward pass reads the device (on a GPU every read stalls the host until the device has caught up)
    in its plan, once for all layers, never once a layer: in training on the fused path every layer's LN_L gains in
    one read (``recoverable_layer_norms``), at every step; with an attention mask, whether it masks anything; with
    global tokens (a classification head's), their count; causally, whether a row is left-padded. A gain set below
    ``LN_MIN_GAMMA`` in place is seen by the next step's plan; a global mask changed in place gives the output of a
    fresh mask."""
    from ls_hf import LongShortForCausalLM, LongShortForMaskedLM, LongShortForSequenceClassification

    fused_on_cpu(monkeypatch)
    torch.manual_seed(0)
    model = LongShortForMaskedLM(tiny_config(num_hidden_layers=3, compile_attention=False)).double()
    layers = [layer.attention.self for layer in model.long_short.encoder.layer]
    plans = []
    layers[0].register_forward_pre_hook(lambda module, args, kwargs: plans.append(kwargs["plan"]), with_kwargs=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = tokens(length=24)
    padded = torch.ones_like(ids)
    padded[1, 20:] = 0

    def step(**masks) -> dict:
        reads.clear()
        model(input_ids=ids, labels=ids, **masks).loss.backward()
        optimizer.step()
        return dict(reads)

    reads = counting_device_reads(monkeypatch)
    assert step() == {"tolist": 1}
    assert step() == {"tolist": 1}  # changed by the update: read again
    assert plans[-1].backend == "flex"
    assert step(attention_mask=padded) == {"__bool__": 1, "tolist": 1}
    with torch.no_grad():
        layers[1].dual_ln_local.weight[2] = 1e-4
    assert step() == {"tolist": 1}
    assert [plans[-1].for_layer(layer, cached=False).local_norm for layer in layers] == [True, False, True]

    classifier = LongShortForSequenceClassification(tiny_config(num_hidden_layers=3, compile_attention=False))
    classifier = classifier.double().eval()
    first = torch.zeros_like(ids)
    first[:, 0] = 1
    with torch.no_grad():
        reads.clear()
        classifier(input_ids=ids)  # the first token global, a new mask each forward pass
        assert dict(reads) == {"__int__": 1}
        first[1, 1:4] = 1
        reads.clear()
        changed = classifier(input_ids=ids, global_attention_mask=first).logits
        assert dict(reads) == {"__int__": 1}
        assert_close(changed, classifier(input_ids=ids, global_attention_mask=first.clone()).logits, atol=EXACT)

    causal = LongShortForCausalLM(tiny_config(is_decoder=True, num_hidden_layers=3, compile_attention=False))
    left = torch.ones_like(ids)
    left[1, :5] = 0
    with torch.no_grad():
        reads.clear()
        causal.double().eval()(input_ids=ids, attention_mask=left, use_cache=False)
    assert dict(reads) == {"__bool__": 2}


@pytest.mark.compiled_layer
def test_training_step_on_cuda_waits_for_the_device_once(device, dtype, monkeypatch):
    """On CUDA a training step of the encoder's layers on the default path (the fused path, each layer compiled around
    its kernel) makes the host wait for the device once, in the plan's one read of every layer's LN_L gains
    (``recoverable_layer_norms``, let through): ``torch.cuda.set_sync_debug_mode("error")`` raises at any other
    synchronizing call. (The embeddings are left out: CUDA's embedding backward may synchronize, in any model.) The
    CPU counts the host's reads instead (``test_a_forward_pass_reads_the_device_once_for_all_layers``)."""
    if device.type != "cuda":
        pytest.skip("CUDA only: synchronizations are CUDA's")
    gain_reads = []

    def read_gains(norms):
        gain_reads.append(len(norms))
        torch.cuda.set_sync_debug_mode("default")
        try:
            return recoverable_layer_norms(norms)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    torch.manual_seed(0)
    encoder = LongShortModel(tiny_config(num_hidden_layers=3)).encoder.to(device=device, dtype=dtype)
    x = torch.randn(2, 120, 32, device=device, dtype=dtype, requires_grad=True)

    def step() -> torch.Tensor:
        encoder.zero_grad(set_to_none=True)
        loss = encoder(hidden_states=x).float().square().mean()
        loss.backward()
        return loss.detach()

    step()
    step()
    torch.cuda.synchronize()
    monkeypatch.setattr(long_short_plan, "recoverable_layer_norms", read_gains)
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert gain_reads == [3]  # the 3 layers' gains
    assert torch.isfinite(loss)


def test_cpu_training_is_refused_clearly():
    flex = make(window=3, rank=2, attn_implementation="flex_attention")
    x, _ = inputs(flex, 1, 7)
    with pytest.raises(NotImplementedError, match="forward only on CPU.*sdpa"):
        flex(x)
    flex.train()
    flex.attention_dropout = 0.1
    with torch.no_grad(), pytest.raises(ValueError, match="no attention dropout.*attention_probs_dropout_prob"):
        flex(x)


def test_unknown_implementation_and_missing_flex_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="attn_implementation must be one of"):
        LongShortSelfAttention(8, 2, 3, 2, attn_implementation="flash_attention_2")
    monkeypatch.setattr(rules, "flex_attention", None)
    with pytest.raises(ImportError, match=r"torch >= 2\.6.*sdpa"):
        LongShortSelfAttention(8, 2, 3, 2, attn_implementation="flex_attention")
    with pytest.raises(ImportError, match=r"torch >= 2\.6"):
        LongShortModel(tiny_config(attn_implementation="flex_attention"))


def test_default_stays_sdpa():
    assert LongShortSelfAttention(8, 2, 3, 2).attn_implementation == "sdpa"
    assert {
        m.attn_implementation for m in LongShortModel(tiny_config()).modules() if isinstance(m, LongShortSelfAttention)
    } == {"sdpa"}


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_sdpa_runs_the_fused_path_where_fused_devices_say(monkeypatch, causal):
    """attn_implementation="sdpa" (the default) runs FlexAttention on ``FUSED_DEVICES`` in ``FUSED_DTYPES`` (CUDA, not
    float64; here the CPU in float64 stands in), decided at each call from where the tensors are, with the output of
    the grouped SDPA path; not for attention maps, active attention dropout or a decoding step (fewer than w causal
    tokens); "eager" never does."""
    uncompiled_kernel(monkeypatch)
    built = []
    real = long_short_fused.long_short_flex_attend
    monkeypatch.setattr(long_short_fused, "long_short_flex_attend", lambda *a, **k: built.append(1) or real(*a, **k))
    config = {"window": 3, "rank": 2, "causal": causal, "segment_length": 2 if causal else None}
    default, eager = make(**config, compile_attention=False), make(**config, attn_implementation="eager")
    x, _ = inputs(default, 2, 13)
    mask = make_mask("left" if causal else "right", 2, 13, 4)

    def fused_calls(module, *args, **kwargs):
        built.clear()
        with torch.no_grad():
            out, _ = module(*args, **kwargs)
        return out, len(built)

    expected, calls = fused_calls(default, x, mask)
    assert calls == 0  # the CPU is not a fused device
    monkeypatch.setattr(long_short_blocks, "FUSED_DEVICES", ("cpu",))
    assert fused_calls(default, x, mask)[1] == 0  # nor is float64 a fused dtype
    monkeypatch.setattr(long_short_blocks, "FUSED_DTYPES", (torch.float64,))
    out, calls = fused_calls(default, x, mask)
    assert calls == 1
    assert_close(out, expected, atol=EXACT)
    assert fused_calls(eager, x, mask)[1] == 0
    assert fused_calls(default, x, mask, output_attentions=True)[1] == 0
    assert fused_calls(default, x[:, :2], mask[:, :2])[1] == (0 if causal else 1)  # 2 < w causal tokens: a step
    default.train()
    default.attention_dropout = 0.1
    assert fused_calls(default, x, mask)[1] == 0


@pytest.mark.compiled_layer
@pytest.mark.parametrize("kind", ["cls", "global", "causal"])
def test_default_matches_the_portable_path_on_the_test_device(kind, device, dtype, monkeypatch):
    """The default (attn_implementation="sdpa": on CUDA the fused FlexAttention path with its block-sparse mask, the
    layer compiled with the kernel inside; on any other test device, the CPU standing in, the layer and its kernel
    uncompiled) against "eager" (grouped SDPA everywhere) on the test device, with padding (right; causal: left), the
    cls token or global tokens (bidirectional, their extra keys in 3 copies, one per band of 128 queries:
    ``extra_key_copies``) and 128-token blocks: outputs, and where FlexAttention has a backward (not on the CPU) the
    gradients of the input, of W^P (Eq. 3) and of LN_L's gain (Eq. 7). On CUDA the kernel runs inside the compiled
    layer's graph, crossing no compile boundary; uncompiled, its call is one."""
    boundary_calls = counting_boundary_calls(monkeypatch)
    compiled = device.type == "cuda"
    monkeypatch.setattr(long_short_blocks, "FUSED_DEVICES", (device.type,))
    monkeypatch.setattr(long_short_blocks, "FUSED_DTYPES", (dtype,))
    monkeypatch.setattr(long_short_fused, "EXTRA_KEY_BAND", 128)
    if not compiled:
        uncompiled_kernel(monkeypatch)
    causal = kind == "causal"
    config = {
        "hidden": 32,
        "heads": 2,
        "window": 64,
        "rank": 4,
        "causal": causal,
        "segment_length": 8 if causal else None,
    }
    default = make(**config, device=device, dtype=dtype, compile_attention=compiled)
    eager = make(**config, device=device, dtype=dtype, attn_implementation="eager")
    x, cls = inputs(default, 2, 300)
    mask = make_mask("left" if causal else "right", 2, 300, 70, device=device)
    extra = {
        "cls": {"cls_hidden": cls},
        "global": {"global_attention_mask": global_mask(2, 300, 0.02, 0).to(device)},
        "causal": {},
    }[kind]
    grads = device.type != "cpu"
    outs = []
    for module in (default, eager):
        with torch.set_grad_enabled(grads):
            x_in = x.clone().requires_grad_(grads)
            out, _ = module(x_in, mask, **extra)
            if grads:
                out.float().square().sum().backward()
        params = (module.dynamic_projection.weight, module.dual_ln_local.weight)
        outs.append((out.detach(), x_in.grad, *(p.grad for p in params)))
    assert len(boundary_calls) == (0 if compiled else 1)
    for got, expected in zip(*outs):
        if got is not None or grads:
            assert_close(got, expected, atol=EXACT)


def test_config_compile_attention_reaches_every_layer():
    """``LongShortConfig.compile_attention`` (default True) is each attention module's ``compile_attention``."""
    for setting in (True, False):
        model = LongShortModel(tiny_config(compile_attention=setting))
        layers = [m for m in model.modules() if isinstance(m, LongShortSelfAttention)]
        assert layers and all(layer.compile_attention is setting for layer in layers)
    assert LongShortModel(tiny_config()).config.compile_attention is True

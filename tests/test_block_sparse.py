"""The block-sparse structure of Long-Short attention (``ls_hf.long_short_blocks``): its mask_mod against the paper's
rules spelled out with loops, its BlockMask (built from the window geometry) against the one FlexAttention builds by
evaluating the mask_mod on every (query, key) pair, block class by block class, and FlexAttention's output with it
against dense SDPA in float64.

Eager FlexAttention evaluates the mask_mod on every pair and ignores the block structure; the compiled kernel (the
``compiled`` tests) skips the blocks the BlockMask leaves out and calls no mask_mod on full blocks, so that is where a
wrong block class would show in the outputs. Checked, never timed.
"""

from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask, flex_attention

from ls_hf import long_short_blocks as lsb
from ls_hf import long_short_rules as rules
from ls_hf.long_short_blocks import KeyLayout, flex_attend, long_short_block_mask, long_short_mask_mod

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
WINDOWS = (1, 2, 3, 5, 16, 128, 256)
BLOCKS = (8, 16, 24, 32, 128)  # some divide the windows, some do not
EXACT = 1e-12  # float64


# ------------------------------------------------------------------------------------------------------- cases
class Case(NamedTuple):
    """A layout and what one call adds to it: the number of queries, the padding, the offsets, the block size."""

    layout: KeyLayout
    num_queries: int
    key_valid: torch.Tensor | None
    offsets: torch.Tensor | None
    block_size: int | tuple[int, int]

    @property
    def batch(self) -> int:
        return next((len(x) for x in (self.key_valid, self.offsets) if x is not None), 1)

    def mask_mod(self):
        return long_short_mask_mod(self.layout, key_valid=self.key_valid, offsets=self.offsets)

    def block_mask(self):
        return long_short_block_mask(
            self.layout,
            num_queries=self.num_queries,
            key_valid=self.key_valid,
            offsets=self.offsets,
            block_size=self.block_size,
        )


@st.composite
def layouts(draw, max_queries=700, windows=WINDOWS):
    """(``KeyLayout`` fields and ``num_queries``, a spec for ``build``): bidirectional (window 0 included: extra keys
    only) or causal; a full pass or, causally, a cached continuation (``q_start``/``k_start`` > 0); global/projected
    extra keys, or causal projected rows (Eq. 5) with several l and r; padding right, left or random; per-row
    offsets; block sizes that do and do not divide the window."""
    causal = draw(st.booleans())
    window = draw(st.sampled_from(windows if causal else (0, *windows)))
    span = min(max_queries, 3 * max(window, 8) + 40)
    m = draw(st.integers(1, span))
    fields = {"num_queries": m, "window_size": window, "causal": causal}
    if causal:
        q_start = draw(st.integers(0, span)) if draw(st.booleans()) else 0
        k_start = draw(st.integers(0, q_start))
        end = q_start + m
        fields.update(q_start=q_start, k_start=k_start, num_window_keys=end - k_start)
        if draw(st.booleans()):  # projected rows: r per finished segment of l tokens
            segment, rank = draw(st.integers(1, min(window, 32))), draw(st.integers(1, 3))
            segments = end // segment if draw(st.booleans()) else draw(st.integers(0, end // segment))
            fields.update(segment_length=segment, projection_rank=rank, num_extra_keys=rank * segments)
    else:
        num_window_keys = m if window else 0
        fields.update(
            num_window_keys=num_window_keys, num_extra_keys=draw(st.integers(0 if num_window_keys else 1, 150))
        )
        if fields["num_extra_keys"] and draw(st.booleans()):  # in copies, each seen by a band of queries
            copies = draw(st.integers(2, 5))
            fields.update(
                num_extra_keys=copies * -(-fields["num_extra_keys"] // copies),
                extra_key_copies=copies,
                queries_per_copy=draw(st.sampled_from((1, 3, 8, 16, 50))),
            )
    spec = {
        "batch": draw(st.integers(1, 3)),
        "padding": draw(st.sampled_from(["none", "right", "left", "random"])),
        "offsets": draw(st.sampled_from(["none", "left padding", "random"])),
        "seed": draw(st.integers(0, 2**16)),
        "block_size": (draw(st.sampled_from(BLOCKS)), draw(st.sampled_from(BLOCKS))),
    }
    return fields, spec


def build(fields, spec) -> Case:
    """The ``Case`` of ``fields`` with the padding, offsets and block size of ``spec``: the last row padded (right: the
    last window keys; left: the first ones; random: every row, extra keys included); offsets each row's left padding,
    or random."""
    fields = dict(fields)
    num_queries = fields.pop("num_queries")
    layout = KeyLayout(**fields)
    generator = torch.Generator().manual_seed(spec["seed"])
    batch, L = spec["batch"], layout.num_window_keys
    key_valid = pads = None
    if spec["padding"] != "none":
        key_valid = torch.ones(batch, layout.num_keys, dtype=torch.bool)
        pads = torch.zeros(batch, dtype=torch.long)
        if spec["padding"] == "random":
            key_valid = torch.rand(batch, layout.num_keys, generator=generator) > 0.3
        else:
            pads[-1] = int(torch.randint(0, L + 1, (), generator=generator))
            key_valid[-1, L - pads[-1] : L] = False
            if spec["padding"] == "left":
                key_valid[-1, :L] = key_valid[-1, :L].flip(0)
    offsets = None
    if spec["offsets"] == "left padding" and spec["padding"] == "left":
        offsets = pads
    elif spec["offsets"] != "none":
        offsets = torch.randint(0, 40, (batch,), generator=generator)
    return Case(layout, num_queries, key_valid, offsets, spec["block_size"])


def reference_keep(case: Case) -> torch.Tensor:
    """(B, m, L + R): the paper's visibility with loops over positions. Query i of row b is at t = q_start + i -
    offset, window key j at k_start + j - offset; with s = (t // w) w and e = max(w // 2, 1), a bidirectional query
    sees [s - e, s + w + e) (Sec. 3.2), a causal one [s - w, t] (Appendix D); an extra key is always seen, or, a causal
    projected row j' = j - L, when its segment j' // r < t // l (Eq. 5), or, in C copies, when its copy j' // (R / C)
    is the query's band i // queries_per_copy (the last copy for every later band); an invalid key never."""
    lay, B = case.layout, case.batch
    L, w = lay.num_window_keys, lay.window_size
    valid = [[True] * lay.num_keys] * B if case.key_valid is None else case.key_valid.tolist()
    offsets = [0] * B if case.offsets is None else case.offsets.tolist()
    keep = torch.zeros(B, case.num_queries, lay.num_keys, dtype=torch.bool)
    for b in range(B):
        for i in range(case.num_queries):
            t = lay.q_start + i - offsets[b]
            for j in range(lay.num_keys):
                if j < L:
                    p, s = lay.k_start + j - offsets[b], (t // w) * w
                    e = max(w // 2, 1)
                    seen = s - w <= p <= t if lay.causal else s - e <= p < s + w + e
                elif lay.segment_length is not None:
                    seen = (j - L) // lay.projection_rank < t // lay.segment_length
                else:
                    copies = lay.extra_key_copies
                    seen = (j - L) // (lay.num_extra_keys // copies) == min(i // lay.queries_per_copy, copies - 1)
                keep[b, i, j] = seen and valid[b][j]
    return keep


def block_classes(block_mask):
    """(partial, full): (B, query blocks, key blocks) bool grids of a BlockMask's kv block lists (one head), the
    entries past each row's count ignored."""
    key_blocks = -(-block_mask.seq_lengths[1] // block_mask.BLOCK_SIZE[1])
    grids = []
    for counts, indices in (
        (block_mask.kv_num_blocks, block_mask.kv_indices),
        (block_mask.full_kv_num_blocks, block_mask.full_kv_indices),
    ):
        counts, indices = counts[:, 0].long().cpu(), indices[:, 0].long().cpu()
        chosen = torch.arange(indices.shape[-1]) < counts[..., None]
        grid = torch.zeros(*indices.shape[:-1], key_blocks + 1, dtype=torch.bool)
        grid.scatter_(-1, torch.where(chosen, indices, key_blocks), True)
        grids.append(grid[..., :key_blocks])
    return tuple(grids)


def dense_reference(q, k, v, keep):
    """Dense SDPA over the kept keys, in q's dtype; a query that keeps no key gets 0 (as FlexAttention gives)."""
    seen = keep.any(-1, keepdim=True)[:, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None] | ~seen)
    return out * seen


def qkv(case: Case, heads=2, qk_dim=8, v_dim=8, dtype=torch.float64, seed=0):
    """Random queries (B, H, m, qk_dim), keys (B, H, L + R, qk_dim) and values (B, H, L + R, v_dim)."""
    generator = torch.Generator().manual_seed(seed)
    keys = case.layout.num_keys
    return (
        torch.randn(case.batch, heads, length, dim, generator=generator, dtype=torch.float64).to(dtype)
        for length, dim in ((case.num_queries, qk_dim), (keys, qk_dim), (keys, v_dim))
    )


def padded_case(fields, valid_rows, offsets=None, block_size=16) -> Case:
    """``fields`` (with ``num_queries``) and ``key_valid`` True but where ``valid_rows`` {row: slice} says False."""
    fields = dict(fields)
    num_queries = fields.pop("num_queries")
    layout = KeyLayout(**fields)
    key_valid = torch.ones(
        len(offsets) if offsets is not None else max(valid_rows) + 1, layout.num_keys, dtype=torch.bool
    )
    for row, padding in valid_rows.items():
        key_valid[row, padding] = False
    return Case(layout, num_queries, key_valid, offsets, block_size)


# ------------------------------------------------------------------------------------------------------- rules
@SETTINGS
@given(drawn=layouts(max_queries=40, windows=(1, 2, 3, 5, 16)))
def test_mask_mod_matches_the_rules(drawn):
    case = build(*drawn)
    keep = create_mask(case.mask_mod(), case.batch, 1, case.num_queries, case.layout.num_keys, device="cpu")
    assert torch.equal(keep[:, 0], reference_keep(case))


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_rules_on_negative_positions(causal):
    """Floor division below position 0 (a left-padded row's padding, counted before its first real token): integers
    and tensors agree, and the window keeps its span."""
    t = torch.arange(-20, 20)
    low, high = rules.window_bounds(t, 3, causal)
    assert torch.equal(
        torch.stack([low, high]), torch.tensor([rules.window_bounds(i, 3, causal) for i in t.tolist()]).T
    )
    assert (high - low).min() >= (1 if causal else 5)
    assert torch.equal(rules.segment_rule(t, torch.tensor(-2), 4), t // 4 > -2)


# --------------------------------------------------------------------------------------------------- BlockMask
@SETTINGS
@given(drawn=layouts())
def test_block_mask_matches_create_block_mask(drawn):
    """Partial and full key blocks of every query block equal create_block_mask's, which evaluates every pair."""
    case = build(*drawn)
    ours = case.block_mask()
    expected = create_block_mask(
        case.mask_mod(),
        case.batch,
        None,
        case.num_queries,
        case.layout.num_keys,
        device="cpu",
        BLOCK_SIZE=case.block_size,
    )
    assert ours.seq_lengths == expected.seq_lengths and tuple(ours.BLOCK_SIZE) == tuple(expected.BLOCK_SIZE)
    assert ours.kv_indices.shape == expected.kv_indices.shape
    for got, want, kind in zip(block_classes(ours), block_classes(expected), ("partial", "full")):
        assert torch.equal(got, want), f"{kind} blocks differ at (row, query block, key block) {(got ^ want).nonzero()}"
    # the query blocks of each key block, as FlexAttention orders them from the key blocks of each query block
    by_query, by_key = lsb._MASK_TENSORS[:4], lsb._MASK_TENSORS[4:]
    transposed = BlockMask.from_kv_blocks(
        *(getattr(ours, name) for name in by_query), BLOCK_SIZE=ours.BLOCK_SIZE, seq_lengths=ours.seq_lengths
    )
    for name in by_key:
        assert torch.equal(getattr(ours, name), getattr(transposed, name)), name


def test_block_structure_at_the_benchmark_settings():
    """w = 256, 128-blocks, 4096 tokens. Bidirectional (r = 64 rows): a query block sees its segment and e = 128 keys on
    each side as 4 full key blocks (3 at the sequence's ends), plus the rows' block (64 keys: partial). Causal (l =
    16, r = 1: 256 rows in 2 blocks): 2 or 3 full window blocks and its diagonal block, the rows of the segments
    before its first query in full blocks and the block holding the others partly."""
    n = 4096
    bidirectional = KeyLayout(window_size=256, causal=False, num_window_keys=n, num_extra_keys=64)
    partial, full = block_classes(long_short_block_mask(bidirectional, num_queries=n))
    assert full[0].sum(-1).tolist() == [3, 3] + [4] * 28 + [3, 3]
    assert not partial[0, :, :32].any() and partial[0, :, 32].all()
    causal = KeyLayout(
        window_size=256, causal=True, num_window_keys=n, num_extra_keys=n // 16, segment_length=16, projection_rank=1
    )
    partial, full = block_classes(long_short_block_mask(causal, num_queries=n))
    assert full[0, :, :32].sum(-1).tolist() == [0, 1] + [2, 3] * 15
    assert torch.equal(partial[0, :, :32], torch.eye(32, dtype=torch.bool))
    # Query block i (positions [128 i, 128 i + 128)) sees rows [0, 8 i) from all its queries, [0, 8 i + 7) from some.
    assert full[0, :, 32:].tolist() == [[False, False]] * 16 + [[True, False]] * 16
    assert partial[0, :, 32:].tolist() == [[True, False]] * 16 + [[False, True]] * 16


def test_extra_key_copies_shorten_the_longest_key_block_loop():
    """Bidirectionally every query block sees the extra keys' block: in FlexAttention's backward pass, which loops over
    the query blocks that see a key block, that block's loop is the whole sequence's. In one copy per band of 1,024
    queries (``extra_key_copies``: 4 at 4,096 tokens, 64 rows each, two copies to a key block) each query block sees
    half a key block of them (partial) and no key block is seen by more than 16 query blocks, a window block by 4 at
    most; the window blocks are unchanged."""
    n = 4096
    one = KeyLayout(window_size=256, causal=False, num_window_keys=n, num_extra_keys=64)
    copies = lsb.extra_key_copies(n)
    banded = KeyLayout(
        window_size=256, causal=False, num_window_keys=n, num_extra_keys=64 * copies, extra_key_copies=copies
    )
    (partial_one, full_one), (partial, full) = (
        block_classes(long_short_block_mask(layout, num_queries=n)) for layout in (one, banded)
    )
    assert copies == 4
    assert torch.equal(full, F.pad(full_one, (0, 1))) and torch.equal(partial[..., :32], partial_one[..., :32])
    assert partial[0, :, 32:].tolist() == [[True, False]] * 16 + [[False, True]] * 16
    seen_by = (partial | full)[0].sum(0)  # query blocks per key block
    assert (partial_one | full_one)[0].sum(0).max() == 32 and seen_by.max() == 16 and seen_by[:32].max() == 4


def test_geometry_is_cached_per_shape():
    """A second call with the same shape (and another padding) reuses the geometry; with offsets each row's geometry
    is computed on the device, without the cache; without padding or offsets the mask itself is reused."""
    lsb._cached_block_geometry.cache_clear()
    layout = KeyLayout(window_size=16, causal=False, num_window_keys=300, num_extra_keys=8)
    valid = torch.ones(2, 308, dtype=torch.bool)
    long_short_block_mask(layout, num_queries=300, key_valid=valid)
    long_short_block_mask(layout, num_queries=300, key_valid=valid.flip(1))
    info = lsb._cached_block_geometry.cache_info()
    assert (info.hits, info.misses) == (1, 1)
    long_short_block_mask(layout, num_queries=300, offsets=torch.tensor([0, 5, 5]))
    assert lsb._cached_block_geometry.cache_info().misses == 1
    # without padding or offsets the whole mask is built once per shape, and every layer and call shares it
    assert long_short_block_mask(layout, num_queries=300) is long_short_block_mask(layout, num_queries=300)
    assert long_short_block_mask(layout, num_queries=300) is not long_short_block_mask(layout, num_queries=299)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"window_size": -1, "causal": False, "num_window_keys": 4}, "window_size must be an integer >= 0"),
        ({"window_size": 0, "causal": False, "num_window_keys": 4}, "num_window_keys must be 0"),
        ({"window_size": 2, "causal": False, "num_window_keys": 0}, "both 0"),
        ({"window_size": 2, "causal": True, "num_window_keys": 4, "segment_length": 2}, "pass both or neither"),
        (
            {
                "window_size": 2,
                "causal": False,
                "num_window_keys": 4,
                "num_extra_keys": 2,
                "segment_length": 2,
                "projection_rank": 1,
            },
            "causal attention only",
        ),
        (
            {
                "window_size": 2,
                "causal": True,
                "num_window_keys": 4,
                "num_extra_keys": 3,
                "segment_length": 2,
                "projection_rank": 2,
            },
            "multiple of projection_rank",
        ),
        ({"window_size": 2, "causal": True, "num_window_keys": 4, "q_start": 1.5}, "q_start must be an integer"),
        (
            {"window_size": 2, "causal": False, "num_window_keys": 4, "num_extra_keys": 5, "extra_key_copies": 2},
            "positive multiple",
        ),
        (
            {
                "window_size": 2,
                "causal": True,
                "num_window_keys": 4,
                "num_extra_keys": 4,
                "segment_length": 2,
                "projection_rank": 1,
                "extra_key_copies": 2,
            },
            "needs bidirectional extra keys",
        ),
        ({"window_size": 2, "causal": False, "num_window_keys": 4, "queries_per_copy": 0}, "queries_per_copy must"),
    ],
)
def test_malformed_layout_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        KeyLayout(**fields)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"num_queries": 0}, "num_queries must be an integer >= 1"),
        ({"num_queries": 4, "block_size": (16, 0)}, "block_size must be"),
        ({"num_queries": 4, "key_valid": torch.ones(2, 5, dtype=torch.bool)}, r"key_valid must be .* \(batch, 6\)"),
        ({"num_queries": 4, "key_valid": torch.ones(2, 6)}, "key_valid must be a bool tensor"),
        (
            {
                "num_queries": 4,
                "key_valid": torch.ones(2, 6, dtype=torch.bool),
                "offsets": torch.zeros(3, dtype=torch.long),
            },
            r"offsets must be an integer tensor \(batch,\) = \(2,\)",
        ),
        ({"num_queries": 4, "offsets": torch.zeros(2)}, "offsets must be an integer tensor"),
    ],
)
def test_malformed_call_is_refused(arguments, message):
    with pytest.raises(ValueError, match=message):
        long_short_block_mask(KeyLayout(window_size=2, causal=False, num_window_keys=4, num_extra_keys=2), **arguments)


# ------------------------------------------------------------------------------------------------ FlexAttention
FLEX_CASES = {  # (layout and num_queries, padding spec, qk head dim, v head dim); eager FlexAttention takes ~1 s for
    # each new layout
    "bidirectional": (
        {"num_queries": 37, "num_window_keys": 37, "num_extra_keys": 9, "window_size": 5, "causal": False},
        {"padding": "random", "offsets": "none", "block_size": (8, 16)},
        4,
        3,
    ),
    "bidirectional copies": (
        {
            "num_queries": 45,
            "num_window_keys": 45,
            "num_extra_keys": 3 * 7,
            "window_size": 5,
            "causal": False,
            "extra_key_copies": 3,
            "queries_per_copy": 16,
        },
        {"padding": "random", "offsets": "none", "block_size": (8, 16)},
        8,
        4,
    ),
    "rows only": (
        {"num_queries": 20, "num_window_keys": 0, "num_extra_keys": 6, "window_size": 0, "causal": False},
        {"padding": "right", "offsets": "none", "block_size": 8},
        16,
        16,
    ),
    "causal continuation": (
        {
            "num_queries": 40,
            "num_window_keys": 56,
            "num_extra_keys": 30,
            "window_size": 16,
            "causal": True,
            "q_start": 21,
            "k_start": 5,
            "segment_length": 4,
            "projection_rank": 2,
        },
        {"padding": "left", "offsets": "left padding", "block_size": (16, 8)},
        20,
        8,
    ),
    "causal offsets": (
        {"num_queries": 50, "num_window_keys": 50, "window_size": 3, "causal": True},
        {"padding": "right", "offsets": "random", "block_size": 24},
        8,
        16,
    ),
}


@pytest.mark.parametrize("flex_case", FLEX_CASES.values(), ids=FLEX_CASES)
def test_eager_flex_matches_dense_sdpa(flex_case):
    """FlexAttention with the BlockMask (eager: the mask_mod on every pair) equals dense SDPA over the rules' keys, a
    query without keys giving 0; head dims below 16 padded."""
    fields, spec, qk_dim, v_dim = flex_case
    case = build(fields, {**spec, "batch": 2, "seed": 0})
    q, k, v = qkv(case, qk_dim=qk_dim, v_dim=v_dim)
    out = flex_attend(q, k, v, case.block_mask())
    torch.testing.assert_close(out, dense_reference(q, k, v, reference_keep(case)), atol=EXACT, rtol=0)


def test_query_without_keys_gets_zero():
    """A row whose keys are all padding, and the left padding of a causal row (offsets: its positions are negative,
    its window holds padding only): FlexAttention gives those queries 0, as the dense reference defines."""
    fields = {
        "num_queries": 40,
        "window_size": 4,
        "causal": True,
        "num_window_keys": 40,
        "num_extra_keys": 6,
        "segment_length": 4,
        "projection_rank": 1,
    }
    case = padded_case(fields, {1: slice(0, 7), 2: slice(None)}, offsets=torch.tensor([0, 7, 0]))
    keep = reference_keep(case)
    assert not keep[1, :7].any() and not keep[2].any() and keep[1, 7:].any(-1).all()
    q, k, v = qkv(case)
    out = flex_attend(q, k, v, case.block_mask())
    assert not out[1, :, :7].any() and not out[2].any()
    torch.testing.assert_close(out, dense_reference(q, k, v, keep), atol=EXACT, rtol=0)


@pytest.mark.parametrize(("qk_dim", "v_dim"), [(1, 1), (4, 8), (8, 8), (15, 40), (24, 3)])
def test_head_dim_padding_is_exact(qk_dim, v_dim):
    """Zero-padding q, k (and v) to 16 features changes no score and no output feature: flex_attend equals unpadded
    FlexAttention at the original head dim's scale, default or given."""
    case = Case(KeyLayout(window_size=8, causal=False, num_window_keys=50, num_extra_keys=5), 50, None, None, 16)
    q, k, v = qkv(case, qk_dim=qk_dim, v_dim=v_dim)
    block_mask = case.block_mask()
    for scale in (None, 0.3):
        expected = flex_attention(q, k, v, block_mask=block_mask, scale=scale)
        out = flex_attend(q, k, v, block_mask, scale=scale)
        assert out.shape == expected.shape
        torch.testing.assert_close(out, expected, atol=EXACT, rtol=0)


@pytest.mark.compiled
def test_compiled_flex_honours_the_block_mask():
    """torch.compile'd FlexAttention on the CPU (the kernel that skips the left-out blocks and runs no mask_mod on full
    ones) with the BlockMask equals dense SDPA, float32, tolerance scaled to the outputs: causal continuation with
    projected rows, a left-padded row counted from its first token, a head dim of 8 (padded), lengths that are no
    multiple of the blocks. A partial block passed off as full changes the output: the kernel trusts the classes.
    From no earlier compilation: after another shape the kernel recompiles with symbolic lengths, which the CPU kernel
    fails to build for a padded batch (torch 2.11-2.14)."""
    torch._dynamo.reset()
    fields = {
        "num_queries": 260,
        "window_size": 64,
        "causal": True,
        "num_window_keys": 276,
        "num_extra_keys": 2 * (300 // 16),
        "q_start": 40,
        "k_start": 24,
        "segment_length": 16,
        "projection_rank": 2,
    }
    case = padded_case(fields, {1: slice(0, 50 - 24)}, offsets=torch.tensor([0, 50]), block_size=32)
    block_mask = case.block_mask()
    q, k, v = qkv(case, dtype=torch.float32)
    expected = dense_reference(*(x.double() for x in (q, k, v)), reference_keep(case))
    tolerance = 1e-5 * expected.abs().max().item()
    out = flex_attend(q, k, v, block_mask, compiled=True)
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=0)

    partial, full = block_classes(block_mask)
    assert full.any() and not (partial | full).all()  # blocks to trust and blocks to skip
    moved = partial[0, 3].nonzero()[0]  # the first partial key block of row 0's query block 3, passed off as full
    partial[0, 3, moved], full[0, 3, moved] = False, True
    wrong = BlockMask.from_kv_blocks(
        *lsb._ordered(partial),
        *lsb._ordered(full),
        BLOCK_SIZE=32,
        mask_mod=block_mask.mask_mod,
        seq_lengths=block_mask.seq_lengths,
    )
    assert (flex_attend(q, k, v, wrong, compiled=True).double() - expected).abs().max() > 100 * tolerance


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_block_mask_is_built_on_the_test_device(causal, device):
    """The mask is built where the keys are (on CUDA without a round trip through the CPU, offsets included) and
    equals create_block_mask's there, block class by block class."""
    n, rows = 700, 44 if causal else 64
    layout = KeyLayout(
        window_size=128,
        causal=causal,
        num_window_keys=n,
        num_extra_keys=rows,
        segment_length=16 if causal else None,
        projection_rank=1 if causal else None,
    )
    key_valid = torch.ones(2, n + rows, dtype=torch.bool, device=device)
    key_valid[1, :90] = False
    offsets = torch.tensor([0, 90], device=device) if causal else None
    ours = long_short_block_mask(layout, num_queries=n, key_valid=key_valid, offsets=offsets)
    assert ours.kv_indices.device.type == device.type
    mask_mod = long_short_mask_mod(layout, key_valid=key_valid, offsets=offsets)
    expected = create_block_mask(mask_mod, 2, None, n, n + rows, device=device)
    for got, want in zip(block_classes(ours), block_classes(expected)):
        assert torch.equal(got, want)


IN_GRAPH_CASES = {
    "bidirectional, copies, padding": (
        {"window_size": 16, "causal": False, "num_extra_keys": 24, "extra_key_copies": 3, "queries_per_copy": 128},
        300,
        {"padding": "random", "offsets": "none"},
    ),
    "bidirectional, no padding": ({"window_size": 64, "causal": False, "num_extra_keys": 8}, 700, {}),
    "rows only": ({"window_size": 0, "causal": False, "num_extra_keys": 6}, 130, {"padding": "right"}),
    "causal rows, left padding": (
        {"window_size": 16, "causal": True, "num_extra_keys": 2 * 37, "segment_length": 8, "projection_rank": 2},
        300,
        {"padding": "left", "offsets": "left padding"},
    ),
}


@pytest.mark.parametrize("in_graph_case", IN_GRAPH_CASES.values(), ids=IN_GRAPH_CASES)
def test_block_mask_built_in_a_compiled_graph_matches(in_graph_case, device):
    """Built inside one compiled graph, as the plan builds it in a caller's ``torch.compile`` (dynamo's eager backend,
    sizes symbolic; no cache read there: ``cached_outside_compile``): every tensor, the sizes and the mask_mod's mask
    equal ``long_short_block_mask``'s outside, built where the queries are."""
    fields, n, spec = in_graph_case
    extra = fields["num_extra_keys"]

    def layout_for(queries):
        return KeyLayout(**fields, num_window_keys=queries if fields["window_size"] else 0)

    def in_graph(query, key_valid, offsets):
        layout = layout_for(query.shape[1])  # its lengths symbolic, as the layer's are
        mask = long_short_block_mask(
            layout, num_queries=query.shape[1], key_valid=key_valid, offsets=offsets, device=query.device
        )
        b, q_idx, kv_idx = (torch.arange(size, device=query.device) for size in (len(query), *mask.seq_lengths))
        keep = mask.mask_mod(b[:, None, None], 0, q_idx[:, None], kv_idx)
        return [getattr(mask, name) for name in lsb._MASK_TENSORS], mask.seq_lengths, keep

    compiled = torch.compile(in_graph, backend="eager", dynamic=True, fullgraph=True)
    for queries in (n, n + 50):
        defaults = {"batch": 2, "seed": 0, "padding": "none", "offsets": "none", "block_size": lsb.DEFAULT_BLOCK_SIZE}
        case = build({**layout_for(queries).__dict__, "num_queries": queries}, {**defaults, **spec})
        key_valid, offsets = (x if x is None else x.to(device) for x in (case.key_valid, case.offsets))
        query = torch.zeros(2, queries, 1, 8, device=device)
        tensors, seq_lengths, keep = compiled(query, key_valid, offsets)
        expected = long_short_block_mask(case.layout, num_queries=queries, key_valid=key_valid, offsets=offsets)
        assert tuple(seq_lengths) == expected.seq_lengths == (queries, queries * bool(fields["window_size"]) + extra)
        for name, tensor in zip(lsb._MASK_TENSORS, tensors):
            want = getattr(expected, name)
            assert tensor.dtype == want.dtype == torch.int32 and torch.equal(tensor, want), name
        mask_mod = long_short_mask_mod(case.layout, key_valid=key_valid, offsets=offsets)
        expected_keep = create_mask(mask_mod, 2, 1, *expected.seq_lengths, device=device)[:, 0]
        assert torch.equal(keep.expand_as(expected_keep), expected_keep)

"""Cached generation of LongShortForCausalLM: the LongShortCache holds O(w + r n / l) and changes no token."""

import pytest
import torch
from transformers import DynamicCache, GenerationConfig

from ls_hf import LongShortCache, LongShortForCausalLM
from ls_hf.modeling_long_short import CACHE_NAME

from .test_modeling import VOCAB, tiny_config, tokens


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = tiny_config(is_decoder=True, window_size=4, projection_rank=2, causal_segment_length=3)
    model = LongShortForCausalLM(config).eval()
    # no eos: every sequence runs to max_new_tokens, across many window (4) and segment (3) boundaries
    model.generation_config = GenerationConfig(bos_token_id=0, pad_token_id=1, eos_token_id=None)
    return model


def generate(model, prompt, use_cache, **kwargs):
    torch.manual_seed(1234)
    return model.generate(prompt, max_new_tokens=12, use_cache=use_cache, **kwargs)


@pytest.mark.parametrize(
    "mode",
    [
        {"do_sample": False},
        {"do_sample": True, "top_k": 20, "temperature": 1.5},
        {"do_sample": False, "num_beams": 3, "num_return_sequences": 2},
        {"do_sample": True, "num_beams": 2},
    ],
    ids=["greedy", "sample", "beam", "beam_sample"],
)
def test_cached_and_uncached_generation_give_the_same_tokens(model, mode):
    prompt = tokens(2, 11)
    cached = generate(model, prompt, use_cache=True, **mode)
    uncached = generate(model, prompt, use_cache=False, **mode)
    assert cached.shape == (2 * mode.get("num_return_sequences", 1), 11 + 12)
    assert torch.equal(cached, uncached)


def test_left_padded_batch_generates_the_same_with_and_without_cache(model):
    prompt = tokens(2, 12)
    mask = torch.ones_like(prompt)
    prompt[1, :5], mask[1, :5] = 1, 0
    cached = generate(model, prompt, use_cache=True, attention_mask=mask, do_sample=False)
    uncached = generate(model, prompt, use_cache=False, attention_mask=mask, do_sample=False)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("use_cache", [True, False], ids=["cached", "uncached"])
def test_left_padded_greedy_generation_matches_a_loop_of_full_forwards(model, use_cache):
    """generate builds its own positions from the attention mask; a plain full forward takes them from the ids (pad
    = padding). Rows with 0, 2 and 5 left pads must get the tokens of a greedy loop over full masked forwards."""
    prompt = tokens(3, 10, seed=3)
    mask = torch.ones_like(prompt)
    for row, pad in ((1, 2), (2, 5)):
        prompt[row, :pad], mask[row, :pad] = 1, 0
    generated = generate(model, prompt, use_cache=use_cache, attention_mask=mask, do_sample=False)
    ids, ones = prompt, torch.ones(3, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(12):
            next_token = model(ids, attention_mask=mask).logits[:, -1].argmax(-1, keepdim=True)
            ids, mask = torch.cat([ids, next_token], 1), torch.cat([mask, ones], 1)
    assert (ids[:, 10:] > 2).all()  # no generated special token, which the full forward would take for padding
    assert torch.equal(generated, ids)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("use_cache", [True, False], ids=["cached", "uncached"])
def test_left_padding_does_not_change_what_a_row_generates(model, use_cache, seed):
    """Batched greedy generation with random left padding gives each row the tokens, and to rounding the logits, that
    it gets alone without padding: every row counts its windows (w=4) and projection segments (l=3) from its first
    real token, in the prompt's forward and in every cached step."""
    generator = torch.Generator().manual_seed(seed)
    prompt = tokens(5, 11, seed=seed)
    pads = torch.randint(0, 9, (5,), generator=generator)
    mask = (torch.arange(11)[None] >= pads[:, None]).long()
    prompt = torch.where(mask.bool(), prompt, 1)
    batched = generate(
        model,
        prompt,
        use_cache=use_cache,
        attention_mask=mask,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    for row, pad in enumerate(pads.tolist()):
        alone = generate(
            model,
            prompt[row : row + 1, pad:],
            use_cache=use_cache,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        assert torch.equal(batched.sequences[row, 11:], alone.sequences[0, 11 - pad :])
        torch.testing.assert_close(
            torch.stack(batched.logits)[:, row], torch.stack(alone.logits)[:, 0], rtol=0, atol=1e-4
        )


def test_generate_uses_a_long_short_cache_of_bounded_size(model):
    out = model.generate(tokens(1, 9), max_new_tokens=40, do_sample=False, return_dict_in_generate=True)
    cache = out.past_key_values
    assert isinstance(cache, LongShortCache) and len(cache.layers) == 2
    seen = 9 + 40 - 1  # the last token is sampled, not fed
    assert cache.get_seq_length() == seen
    w, r, l = 4, 2, 3
    for layer in cache.layers:
        state = layer.state
        assert state.keys.shape[1] <= 2 * w  # only the last window segments of raw keys
        assert state.rows_k.shape[1] == r * (seen // l)  # r projected rows per finished segment
        assert state.pending.shape[1] == seen % l


def test_step_by_step_forward_with_cache_matches_the_full_forward(model):
    ids = tokens(2, 23)
    with torch.no_grad():
        full = model(ids).logits
        cache = LongShortCache(model.config)
        steps = [model(ids[:, :5], past_key_values=cache, use_cache=True).logits]
        for t in range(5, 23):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            assert out.past_key_values is cache
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_step_by_step_decoding_of_a_left_padded_batch_matches_the_full_forward(model):
    """A hand-written decoding loop passes a mask over past + new tokens: its positions must skip the left padding as
    the full forward's do (generate passes position_ids, this loop does not)."""
    ids = tokens(2, 14)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 1, 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache = LongShortCache(model.config)
        steps = [model(ids[:, :6], attention_mask=mask[:, :6], past_key_values=cache, use_cache=True).logits]
        for t in range(6, 14):
            steps.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache).logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_cached_step_checks_the_attention_mask_shape(model):
    ids = tokens(2, 8)
    cache = LongShortCache(model.config)
    with torch.no_grad():
        model(ids[:, :6], past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match=r"= \(2, 2\) or \(batch, cached \+ new tokens\) = \(2, 8\).*got \(2, 7\)"):
            model(ids[:, 6:], attention_mask=torch.ones(2, 7), past_key_values=cache)
        assert cache.get_seq_length() == 6
        model(ids[:, 6:], attention_mask=torch.ones(2, 8), past_key_values=cache)
    assert cache.get_seq_length() == 8


@pytest.mark.parametrize("cache_implementation", ["static", "dynamic"])
def test_cache_implementation_is_refused_clearly(model, cache_implementation):
    match = f"only with LongShortCache.*drop cache_implementation='{cache_implementation}'"
    with pytest.raises(ValueError, match=match):
        model.generate(tokens(1, 5), max_new_tokens=2, cache_implementation=cache_implementation)


STATE_TENSORS = (
    "keys",
    "values",
    "valid",
    "rows_k",
    "rows_v",
    "rows_valid",
    "pending",
    "offsets",
)  # all of CausalState's


def padded_batch():
    """3 rows of 10 tokens, the first with 5 left pads: its first segment (l=3) and window key 4 are padding."""
    ids = tokens(3, 10)
    mask = torch.ones_like(ids)
    ids[0, :5], mask[0, :5] = 1, 0
    return ids, mask


def cache_of(model, ids, mask):
    cache = LongShortCache(model.config)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    return cache


def assert_same_cache(got, expected):
    assert got.get_seq_length() == expected.get_seq_length()
    for got_layer, expected_layer in zip(got.layers, expected.layers, strict=True):
        for name in STATE_TENSORS:
            got_tensor, expected_tensor = getattr(got_layer.state, name), getattr(expected_layer.state, name)
            torch.testing.assert_close(got_tensor, expected_tensor, atol=1e-5, rtol=1e-5, msg=name)


def test_cache_batch_operations_follow_the_beams(model):
    ids, mask = padded_batch()
    beams = torch.tensor([2, 0, 0])
    cache = cache_of(model, ids, mask)
    cache.reorder_cache(beams)
    assert_same_cache(cache, cache_of(model, ids[beams], mask[beams]))
    longer_ids = torch.cat([ids[beams], tokens(3, 1, seed=1)], 1)
    longer_mask = torch.cat([mask[beams], torch.ones(3, 1, dtype=torch.long)], 1)
    with torch.no_grad():
        step = model(longer_ids[:, -1:], attention_mask=longer_mask, past_key_values=cache, use_cache=True).logits
        expected = model(longer_ids, attention_mask=longer_mask).logits[:, -1:]
    torch.testing.assert_close(step, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(1)
    cache.reset()
    assert cache.get_seq_length() == 0


def test_cache_batch_select_and_repeat_interleave_keep_each_row_with_its_sequence(model):
    """Contrastive search selects rows and beam search repeats them: the cache must become the one that the selected
    (repeated) rows build, every tensor (window, projected rows, their validity, pending inputs) included."""
    ids, mask = padded_batch()  # w=4, l=3: window keys of positions 4-9, 3 segments of rows and 1 pending input
    cache = cache_of(model, ids, mask)
    assert all(getattr(cache.layers[0].state, name) is not None for name in STATE_TENSORS)
    cache.batch_select_indices(torch.tensor([2, 0]))
    assert_same_cache(cache, cache_of(model, ids[[2, 0]], mask[[2, 0]]))
    cache.batch_repeat_interleave(2)
    assert_same_cache(cache, cache_of(model, ids[[2, 2, 0, 0]], mask[[2, 2, 0, 0]]))


def test_the_cache_by_either_name(model):
    """``cache`` (Transformers >= 5.24) and ``past_key_values`` (its name before) are one argument, and the output
    holds the cache under the installed version's name; both names at once are refused."""
    ids = tokens(1, 6)
    by_new_name, by_old_name = LongShortCache(model.config), LongShortCache(model.config)
    with torch.no_grad():
        new = model(ids, cache=by_new_name, use_cache=True)
        old = model(ids, past_key_values=by_old_name, use_cache=True)
    assert by_new_name.get_seq_length() == by_old_name.get_seq_length() == 6
    assert torch.equal(new.logits, old.logits) and getattr(new, CACHE_NAME) is by_new_name
    with pytest.raises(ValueError, match="not both"):
        model(ids, cache=by_new_name, past_key_values=by_old_name)


def test_a_foreign_cache_is_refused_clearly(model):
    with pytest.raises(ValueError, match="LongShortCache"):
        model(tokens(1, 4), past_key_values=DynamicCache(), use_cache=True)


def test_logits_to_keep(model):
    ids = tokens(1, 10)
    with torch.no_grad():
        assert model(ids, logits_to_keep=1).logits.shape == (1, 1, VOCAB)
        torch.testing.assert_close(model(ids, logits_to_keep=3).logits, model(ids).logits[:, -3:])


def test_generation_beyond_the_position_limit_is_refused_before_the_first_step(model):
    limit = model.config.max_input_length
    with pytest.raises(ValueError, match=rf"prompt \(20 tokens\).*{limit + 1} tokens.*max_new_tokens={limit - 20}"):
        model.generate(tokens(1, 20), max_new_tokens=limit - 19, do_sample=False)
    assert model.generate(tokens(1, 20), max_new_tokens=limit - 20, do_sample=False).shape == (1, limit)


@pytest.mark.parametrize("extra", [0, 5])
def test_a_prompt_that_fills_the_position_table_must_be_cut(model, extra):
    """A prompt of the model's length or longer leaves no position for a new token: the error says to cut it to at
    most max_input_length - 1 tokens, not to generate no token (max_new_tokens=0)."""
    limit = model.config.max_input_length
    with pytest.raises(
        ValueError, match=rf"prompt has {limit + extra} tokens.*Cut the prompt.*at most {limit - 1}"
    ) as e:
        model.generate(tokens(1, limit + extra), max_new_tokens=1, do_sample=False)
    assert "max_new_tokens=0" not in str(e.value)

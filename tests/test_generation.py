"""Cached generation of LongShortForCausalLM: the LongShortCache holds O(w + r n / l) and changes no token."""

import pytest
import torch
from transformers import DynamicCache, GenerationConfig

from ls_hf import LongShortCache, LongShortForCausalLM

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


def test_cache_batch_operations_follow_the_beams(model):
    ids = tokens(3, 10)
    with torch.no_grad():
        cache = LongShortCache(model.config)
        model(ids, past_key_values=cache, use_cache=True)
        cache.reorder_cache(torch.tensor([2, 0, 0]))
        step = model(ids[[2, 0, 0], :1], past_key_values=cache, use_cache=True).logits
        expected = model(torch.cat([ids[[2, 0, 0]], ids[[2, 0, 0], :1]], 1)).logits[:, -1:]
    torch.testing.assert_close(step, expected, atol=1e-5, rtol=1e-5)
    cache.batch_select_indices(torch.tensor([1]))
    cache.batch_repeat_interleave(2)
    assert all(layer.state.keys.shape[0] == 2 for layer in cache.layers)
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(1)
    cache.reset()
    assert cache.get_seq_length() == 0


def test_a_foreign_cache_is_refused_clearly(model):
    with pytest.raises(ValueError, match="LongShortCache"):
        model(tokens(1, 4), past_key_values=DynamicCache(), use_cache=True)


def test_logits_to_keep(model):
    ids = tokens(1, 10)
    with torch.no_grad():
        assert model(ids, logits_to_keep=1).logits.shape == (1, 1, VOCAB)
        torch.testing.assert_close(model(ids, logits_to_keep=3).logits, model(ids).logits[:, -3:])

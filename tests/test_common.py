"""Our own versions of checks from Transformers' common model and generation tests (``ModelTesterMixin``,
``GenerationTesterMixin``), adapted to the LongShort heads: gradients through returned attention maps and hidden
states, one position rule for the full forward, a cached step and ``generate``, and a cache that refuses cropping."""

import pytest
import torch

from ls_hf import LongShortCache, LongShortForCausalLM, LongShortModel
from ls_hf.modeling_long_short import roberta_position_ids

from .test_char_lm_xl import tiny_xl
from .test_modeling import HEADS, head_inputs, tiny_config, tokens


@pytest.mark.parametrize(
    "model_class, overrides", [(h[0], h[3]) for h in HEADS], ids=lambda v: getattr(v, "__name__", "")
)
def test_retain_grad_hidden_states_attentions(model_class, overrides):
    """``outputs.attentions[i]`` and ``outputs.hidden_states[i]`` are the tensors the output was computed from, so
    ``retain_grad()`` on them gets a gradient (attribution), in the documented (B, H, n, R + S) layout."""
    config = tiny_config(**overrides)
    model = model_class(config).train()
    inputs = {k: v for k, v in head_inputs(model_class).items() if k == "input_ids"}
    outputs = model(**inputs, output_hidden_states=True, output_attentions=True)
    assert (
        len(outputs.attentions) == config.num_hidden_layers
        and len(outputs.hidden_states) == 1 + config.num_hidden_layers
    )
    n = inputs["input_ids"].shape[-1]
    for attentions in outputs.attentions:
        assert attentions.shape[:3] == (outputs.hidden_states[0].shape[0], config.num_attention_heads, n)
    outputs.hidden_states[0].retain_grad()
    outputs.attentions[0].retain_grad()
    output = outputs[0]
    output.flatten()[0].backward(retain_graph=True)
    assert outputs.hidden_states[0].grad is not None and outputs.attentions[0].grad is not None
    assert outputs.attentions[0].grad.abs().sum() > 0


def _masked_batch(length, seed=0):
    """A batch whose mask zeroes tokens that are not padding ids (the case where an ids-based rule would differ)."""
    ids = tokens(3, length, seed=seed)
    mask = torch.ones_like(ids)
    mask[0, 2] = mask[1, :3] = mask[2, 5] = 0
    return ids, mask


def test_one_position_rule_from_the_attention_mask():
    ids, mask = _masked_batch(9)
    positions = roberta_position_ids(1, input_ids=ids, attention_mask=mask)
    assert positions[1].tolist() == [1, 1, 1, 2, 3, 4, 5, 6, 7]  # pad_token_id=1: masked tokens at 1, then 2, 3, ...
    assert positions[0].tolist() == [2, 3, 1, 4, 5, 6, 7, 8, 9]
    assert torch.equal(roberta_position_ids(1, input_ids=ids.masked_fill(mask == 0, 1)), positions)  # ids alone
    # a mask over cached + new tokens and the new tokens' part alone after `past_length` unmasked cached tokens
    assert torch.equal(
        roberta_position_ids(1, input_ids=ids[:, 6:], attention_mask=mask, past_length=6), positions[:, 6:]
    )
    ones = torch.ones(3, 3, dtype=torch.long)
    assert roberta_position_ids(1, input_ids=ids[:, :3], attention_mask=ones, past_length=4)[0].tolist() == [6, 7, 8]
    embeds = torch.zeros(2, 4, 8)
    assert roberta_position_ids(1, inputs_embeds=embeds)[0].tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("overrides", [{}, {"is_decoder": True}], ids=["bidirectional", "causal"])
def test_forward_positions_follow_the_mask(overrides):
    """A masked real token takes no position in the plain forward, as in a cached step and ``generate``: the same
    output as with the masked tokens replaced by the pad id."""
    backbone = LongShortModel(tiny_config(**overrides)).double().eval()
    ids, mask = _masked_batch(13)
    with torch.no_grad():
        got = backbone(input_ids=ids, attention_mask=mask).last_hidden_state
        padded = backbone(input_ids=ids.masked_fill(mask == 0, 1), attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(got[real], padded[real], atol=1e-12, rtol=0)


@pytest.fixture(scope="module")
def causal_lm():
    torch.manual_seed(0)
    config = tiny_config(is_decoder=True, window_size=4, projection_rank=2, causal_segment_length=3)
    model = LongShortForCausalLM(config).double().eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 1, None
    return model


def test_decoder_model_past_with_large_inputs(causal_lm):
    """Prefill with a mask that zeroes real (non-pad) tokens, then 3 new tokens in one cached step: the same hidden
    states as one full forward of the whole sequence with the whole mask."""
    ids, mask = _masked_batch(14, seed=1)
    next_ids = tokens(3, 3, seed=2)
    next_mask = torch.ones(3, 3, dtype=torch.long)
    next_mask[1, 1] = 0
    full_ids, full_mask = torch.cat([ids, next_ids], 1), torch.cat([mask, next_mask], 1)
    with torch.no_grad():
        full = causal_lm.long_short(input_ids=full_ids, attention_mask=full_mask).last_hidden_state
        cache = LongShortCache(causal_lm.config)
        prefill = causal_lm.long_short(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        step = causal_lm.long_short(input_ids=next_ids, attention_mask=full_mask, past_key_values=cache, use_cache=True)
    torch.testing.assert_close(prefill.last_hidden_state, full[:, :14], atol=1e-12, rtol=0)
    torch.testing.assert_close(
        step.last_hidden_state[full_mask[:, 14:].bool()], full[:, 14:][full_mask[:, 14:].bool()], atol=1e-12, rtol=0
    )


def test_generate_first_step_matches_forward(causal_lm):
    """``generate``'s first scores are the logits of a plain forward with the same mask (zeros on real tokens)."""
    ids, mask = _masked_batch(10, seed=3)
    out = causal_lm.generate(
        ids, attention_mask=mask, max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    with torch.no_grad():
        logits = causal_lm(input_ids=ids, attention_mask=mask).logits[:, -1]
    # generate hands back float32 logits: equal to the float64 forward's up to that rounding (|logits| < 1 here)
    assert logits.abs().max() < 1
    torch.testing.assert_close(out.logits[0].double(), logits, atol=1e-7, rtol=0)
    # and its second step is the full forward on prompt + first token
    longer = torch.cat([ids, out.sequences[:, 10:11]], 1)
    longer_mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
    with torch.no_grad():
        second = causal_lm(input_ids=longer, attention_mask=longer_mask).logits[:, -1]
    torch.testing.assert_close(out.logits[1].double(), second, atol=1e-7, rtol=0)


@pytest.mark.parametrize("model_name", ["long_short", "long_short_xl"])
@pytest.mark.parametrize("decoding", ["prompt_lookup", "assisted"])
def test_assisted_decoding_is_refused_before_any_token(causal_lm, model_name, decoding):
    """The cache cannot be cropped, so Transformers refuses assisted and prompt-lookup decoding before any token:
    up front by ``_is_stateful`` (Transformers < 5.25), or after the prompt's forward by the cache layers'
    ``is_croppable``."""
    model = causal_lm if model_name == "long_short" else tiny_xl()
    kwargs = {"prompt_lookup_num_tokens": 2} if decoding == "prompt_lookup" else {"assistant_model": model}
    prompt = tokens(1, 6) % model.config.vocab_size
    with pytest.raises(ValueError, match="not supported with stateful models|requires a cache that can be cropped"):
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False, **kwargs)

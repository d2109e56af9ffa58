"""Conformance of the LongShort model family: our own version of what Transformers' common model tests check."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForMultipleChoice,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    RobertaConfig,
    RobertaForMaskedLM,
    RobertaForMultipleChoice,
    RobertaForQuestionAnswering,
    RobertaForSequenceClassification,
    RobertaForTokenClassification,
)
from transformers.modeling_outputs import (
    BaseModelOutputWithPoolingAndCrossAttentions,
    CausalLMOutputWithPast,
    MaskedLMOutput,
    MultipleChoiceModelOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)

import ls_hf
from ls_hf import (
    ROBERTA_KEY_MAPPING,
    LongShortConfig,
    LongShortForCausalLM,
    LongShortForMaskedLM,
    LongShortForMultipleChoice,
    LongShortForQuestionAnswering,
    LongShortForSequenceClassification,
    LongShortForTokenClassification,
    LongShortModel,
)
from tests.devices import assert_close

VOCAB = 99


def tiny_config(**overrides) -> LongShortConfig:
    """A 2-layer, 32-wide LongShort config (w=4, r=3; causal: l=2) without dropout."""
    kwargs = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "max_position_embeddings": 130,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "window_size": 4,
        "projection_rank": 3,
        "causal_segment_length": 2,
        "num_labels": 3,
    }
    if overrides.get("is_decoder"):
        kwargs["projection_rank"] = 2
    return LongShortConfig(**{**kwargs, **overrides})


def enable_checkpointing(model) -> None:
    """Transformers' activation checkpointing, under its name in the version installed (renamed after 5.17)."""
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()


def tokens(batch=2, length=19, seed=0):
    """Random non-special token ids (>= 3: no pad/bos/eos)."""
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


HEADS = [
    (LongShortModel, AutoModel, BaseModelOutputWithPoolingAndCrossAttentions, {}),
    (LongShortForMaskedLM, AutoModelForMaskedLM, MaskedLMOutput, {}),
    (LongShortForCausalLM, AutoModelForCausalLM, CausalLMOutputWithPast, {"is_decoder": True}),
    (LongShortForSequenceClassification, AutoModelForSequenceClassification, SequenceClassifierOutput, {}),
    (LongShortForTokenClassification, AutoModelForTokenClassification, TokenClassifierOutput, {}),
    (LongShortForQuestionAnswering, AutoModelForQuestionAnswering, QuestionAnsweringModelOutput, {"num_labels": 2}),
    (LongShortForMultipleChoice, AutoModelForMultipleChoice, MultipleChoiceModelOutput, {}),
]


def head_inputs(model_class, batch=2, length=19):
    """Inputs with labels for each head (multiple choice: 3 choices)."""
    ids = tokens(batch, length)
    if model_class is LongShortForMultipleChoice:
        return {"input_ids": ids[:, None].expand(-1, 3, -1).contiguous(), "labels": torch.tensor([0, 2])}
    labels = {
        LongShortForMaskedLM: {"labels": ids},
        LongShortForCausalLM: {"labels": ids},
        LongShortForSequenceClassification: {"labels": torch.tensor([0, 2])},
        LongShortForTokenClassification: {"labels": ids % 3},
        LongShortForQuestionAnswering: {"start_positions": torch.tensor([1, 3]), "end_positions": torch.tensor([4, 5])},
    }.get(model_class, {})
    if model_class is LongShortForQuestionAnswering:
        ids[:, 4] = 2  # a separator: the 4 tokens before it are the question, global by default
    return {"input_ids": ids, **labels}


# global tokens each head makes by default (Longformer's): the first token, or the question
DEFAULT_GLOBAL = {
    LongShortForSequenceClassification: 1,
    LongShortForMultipleChoice: 1,
    LongShortForQuestionAnswering: 4,
}


@pytest.mark.parametrize(
    "model_class, auto_class, output_class, overrides", HEADS, ids=lambda v: getattr(v, "__name__", "")
)
def test_heads_auto_registration_outputs_and_loss(model_class, auto_class, output_class, overrides, device, dtype):
    config = tiny_config(**overrides)
    model = auto_class.from_config(config).to(device, dtype)
    assert type(model) is model_class
    inputs = {name: tensor.to(device) for name, tensor in head_inputs(model_class).items()}
    outputs = model(**inputs, output_hidden_states=True, output_attentions=True)
    assert type(outputs) is output_class
    B = 2 * (3 if model_class is LongShortForMultipleChoice else 1)
    assert len(outputs.hidden_states) == config.num_hidden_layers + 1
    assert all(h.shape == (B, 19, 32) for h in outputs.hidden_states)
    # each query: its weights over K global keys, R projected rows, S window keys, then (K) the global queries' weights
    R = 2 * (19 // 2) if config.is_decoder else 3  # causal: r rows per finished segment of l = 2
    S = 2 * 4
    K = DEFAULT_GLOBAL.get(model_class, 0)
    assert [a.shape for a in outputs.attentions] == [(B, 4, 19, K + R + S + K)] * 2
    sums = outputs.attentions[0][:, :, K:, : K + R + S].sum(-1)
    assert_close(sums, torch.ones(B, 4, 19 - K, dtype=torch.float64), atol=1e-6)
    if model_class is not LongShortModel:
        assert outputs.loss is not None and outputs.loss.ndim == 0 and torch.isfinite(outputs.loss)
        outputs.loss.backward()
        as_tuple = model(**inputs, return_dict=False)
        assert isinstance(as_tuple, tuple)
        assert_close(as_tuple[0], outputs.loss, atol=1e-12, dtype=dtype)  # explicit softmax above, SDPA here


def test_masked_lm_refuses_causal_config_and_causal_lm_refuses_bidirectional():
    with pytest.raises(ValueError, match="is_decoder=False"):
        LongShortForMaskedLM(tiny_config(is_decoder=True))
    with pytest.raises(ValueError, match="is_decoder=True"):
        LongShortForCausalLM(tiny_config())


@pytest.mark.parametrize(
    "model_class, auto_class",
    [
        (LongShortForSequenceClassification, AutoModelForSequenceClassification),
        (LongShortForMultipleChoice, AutoModelForMultipleChoice),
    ],
    ids=lambda v: v.__name__,
)
def test_first_token_heads_refuse_a_causal_config(tmp_path, model_class, auto_class):
    """Causally <s> sees only itself, so a head pooling it would ignore the text; loading a causal checkpoint with
    is_decoder=False gives the same weights a working head."""
    with pytest.raises(ValueError, match="first token.*is_decoder=False"):
        model_class(tiny_config(is_decoder=True))
    LongShortForCausalLM(tiny_config(is_decoder=True)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="is_decoder=False"):
        auto_class.from_pretrained(tmp_path)
    model = auto_class.from_pretrained(tmp_path, is_decoder=False)
    assert type(model) is model_class and not model.config.is_decoder


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_converted_roberta_reproduces_roberta(tmp_path, attn_implementation):
    """A RoBERTa checkpoint loads with ROBERTA_KEY_MAPPING; with use_dual_ln=False, r=0 and a window covering the
    input the LongShort model computes RoBERTa's outputs with every head (num_labels=2: QA's start and end logits,
    compared apart). initializer_range=0.2 makes the weights large enough that a misused input shows beyond atol."""
    roberta_config = RobertaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_attention_heads=4,
        num_hidden_layers=2,
        intermediate_size=64,
        max_position_embeddings=40,
        type_vocab_size=1,
        layer_norm_eps=1e-5,
        num_labels=2,
        initializer_range=0.2,
        attn_implementation=attn_implementation,
    )
    config = LongShortConfig.from_roberta(roberta_config, window_size=32, projection_rank=0, use_dual_ln=False)
    ids = tokens(6, 30)
    mask = torch.ones_like(ids)
    ids[1::2, 21:], mask[1::2, 21:] = config.pad_token_id, 0
    ids[:, 5] = config.sep_token_id  # question answering's default global tokens: the 5 before it
    real = mask.bool()
    torch.manual_seed(0)
    for roberta_class, ours_class, output_names in (
        (RobertaForMaskedLM, LongShortForMaskedLM, ["logits"]),
        (RobertaForSequenceClassification, LongShortForSequenceClassification, ["logits"]),
        (RobertaForTokenClassification, LongShortForTokenClassification, ["logits"]),
        (RobertaForQuestionAnswering, LongShortForQuestionAnswering, ["start_logits", "end_logits"]),
        (RobertaForMultipleChoice, LongShortForMultipleChoice, ["logits"]),
    ):
        roberta = roberta_class(roberta_config).eval()
        roberta.save_pretrained(tmp_path / roberta_class.__name__)
        ours, info = ours_class.from_pretrained(
            tmp_path / roberta_class.__name__, config=config, key_mapping=ROBERTA_KEY_MAPPING, output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
        inputs = {"input_ids": ids, "attention_mask": mask}
        if ours_class is LongShortForMultipleChoice:
            inputs = {name: x.view(2, 3, 30) for name, x in inputs.items()}  # 2 questions, 3 choices each
        with torch.no_grad():
            expected, got = roberta(**inputs), ours(**inputs)
        for name in output_names:
            want, have = expected[name], got[name]
            if want.shape[:2] == ids.shape:  # per-token outputs: only real tokens (padded ones differ)
                want, have = want[real], have[real]
            torch.testing.assert_close(have, want, atol=1e-4, rtol=1e-4, msg=f"{ours_class.__name__}.{name}")


def test_heads_set_longformer_global_defaults_and_a_given_mask_wins():
    """Sequence classification and multiple choice: the first token global; question answering: the tokens before the
    first separator. A given global_attention_mask (zeros: no global token) replaces the default."""
    torch.manual_seed(0)
    config = tiny_config(num_labels=2)
    ids = tokens(2, 19)
    ids[0, 6], ids[1, 3] = config.sep_token_id, config.sep_token_id
    none = torch.zeros_like(ids)
    first = none.clone()
    first[:, 0] = 1
    question = (torch.arange(19) < torch.tensor([[6], [3]])).long()
    for model_class, default in (
        (LongShortForSequenceClassification, first),
        (LongShortForQuestionAnswering, question),
    ):
        model = model_class(config).eval()
        with torch.no_grad():
            got = model(ids).to_tuple()
            given = model(ids, global_attention_mask=default).to_tuple()
            plain = model(ids, global_attention_mask=none).to_tuple()
        torch.testing.assert_close(got, given, atol=0, rtol=0)
        assert not torch.allclose(got[0], plain[0])
    model = LongShortForMultipleChoice(config).eval()
    choices = ids[:, None].expand(-1, 3, -1)
    with torch.no_grad():
        torch.testing.assert_close(
            model(choices).logits,
            model(choices, global_attention_mask=first[:, None].expand(-1, 3, -1)).logits,
            atol=0,
            rtol=0,
        )
    with pytest.raises(ValueError, match=r"rows \[0, 1\] hold no separator token"):
        LongShortForQuestionAnswering(config)(tokens(2, 19))


def test_global_tokens_refused_by_causal_models_and_checked_for_shape():
    causal = LongShortForCausalLM(tiny_config(is_decoder=True))
    ids = tokens(2, 9)
    with pytest.raises(ValueError, match="global_attention_mask needs bidirectional attention"):
        causal(ids, global_attention_mask=torch.ones_like(ids))
    with pytest.raises(ValueError, match=r"global_attention_mask must have shape \(batch, tokens\) = \(2, 9\)"):
        LongShortModel(tiny_config())(ids, global_attention_mask=torch.ones(2, 8))
    with pytest.raises(ValueError, match="global_projections"):
        tiny_config(is_decoder=True, global_projections=True)


def test_global_tokens_with_gradient_checkpointing_and_global_projections():
    """Training through the default global first token, with separate global projections: checkpointed gradients equal
    the plain ones, and the global projections get gradients."""
    model = LongShortForSequenceClassification(tiny_config(global_projections=True)).train()
    ids, labels = tokens(), torch.tensor([0, 2])

    def gradients():
        model.zero_grad()
        model(ids, labels=labels).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    plain = gradients()
    assert any("global_key" in name for name in plain)
    enable_checkpointing(model)
    checkpointed = gradients()
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], msg=name)


@pytest.mark.parametrize(
    "model_class, overrides",
    [
        (LongShortForMaskedLM, {}),
        (LongShortForCausalLM, {"is_decoder": True}),
        (LongShortForMultipleChoice, {"qk_head_dim": 4}),
    ],
)
def test_every_parameter_is_initialised_by_init_weights(model_class, overrides):
    config = tiny_config(**overrides)
    with torch.device("meta"):
        model = model_class(config)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.fill_(float("nan"))
    model.init_weights()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert not tensor.isnan().any(), f"{name} is not initialised by _init_weights"
    attention = model.long_short.encoder.layer[0].attention.self
    bound = 1 / config.hidden_size**0.5  # W^P: U(+-1/sqrt(d)), as the official LRA code (_init_weights)
    assert attention.dynamic_projection.weight.abs().max().item() <= bound
    assert attention.dynamic_projection.weight.std().item() == pytest.approx(bound / 3**0.5, rel=0.3)
    assert torch.equal(attention.dual_ln_local.weight, torch.ones(32))
    assert not model.long_short.embeddings.word_embeddings.weight[config.pad_token_id].any()


def test_save_load_round_trip_safetensors_and_tied_weights(tmp_path):
    model = LongShortForMaskedLM(tiny_config()).eval()
    embedding = model.long_short.embeddings.word_embeddings.weight
    assert model.lm_head.decoder.weight is embedding
    model.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    assert "long_short.embeddings.word_embeddings.weight" in state and "lm_head.decoder.weight" not in state
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path)
    assert type(loaded) is LongShortForMaskedLM and not loaded.training
    assert loaded.lm_head.decoder.weight is loaded.long_short.embeddings.word_embeddings.weight
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_causal_lm_saves_generation_config(tmp_path):
    model = LongShortForCausalLM(tiny_config(is_decoder=True))
    assert model.can_generate()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "generation_config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, LongShortForCausalLM) and loaded.config.is_decoder


def test_resize_token_embeddings_keeps_tying():
    model = LongShortForMaskedLM(tiny_config())
    model.resize_token_embeddings(VOCAB + 13)
    assert model.config.vocab_size == VOCAB + 13
    assert model.lm_head.decoder.weight is model.long_short.embeddings.word_embeddings.weight
    assert model.lm_head.bias.shape == (VOCAB + 13,)
    ids = tokens()
    ids[0, 0] = VOCAB + 12
    assert model(ids).logits.shape == (2, 19, VOCAB + 13)


def test_training_steps_reduce_the_loss():
    torch.manual_seed(0)
    model = LongShortForMaskedLM(tiny_config()).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = tokens(4, 24)
    losses = []
    for _ in range(8):
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("overrides", [{}, {"is_decoder": True}], ids=["bidirectional", "causal"])
def test_gradient_checkpointing_gives_the_same_gradients(overrides):
    model_class = LongShortForCausalLM if overrides else LongShortForMaskedLM
    model = model_class(tiny_config(**overrides)).double().train()  # float64: some true gradients are 0
    ids = tokens()

    def gradients():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    plain = gradients()
    enable_checkpointing(model)
    assert all(layer.gradient_checkpointing for layer in model.long_short.encoder.layer)
    checkpointed = gradients()
    assert plain.keys() == checkpointed.keys() and len(plain) > 20
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-12, rtol=1e-9, msg=name)


@pytest.mark.parametrize("overrides", [{}, {"is_decoder": True}], ids=["bidirectional", "causal"])
def test_right_padding_does_not_change_real_positions(overrides, device, dtype):
    model = LongShortModel(tiny_config(**overrides)).to(device, dtype).eval()
    ids = tokens(1, 13)
    padded = torch.cat([ids, torch.full((1, 10), 1)], 1)
    mask = torch.cat([torch.ones(1, 13), torch.zeros(1, 10)], 1).long()
    with torch.no_grad():
        alone = model(ids.to(device)).last_hidden_state
        batch = model(
            torch.cat([padded, tokens(1, 23, seed=1)]).to(device),
            attention_mask=torch.cat([mask, torch.ones_like(mask)]).to(device),
        )
    assert_close(batch.last_hidden_state[:1, :13], alone, atol=1e-12)


@pytest.mark.parametrize("overrides", [{}, {"is_decoder": True}], ids=["bidirectional", "causal"])
def test_an_all_ones_mask_reaches_the_layers_as_none(overrides):
    """As Transformers drops an all-ones mask before SDPA, the model's attention plan holds None for a mask that marks
    every token real (the unpadded path, whose compiled code serves every length), the same outputs; a mask with
    padding reaches the layers as it is. Every layer gets the same plan, made once a forward pass."""
    model = LongShortModel(tiny_config(**overrides)).eval()
    masks, plans = [], []

    def plan_of(module, args, kwargs):
        plans.append(kwargs["plan"])
        masks.append(kwargs["plan"].masks.valid)

    for layer in model.encoder.layer:
        layer.attention.self.register_forward_pre_hook(plan_of, with_kwargs=True)
    ids, padded = tokens(2, 19), torch.ones(2, 19, dtype=torch.long)
    padded[1, slice(0, 5) if overrides else slice(14, None)] = 0  # causal: left padding; bidirectional: right
    with torch.no_grad():
        plain = model(ids).last_hidden_state
        assert masks == [None, None]
        ones = model(ids, attention_mask=torch.ones(2, 19, dtype=torch.long)).last_hidden_state
        assert masks[2:] == [None, None]
        model(ids, attention_mask=padded)
    assert all(mask is not None and mask.equal(padded.bool()) for mask in masks[4:]) and len(masks) == 6
    assert all(plans[i] is plans[i + 1] for i in range(0, 6, 2))
    torch.testing.assert_close(ones, plain, atol=0, rtol=0)


def test_no_future_leakage_through_the_causal_model(device):
    model = LongShortForCausalLM(tiny_config(is_decoder=True)).to(device, torch.float64).eval()  # leaks >> rounding
    ids = tokens(1, 29).to(device)
    with torch.no_grad():
        base = model(ids).logits
        for t in (3, 8, 17, 28):
            changed = ids.clone()
            changed[0, t] = (changed[0, t] + 1 - 3) % (VOCAB - 3) + 3
            logits = model(changed).logits
            torch.testing.assert_close(logits[:, :t], base[:, :t], rtol=0, atol=1e-12)
            assert not torch.allclose(logits[:, t], base[:, t])


def test_bidirectional_model_sees_both_directions():
    model = LongShortModel(tiny_config()).eval()
    ids = tokens(1, 29)
    changed = ids.clone()
    changed[0, 28] = 3 if ids[0, 28] != 3 else 4
    with torch.no_grad():
        delta = (model(changed).last_hidden_state - model(ids).last_hidden_state).abs().amax(-1)
    assert (delta[0, :28] > 1e-6).all()  # the projected rows carry the change to every position


def test_inputs_embeds_match_input_ids_and_token_types_matter():
    model = LongShortModel(tiny_config(type_vocab_size=2)).eval()
    ids = tokens()
    with torch.no_grad():
        from_ids = model(ids).last_hidden_state
        from_embeds = model(inputs_embeds=model.get_input_embeddings()(ids)).last_hidden_state
        with_types = model(ids, token_type_ids=torch.ones_like(ids)).last_hidden_state
    torch.testing.assert_close(from_embeds, from_ids)
    assert not torch.allclose(with_types, from_ids)


def test_any_length_up_to_the_position_limit_and_a_clear_error_beyond():
    config = tiny_config(max_position_embeddings=40)  # 38 tokens
    model = LongShortForMaskedLM(config).eval()
    for length in (1, 5, 37, 38):
        assert model(tokens(1, length)).logits.shape == (1, length, VOCAB)
    with pytest.raises(ValueError, match="exceeds the 38 tokens"):
        model(tokens(1, 39))
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        model()


@pytest.mark.parametrize("overrides", [{}, {"is_decoder": True}], ids=["bidirectional", "causal"])
def test_attention_mask_of_the_wrong_shape_is_refused(overrides):
    model = LongShortModel(tiny_config(**overrides)).eval()
    ids = tokens(2, 19)
    for shape in ((2, 18), (2, 25), (3, 19), (2, 19, 1)):
        with pytest.raises(ValueError, match=r"attention_mask must have shape \(batch, new tokens\) = \(2, 19\)"):
            model(ids, attention_mask=torch.ones(shape, dtype=torch.long))


def test_attn_implementations_load_and_the_fused_path_matches_the_explicit_softmax(tmp_path):
    """attn_implementation="sdpa" (Transformers' default) and "eager" both load; either way the attention runs the
    fused SDPA path, and with output_attentions=True an explicit softmax that returns the weights: the two agree."""
    LongShortForMaskedLM(tiny_config()).save_pretrained(tmp_path)
    default = AutoModelForMaskedLM.from_pretrained(tmp_path)
    sdpa = AutoModelForMaskedLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    eager = AutoModelForMaskedLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert default.config._attn_implementation == sdpa.config._attn_implementation == "sdpa"
    assert eager.config._attn_implementation == "eager"
    from_config = AutoModelForMaskedLM.from_config(tiny_config(), attn_implementation="sdpa")
    assert from_config.config._attn_implementation == "sdpa"
    ids = tokens()
    mask = torch.ones_like(ids)
    mask[0, -5:] = 0
    with torch.no_grad():
        fused = sdpa(ids, attention_mask=mask)
        explicit = sdpa(ids, attention_mask=mask, output_attentions=True)
    torch.testing.assert_close(fused.logits, explicit.logits, rtol=1e-5, atol=1e-5)
    assert len(explicit.attentions) == 2 and fused.attentions is None
    assert len(AutoModelForMaskedLM.from_pretrained(tmp_path, output_attentions=True)(ids).attentions) == 2


def test_set_attn_implementation_after_loading_switches_the_attention(tmp_path, monkeypatch):
    """``model.set_attn_implementation(...)`` after ``from_pretrained`` changes the path the attention runs at the next
    call (FlexAttention's block mask is built, or no longer), with the same output."""
    from ls_hf import long_short_fused

    built = []
    real = long_short_fused.long_short_flex_attend
    monkeypatch.setattr(long_short_fused, "long_short_flex_attend", lambda *a, **k: built.append(1) or real(*a, **k))
    LongShortForMaskedLM(tiny_config()).save_pretrained(tmp_path)
    model = AutoModelForMaskedLM.from_pretrained(tmp_path).double().eval()
    ids, mask = tokens(), torch.ones(2, 19, dtype=torch.long)
    mask[0, -5:] = 0
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        assert not built
        model.set_attn_implementation("flex_attention")
        assert model.config._attn_implementation == "flex_attention"
        flex = model(ids, attention_mask=mask).logits
        assert len(built) == 2  # once per layer
        model.set_attn_implementation("eager")
        eager = model(ids, attention_mask=mask).logits
        assert len(built) == 2
    torch.testing.assert_close(flex, expected, rtol=0, atol=1e-10)
    torch.testing.assert_close(eager, expected, rtol=0, atol=0)


@pytest.mark.parametrize("output_attentions", [False, True], ids=["sdpa", "explicit_softmax"])
def test_attention_dropout_acts_in_training_only(output_attentions):
    """attention_probs_dropout_prob drops attention probabilities in train mode only (tiny_config has no hidden
    dropout, so only the attention's own dropout can act): the output then depends on the RNG seed, reproducibly."""
    dropped = LongShortModel(tiny_config(attention_probs_dropout_prob=0.5))
    plain = LongShortModel(tiny_config())
    plain.load_state_dict(dropped.state_dict())
    ids = tokens()

    def run(model, train, seed=0):
        torch.manual_seed(seed)
        with torch.no_grad():
            return model.train(train)(ids, output_attentions=output_attentions).last_hidden_state

    reference = run(plain, train=False)
    torch.testing.assert_close(run(plain, train=True), reference, rtol=0, atol=0)
    torch.testing.assert_close(run(dropped, train=False), reference, rtol=0, atol=0)
    first = run(dropped, train=True, seed=1)
    torch.testing.assert_close(run(dropped, train=True, seed=1), first, rtol=0, atol=0)
    assert not torch.allclose(first, reference, atol=1e-3)
    assert not torch.allclose(run(dropped, train=True, seed=2), first, atol=1e-3)


def test_output_attentions_from_config():
    config = tiny_config(output_attentions=True)
    outputs = LongShortModel(config)(tokens())
    assert len(outputs.attentions) == 2


def test_trainer_style_loss_with_num_items_in_batch():
    model = LongShortForMaskedLM(tiny_config()).eval()
    ids = tokens()
    labels = ids.clone()
    labels[:, ::2] = -100
    count = (labels != -100).sum()
    with torch.no_grad():
        mean = model(ids, labels=labels).loss
        summed = model(ids, labels=labels, num_items_in_batch=2 * count).loss
    torch.testing.assert_close(summed * 2, mean)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_forward_and_backward(dtype, device):
    model = LongShortForMaskedLM(tiny_config()).to(device).eval()
    ids = tokens().to(device)
    with torch.no_grad():
        reference = model(ids).logits
    model.to(dtype)
    outputs = model(ids, labels=ids)
    assert outputs.logits.dtype == dtype
    outputs.loss.backward()
    torch.testing.assert_close(outputs.logits.float(), reference, atol=0.1, rtol=0.05)


def test_lmsa_and_per_layer_settings():
    config = tiny_config(qk_head_dim=4, window_size=[4, 8], projection_rank=[0, 5], use_dual_ln=False)
    model = LongShortModel(config)
    first, second = (layer.attention.self for layer in model.encoder.layer)
    assert (first.window_size, first.projection_rank, second.window_size, second.projection_rank) == (4, 0, 8, 5)
    assert first.query.out_features == 4 * 4 and first.dual_ln_local is None
    outputs = model(tokens(), output_attentions=True)
    assert [a.shape[-1] for a in outputs.attentions] == [8, 5 + 16]


def test_package_exports():
    assert {"CausalState", "LongShortSelfAttention", "LongShortConfig", "LongShortCache"} <= set(ls_hf.__all__)


@pytest.mark.parametrize(
    "problem_type",
    [None, "single_label_classification", "regression", "multi_label_classification"],
    ids=["mlm", "single", "regression", "multi"],
)
def test_trainer_loss_is_not_scaled_by_gradient_accumulation(tmp_path, problem_type):
    """The Trainer passes num_items_in_batch to heads that take **kwargs; with lr = 0 its reported loss must be
    the plain mean loss (a head averaging per micro-batch would report it x gradient_accumulation_steps): the MLM
    head, and the sequence classifier for each problem type."""
    from transformers import Trainer, TrainingArguments

    ids = tokens(8, 12)
    if problem_type is None:
        model = LongShortForMaskedLM(tiny_config())
        labels = ids
    else:
        num_labels = 1 if problem_type == "regression" else 3
        model = LongShortForSequenceClassification(tiny_config(num_labels=num_labels, problem_type=problem_type))
        torch.manual_seed(1)
        labels = {
            "single_label_classification": torch.randint(0, 3, (8,)),
            "regression": torch.randn(8),
            "multi_label_classification": torch.randint(0, 2, (8, 3)).float(),
        }[problem_type]
    data = [{"input_ids": i, "labels": label} for i, label in zip(ids, labels)]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=0.0,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
    )
    result = Trainer(model=model, args=args, train_dataset=data).train()
    with torch.no_grad():
        expected = model(ids, labels=labels).loss
    assert result.training_loss == pytest.approx(expected.item(), rel=1e-4)

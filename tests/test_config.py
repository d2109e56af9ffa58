"""LongShortConfig: RoBERTa's fields, Auto registration, serialization round trips, validation naming the field."""

import json
from dataclasses import fields

import pytest
from transformers import AutoConfig, PreTrainedConfig, RobertaConfig

import ls_hf
from ls_hf import LongShortConfig
from ls_hf.long_short_rules import window_bounds


def test_roberta_fields_map_one_to_one():
    # LongShort has no cross-attention (encoder, or decoder-only LM), so add_cross_attention has no counterpart.
    roberta_fields = {f.name for f in fields(RobertaConfig)} - {f.name for f in fields(PreTrainedConfig)}
    missing = roberta_fields - {f.name for f in fields(LongShortConfig)} - {"add_cross_attention"}
    assert not missing, f"RoBERTa fields absent from LongShortConfig: {sorted(missing)}"
    roberta = RobertaConfig(
        hidden_size=64,
        num_attention_heads=4,
        layer_norm_eps=1e-5,
        type_vocab_size=1,
        num_labels=5,
        problem_type="regression",
    )
    config = LongShortConfig.from_roberta(roberta, window_size=32, projection_rank=0, max_position_embeddings=1026)
    for key in roberta_fields - {"add_cross_attention", "max_position_embeddings"}:
        assert getattr(config, key) == getattr(roberta, key), key
    assert (config.num_labels, config.problem_type, config.max_position_embeddings) == (5, "regression", 1026)
    assert config.architectures is None and config.window_size == 32


def test_defaults_and_special_tokens():
    config = LongShortConfig()
    assert config.model_type == "long_short"
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (1, 0, 2)
    assert config.tie_word_embeddings and not config.is_decoder
    assert config.max_input_length == 4096  # 4098 rows, positions start at pad_token_id + 1


def test_auto_config_for_model():
    config = AutoConfig.for_model("long_short", window_size=128, projection_rank=32)
    assert isinstance(config, LongShortConfig)
    assert (config.window_size, config.projection_rank) == (128, 32)


def test_save_load_and_dict_round_trip(tmp_path):
    config = LongShortConfig(
        num_hidden_layers=3, window_size=[8, 16, 32], projection_rank=[4, 0, 2], use_dual_ln=False, qk_head_dim=16
    )
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "long_short" and saved["window_size"] == [8, 16, 32]
    for loaded in (
        LongShortConfig.from_pretrained(tmp_path),
        AutoConfig.from_pretrained(tmp_path),
        LongShortConfig.from_dict(config.to_dict()),
        LongShortConfig.from_json_file(tmp_path / "config.json"),
    ):
        assert type(loaded) is LongShortConfig
        assert {**loaded.to_dict(), "_name_or_path": ""} == config.to_dict()
    assert isinstance(config, PreTrainedConfig)


def test_per_layer_values():
    config = LongShortConfig(num_hidden_layers=2, window_size=[8, 4], projection_rank=3)
    assert [config.attention_kwargs(i)["window_size"] for i in range(2)] == [8, 4]
    assert [config.attention_kwargs(i)["projection_rank"] for i in range(2)] == [3, 3]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"window_size": -1}, "window_size"),
        ({"projection_rank": -2}, "projection_rank"),
        ({"num_hidden_layers": 2, "window_size": [8, 8, 8]}, "window_size"),
        ({"num_hidden_layers": 2, "projection_rank": [1, -1]}, "projection_rank[1]"),
        ({"hidden_size": 30, "num_attention_heads": 4}, "num_attention_heads"),
        ({"window_size": 0, "projection_rank": 0}, "window_size"),
        ({"is_decoder": True, "window_size": 0}, "window_size"),
        ({"is_decoder": True, "window_size": 8, "causal_segment_length": 16}, "causal_segment_length"),
        ({"is_decoder": True, "causal_segment_length": 0}, "causal_segment_length"),
        ({"qk_head_dim": 0}, "qk_head_dim"),
        ({"pad_token_id": None}, "pad_token_id"),
        ({"max_position_embeddings": 2}, "max_position_embeddings"),
        ({"attention_probs_dropout_prob": 1.5}, "attention_probs_dropout_prob"),
        ({"attention_probs_dropout_prob": -0.2}, "attention_probs_dropout_prob"),
    ],
)
def test_invalid_values_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        LongShortConfig(**kwargs)


def test_edited_config_is_checked_when_a_model_is_built():
    config = LongShortConfig(
        hidden_size=16,
        num_attention_heads=2,
        num_hidden_layers=1,
        intermediate_size=32,
        vocab_size=50,
        window_size=4,
        causal_segment_length=8,
    )
    config.is_decoder = True  # RoBERTa's way to make a decoder; l = 8 > w = 4 is now invalid
    with pytest.raises(ValueError, match="causal_segment_length"):
        ls_hf.LongShortForCausalLM(config)


@pytest.mark.parametrize("window", [1, 2, 3, 4, 5, 8])
def test_the_docstring_states_the_window_of_odd_and_zero_window_sizes(window):
    """What ``window_size`` means for odd values, 1 and 0 is the docstring's, and it is what the code does: the span of
    keys a bidirectional segment sees, and w = 0 (projection only) needing a projection."""
    doc = " ".join(LongShortConfig.__doc__.split())
    assert "max(w // 2, 1)" in doc and "2w - 1 for an odd w >= 3, and 3 for w = 1" in doc
    assert "w = 0, bidirectional only, turns the window off: the projection only" in doc
    low, high = window_bounds(0, window, causal=False)
    documented = 3 if window == 1 else 2 * window - 1 if window % 2 else 2 * window
    assert high - low == documented
    LongShortConfig(window_size=0, projection_rank=4)
    with pytest.raises(ValueError, match="both 0"):
        LongShortConfig(window_size=0, projection_rank=0)

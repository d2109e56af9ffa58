"""Transformers pipelines on LongShort models saved to disk with a locally built byte-level RoBERTa tokenizer."""

import pytest
import torch
from tokenizers.pre_tokenizers import ByteLevel
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    ByT5Tokenizer,
    RobertaTokenizer,
    pipeline,
)

from ls_hf import LongShortXLConfig, LongShortXLForCausalLM

from .test_modeling import tiny_config

TEXT = "Long-Short attention sees a window and a projected summary."


@pytest.fixture(scope="module")
def tokenizer():
    """A RoBERTa tokenizer over the 256 byte symbols (no merges): <s>=0, <pad>=1, </s>=2 as in the config."""
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    vocab = {token: i for i, token in enumerate(specials + sorted(ByteLevel.alphabet()))}
    return RobertaTokenizer(vocab=vocab, merges=[], model_max_length=128)


def saved(tmp_path_factory, tokenizer, auto_class, **overrides):
    """Save a tiny model of ``auto_class`` with the tokenizer and return the folder (pipelines load from disk)."""
    torch.manual_seed(0)
    config = tiny_config(vocab_size=len(tokenizer), **overrides)
    folder = tmp_path_factory.mktemp(auto_class.__name__)
    auto_class.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_auto_tokenizer_resolves_for_long_short(tmp_path_factory, tokenizer):
    folder = saved(tmp_path_factory, tokenizer, AutoModel)
    assert isinstance(AutoTokenizer.from_pretrained(folder), RobertaTokenizer)


def test_fill_mask(tmp_path_factory, tokenizer):
    fill = pipeline("fill-mask", model=saved(tmp_path_factory, tokenizer, AutoModelForMaskedLM), top_k=3)
    predictions = fill(f"Long-Short attention{tokenizer.mask_token}")
    assert len(predictions) == 3 and all(0 <= p["score"] <= 1 and "<mask>" not in p["sequence"] for p in predictions)


def test_text_classification(tmp_path_factory, tokenizer):
    classify = pipeline(
        "text-classification", model=saved(tmp_path_factory, tokenizer, AutoModelForSequenceClassification)
    )
    (result,) = classify(TEXT)
    assert result["label"] in {"LABEL_0", "LABEL_1", "LABEL_2"} and 0 < result["score"] <= 1


def test_token_classification(tmp_path_factory, tokenizer):
    tag = pipeline("token-classification", model=saved(tmp_path_factory, tokenizer, AutoModelForTokenClassification))
    entities = tag(TEXT)
    assert len(entities) > 0 and all(entity["entity"].startswith("LABEL_") for entity in entities)


def test_extractive_question_answering(tmp_path_factory, tokenizer):
    """Transformers 5 removed the extractive "question-answering" pipeline (its registry now points to chat
    models), so this does the pipeline's job by hand: encode with offsets, take the best span, map it back."""
    folder = saved(tmp_path_factory, tokenizer, AutoModelForQuestionAnswering, num_labels=2)
    model = AutoModelForQuestionAnswering.from_pretrained(folder)
    question = "What does it see?"
    encoded = tokenizer(question, TEXT, return_offsets_mapping=True, return_tensors="pt")
    offsets = encoded.pop("offset_mapping")[0]
    with torch.no_grad():
        outputs = model(**encoded)
    in_context = torch.tensor([index == 1 for index in encoded.sequence_ids(0)])
    start_logits = outputs.start_logits[0].masked_fill(~in_context, float("-inf"))
    end_logits = outputs.end_logits[0].masked_fill(~in_context, float("-inf"))
    scores = (start_logits[:, None] + end_logits[None, :]).triu()
    start, end = divmod(int(scores.argmax()), scores.shape[1])
    answer = TEXT[offsets[start][0] : offsets[end][1]]
    assert start <= end and in_context[start] and in_context[end] and answer and answer in TEXT


def test_text_generation(tmp_path_factory, tokenizer):
    generate = pipeline(
        "text-generation", model=saved(tmp_path_factory, tokenizer, AutoModelForCausalLM, is_decoder=True)
    )
    (result,) = generate("Long-Short", max_new_tokens=8, do_sample=False)
    assert result["generated_text"].startswith("Long-Short") and len(result["generated_text"]) > len("Long-Short")


def test_text_generation_with_the_official_character_model(tmp_path):
    """A LongShortXLForCausalLM folder without tokenizer files: AutoTokenizer gives ByT5's byte tokenizer (that of
    recipes.char_lm) and the pipeline continues the bytes as generate does."""
    torch.manual_seed(0)
    model = LongShortXLForCausalLM(
        LongShortXLConfig(
            vocab_size=384,
            num_hidden_layers=1,
            hidden_size=16,
            num_attention_heads=2,
            intermediate_size=32,
            window_size=16,
            memory_length=16,
            eos_token_id=None,
        )
    ).eval()
    model.save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert isinstance(tokenizer, ByT5Tokenizer)
    (result,) = pipeline("text-generation", model=str(tmp_path))(
        TEXT, max_new_tokens=8, do_sample=False, add_special_tokens=False
    )
    ids = tokenizer(TEXT, add_special_tokens=False, return_tensors="pt").input_ids
    assert ids.tolist() == [[3 + byte for byte in TEXT.encode()]]
    with torch.no_grad():
        sequence = model.generate(ids, max_new_tokens=8, do_sample=False)[0]
    text = tokenizer.decode(sequence, skip_special_tokens=True)
    assert result["generated_text"] == TEXT + text[len(TEXT) :]


def test_feature_extraction(tmp_path_factory, tokenizer):
    extract = pipeline("feature-extraction", model=saved(tmp_path_factory, tokenizer, AutoModel))
    features = torch.tensor(extract(TEXT))
    assert features.shape == (1, len(tokenizer(TEXT)["input_ids"]), 32)

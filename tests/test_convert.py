"""ls-convert-roberta: exact equivalence with the source RoBERTa, Longformer-style positions, new-parameter init,
clear errors and nothing half-written."""

import os
import shutil
import stat
import subprocess
import sys
import time

import huggingface_hub
import pytest
import torch
from transformers import (
    AutoConfig,
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    BertTokenizer,
    DistilBertConfig,
    DistilBertForMaskedLM,
    ElectraConfig,
    ElectraForMaskedLM,
    ElectraForPreTraining,
    LongformerConfig,
    LongformerForMaskedLM,
    RobertaForMaskedLM,
    RobertaModel,
)

from ls_hf import LongShortForMaskedLM, LongShortModel
from ls_hf.convert_roberta import convert_roberta, main
from recipes.tiny import sample_texts, tiny_roberta, train_tokenizer

LENGTHS = [5, 77, 300, 512]  # a batch of these lengths, right-padded to 512


@pytest.fixture(scope="module")
def roberta(tmp_path_factory):
    return tiny_roberta(tmp_path_factory.mktemp("src") / "roberta")


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_exact_roberta_function_without_new_parts(roberta, tmp_path):
    out = convert_roberta(
        roberta, tmp_path / "ls", max_position_embeddings=1024, window_size=512, projection_rank=0, use_dual_ln=False
    )
    source = RobertaForMaskedLM.from_pretrained(roberta).eval()
    model = LongShortForMaskedLM.from_pretrained(out).eval()
    assert model.lm_head.decoder.weight is model.long_short.embeddings.word_embeddings.weight

    torch.manual_seed(0)
    lengths = [5, 77, 300, 512]
    ids = torch.full((len(lengths), 512), source.config.pad_token_id)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(5, source.config.vocab_size, (n,))
    mask = ids.ne(source.config.pad_token_id).long()
    with torch.no_grad():
        expected, got = source(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits
    real = mask.bool()
    assert (got[real] - expected[real]).abs().max() < 1e-4
    first = torch.zeros_like(ids)
    first[:, 0] = 1  # the classification heads' default global token keeps the function
    with torch.no_grad():
        got = model(ids, attention_mask=mask, global_attention_mask=first).logits
    assert (got[real] - expected[real]).abs().max() < 1e-4

    old = source.roberta.embeddings.position_embeddings.weight
    new = model.long_short.embeddings.position_embeddings.weight
    assert new.shape[0] == 1026
    assert torch.equal(new[:514], old) and torch.equal(new[514:], old[2:])
    assert AutoTokenizer.from_pretrained(out).model_max_length == 1024


def bert_tokenizer(folder) -> BertTokenizer:
    """A WordPiece tokenizer with BERT's special tokens ([PAD] = 0) over the words of the shipped sample."""
    words = sorted({w for text in sample_texts() for w in text.lower().split() if w.isalpha()})[:300]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    return BertTokenizer(vocab=str(folder / "vocab.txt"))


def tiny_source(kind, folder):
    """A randomly initialised 2-layer source model of ``kind`` (hidden 32, weights at std 0.2 so that a misused input
    shows) and its tokenizer, saved in ``folder``."""
    common = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "initializer_range": 0.2,
    }
    if kind == "longformer":
        tokenizer = train_tokenizer(sample_texts(), model_max_length=4096)
        config = LongformerConfig(
            vocab_size=len(tokenizer),
            max_position_embeddings=4098,
            attention_window=1024,
            type_vocab_size=1,
            pad_token_id=1,
            sep_token_id=2,
            **common,
        )
        model = LongformerForMaskedLM(config)
    else:
        tokenizer = bert_tokenizer(folder)
        if kind == "bert":
            model = BertForMaskedLM(BertConfig(vocab_size=len(tokenizer), max_position_embeddings=512, **common))
        else:
            model = ElectraForPreTraining(
                ElectraConfig(vocab_size=len(tokenizer), embedding_size=32, max_position_embeddings=512, **common)
            )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model.eval(), tokenizer


def batch(tokenizer, vocab_size, pairs):
    """Random ids at LENGTHS, right-padded to 512, starting with the cls token; pairs: token types 1 after the middle
    (BERT sentence pairs)."""
    torch.manual_seed(0)
    ids = torch.full((len(LENGTHS), 512), tokenizer.pad_token_id)
    types = torch.zeros_like(ids)
    for row, n in enumerate(LENGTHS):
        ids[row, :n] = torch.randint(5, vocab_size, (n,))
        ids[row, 0] = tokenizer.cls_token_id
        if pairs:
            types[row, n // 2 : n] = 1
    return ids, ids.ne(tokenizer.pad_token_id).long(), types


@pytest.mark.parametrize("kind", ["bert", "electra", "longformer"])
def test_other_sources_convert_losslessly(kind, tmp_path):
    """BERT (token types, LayerNorm eps 1e-12, positions from 0), the ELECTRA discriminator (as an encoder) and
    Longformer (4,096 positions kept, its global projections the global tokens'): with DualLN off, r = 0 and a window
    covering the input the converted model computes the source's function to 1e-5 at up to 512 tokens, with global
    tokens (the first token, and for Longformer a few more); no missing or unexpected keys."""
    source, tokenizer = tiny_source(kind, tmp_path / "src")
    out = convert_roberta(
        tmp_path / "src",
        tmp_path / "ls",
        max_position_embeddings=4096 if kind == "longformer" else 1024,
        window_size=1024,
        projection_rank=0,
        use_dual_ln=False,
        log=lambda _: None,
    )
    if kind == "electra":  # an encoder without RoBERTa's pooler, which ELECTRA lacks
        model, info = LongShortModel.from_pretrained(out, add_pooling_layer=False, output_loading_info=True)
    else:
        model, info = LongShortForMaskedLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values())
    model.eval()
    ids, mask, types = batch(tokenizer, source.config.vocab_size, pairs=kind == "bert")
    glob = torch.zeros_like(ids)
    glob[:, 0] = 1
    if kind == "longformer":
        glob[:, 3] = glob[2, 100:110] = 1
    with torch.no_grad():
        if kind == "electra":
            want = source.electra(ids, attention_mask=mask).last_hidden_state
            have = model(ids, attention_mask=mask, global_attention_mask=glob).last_hidden_state
        elif kind == "longformer":
            want = source(ids, attention_mask=mask, global_attention_mask=glob).logits
            have = model(ids, attention_mask=mask, global_attention_mask=glob).logits
        else:
            want = source(ids, attention_mask=mask, token_type_ids=types).logits
            have = model(ids, attention_mask=mask, token_type_ids=types, global_attention_mask=glob).logits
    real = mask.bool()
    scale = want[real].abs().max()
    assert (have[real] - want[real]).abs().max() <= 1e-5 * max(1.0, scale), (have[real] - want[real]).abs().max()
    config = model.config
    assert config.sep_token_id == tokenizer.sep_token_id
    assert config.global_projections == (kind == "longformer")
    if kind == "longformer":
        assert config.max_position_embeddings == 4098
        torch.testing.assert_close(
            model.long_short.embeddings.position_embeddings.weight,
            source.longformer.embeddings.position_embeddings.weight,
            atol=0,
            rtol=0,
        )
    else:
        assert (config.type_vocab_size, config.layer_norm_eps) == (2, 1e-12)


def test_default_conversion_initialises_new_parameters(roberta, tmp_path, capsys):
    out = convert_roberta(roberta, tmp_path / "ls", window_size=16, projection_rank=4)
    printed = capsys.readouterr().out
    assert "attention.output.dense.weight -> long_short.encoder.layer.*.attention.self.output.weight" in printed
    assert "initialised" in printed and "dynamic_projection" in printed and "dual_ln_local" in printed

    model = LongShortForMaskedLM.from_pretrained(out).eval()
    attention = model.long_short.encoder.layer[0].attention.self
    assert attention.dynamic_projection.weight.abs().max().item() <= 1 / 32**0.5
    assert attention.dynamic_projection.weight.std().item() == pytest.approx(1 / (3 * 32) ** 0.5, rel=0.2)
    assert torch.equal(attention.dual_ln_local.weight, torch.ones(32))
    assert torch.equal(attention.dual_ln_global.bias, torch.zeros(32))
    assert model.config.max_position_embeddings == 4098
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.model_max_length == 4096
    ids = tokenizer(" great film" * 1500, truncation=True, return_tensors="pt").input_ids  # 4096 tokens
    assert ids.shape[1] == 4096
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_errors_are_clear_and_leave_nothing_behind(roberta, tmp_path, capsys, monkeypatch):
    tiny = {"vocab_size": 50, "num_attention_heads": 2}
    DistilBertForMaskedLM(DistilBertConfig(dim=8, n_layers=1, hidden_dim=16, n_heads=2, vocab_size=50)).save_pretrained(
        tmp_path / "distilbert"
    )
    ElectraForPreTraining(
        ElectraConfig(embedding_size=4, hidden_size=8, num_hidden_layers=1, intermediate_size=16, **tiny)
    ).save_pretrained(tmp_path / "electra_small")
    ElectraForMaskedLM(
        ElectraConfig(embedding_size=8, hidden_size=8, num_hidden_layers=1, intermediate_size=16, **tiny)
    ).save_pretrained(tmp_path / "electra_generator")
    bert_tokenizer(tmp_path / "electra_generator").save_pretrained(tmp_path / "electra_generator")
    with pytest.raises(ValueError, match="'distilbert' checkpoint.*converts model types roberta, .*bert, electra"):
        convert_roberta(tmp_path / "distilbert", tmp_path / "out")
    with pytest.raises(ValueError, match="embedding_size=4 != hidden_size=8"):
        convert_roberta(tmp_path / "electra_small", tmp_path / "out")
    with pytest.raises(ValueError, match="pass an ELECTRA discriminator"):
        convert_roberta(tmp_path / "electra_generator", tmp_path / "out")
    for name in ("distilbert", "electra_small", "electra_generator"):
        shutil.rmtree(tmp_path / name)
    bare = tmp_path / "bare"
    RobertaModel.from_pretrained(roberta).save_pretrained(bare)
    AutoTokenizer.from_pretrained(roberta).save_pretrained(bare)
    with pytest.raises(ValueError, match="lacks masked-LM weights"):
        convert_roberta(bare, tmp_path / "out")
    with pytest.raises(ValueError, match="no such folder"):
        convert_roberta(str(tmp_path / "missing"), tmp_path / "out")
    monkeypatch.chdir(roberta.parent)  # a folder name with a typo: said at once, not after the Hub's retries
    with pytest.raises(ValueError, match=f"SRC 'robreta': no such local folder; did you mean '{roberta.name}'"):
        convert_roberta("robreta", tmp_path / "out")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        convert_roberta(roberta, tmp_path / "out", max_position_embeddings=0)
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)

    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        main([str(roberta), str(existing), "--window-size", "16"])
    assert exit_info.value.code == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert (existing / "keep.txt").read_text() == "mine"

    main([str(roberta), str(existing), "--window-size", "16", "--projection-rank", "4", "--no-dual-ln", "--overwrite"])
    assert not (existing / "keep.txt").exists() and (existing / "model.safetensors").is_file()
    assert LongShortForMaskedLM.from_pretrained(existing).config.use_dual_ln is False
    assert not _leftovers(tmp_path)


@pytest.mark.parametrize("why", ["offline mode", "no answer"])
def test_a_hub_id_offline_fails_fast_naming_why(why, tmp_path, monkeypatch):
    """A Hub id that is not in the cache, with HF_HUB_OFFLINE set or no Hub that answers (here a closed local port),
    is refused at once with the reason, instead of after the downloads' retries (about 30 s)."""
    if why == "offline mode":
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        expected = "HF_HUB_OFFLINE is set"
    else:
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
        expected = r"the Hub \(http://127.0.0.1:9\) cannot be reached"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    start = time.perf_counter()
    with pytest.raises(ValueError, match=rf"SRC 'ls-tests/tiny-roberta':.*{expected}.*holds no copy of it"):
        convert_roberta("ls-tests/tiny-roberta", tmp_path / "out")
    assert time.perf_counter() - start < 10 and not (tmp_path / "out").exists()


def test_unusable_sources_are_refused_before_writing(roberta, tmp_path, capsys):
    """No tokenizer files (Transformers would build an empty tokenizer), a config without weights, pad_token_id=None
    and a tokenizer padding with another id: each a clear CLI error, and nothing written."""
    RobertaForMaskedLM.from_pretrained(roberta).save_pretrained(tmp_path / "no_tokenizer")
    AutoConfig.from_pretrained(roberta).save_pretrained(tmp_path / "config_only")
    shutil.copytree(roberta, tmp_path / "no_pad")
    AutoConfig.from_pretrained(roberta, pad_token_id=None).save_pretrained(tmp_path / "no_pad")
    shutil.copytree(roberta, tmp_path / "other_tokenizer")
    AutoTokenizer.from_pretrained(roberta, pad_token="<unk>").save_pretrained(tmp_path / "other_tokenizer")
    errors = {
        "no_tokenizer": "no usable tokenizer: it holds only its 5 special tokens",
        "config_only": "could not load masked-LM weights",
        "no_pad": "pad_token_id=None",
        "other_tokenizer": "no usable tokenizer: its pad_token_id is 3, the model's is 1",
    }
    for name, error in errors.items():
        with pytest.raises(SystemExit) as exit_info:
            main([str(tmp_path / name), str(tmp_path / "out"), "--window-size", "16"])
        assert exit_info.value.code == 2
        assert error in capsys.readouterr().err, name
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)


def test_converted_config_carries_every_roberta_field(roberta, tmp_path):
    """The converter builds its config with LongShortConfig.from_roberta (labels and use_cache included) and always
    writes a bidirectional masked LM."""
    shutil.copytree(roberta, tmp_path / "src")
    AutoConfig.from_pretrained(
        roberta, use_cache=False, num_labels=5, problem_type="regression", classifier_dropout=0.3, is_decoder=True
    ).save_pretrained(tmp_path / "src")
    config = LongShortForMaskedLM.from_pretrained(convert_roberta(tmp_path / "src", tmp_path / "ls")).config
    assert (config.use_cache, config.num_labels, config.problem_type, config.classifier_dropout) == (
        False,
        5,
        "regression",
        0.3,
    )
    assert not config.is_decoder and config.max_position_embeddings == 4098


def test_causal_conversion_continues_a_prompt(roberta, tmp_path, capsys):
    """--causal writes a LongShortForCausalLM with the masked LM's weights and a tokenizer that starts a prompt with
    <s> and ends it with no </s> (RoBERTa's appends one), so the text-generation pipeline continues the prompt; an
    ELECTRA discriminator (no LM head) is refused before anything is written."""
    from transformers import pipeline

    from ls_hf import LongShortForCausalLM

    main([str(roberta), str(tmp_path / "causal"), "--causal", "--window-size", "16", "--projection-rank", "1"])
    mlm = convert_roberta(roberta, tmp_path / "mlm", window_size=16, projection_rank=1)
    model = LongShortForCausalLM.from_pretrained(tmp_path / "causal")
    assert model.config.is_decoder and model.config.max_input_length == 4096
    bidirectional = LongShortForMaskedLM.from_pretrained(mlm).state_dict()
    assert all(
        torch.equal(value, bidirectional[key])
        for key, value in model.state_dict().items()
        if "dynamic_projection" not in key
    )  # W^P: new, drawn at random in each conversion
    tokenizer, source = AutoTokenizer.from_pretrained(tmp_path / "causal"), AutoTokenizer.from_pretrained(roberta)
    prompt = "The film was"
    assert source(prompt).input_ids == [*tokenizer(prompt).input_ids, source.eos_token_id]  # </s> only in RoBERTa's
    assert tokenizer.padding_side == "left" and tokenizer.model_max_length == 4096
    generate = pipeline("text-generation", model=str(tmp_path / "causal"))
    assert generate.preprocess(prompt)["input_ids"][0].tolist() == tokenizer(prompt).input_ids
    assert generate(prompt, max_new_tokens=3, do_sample=False)[0]["generated_text"].startswith(prompt)

    ElectraForPreTraining(
        ElectraConfig(
            embedding_size=8,
            hidden_size=8,
            num_hidden_layers=1,
            intermediate_size=16,
            vocab_size=400,
            num_attention_heads=2,
        )
    ).save_pretrained(tmp_path / "electra")
    bert_tokenizer(tmp_path / "electra").save_pretrained(tmp_path / "electra")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "electra"), str(tmp_path / "out"), "--causal"])
    assert "--causal warm-starts a causal LM from a RoBERTa or BERT masked LM" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_console_script_reports_errors(tmp_path):
    script = f"{sys.prefix}/bin/ls-convert-roberta"
    argv = [script, str(tmp_path / "nope"), str(tmp_path / "out")]
    result = subprocess.run(argv, check=False, capture_output=True, text=True)
    assert result.returncode == 2
    assert "SRC" in result.stderr and "no such folder" in result.stderr


def test_output_is_readable_by_others_help_shows_defaults_and_a_smaller_table_says_so(roberta, tmp_path, capsys):
    """OUT gets the mode a plain mkdir gives (the umask's), not the private mode of a temporary folder; --help shows
    the numeric defaults; a position table that shrinks is reported as truncated."""
    umask = os.umask(0o022)
    try:
        out = convert_roberta(roberta, tmp_path / "ls", max_position_embeddings=64, window_size=16)
    finally:
        os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert "truncated embeddings.position_embeddings.weight" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "(default: 4096)" in shown and "(default: 256)" in shown and "(default: 64)" in shown

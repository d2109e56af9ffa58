"""ls-convert-roberta: exact equivalence with the source RoBERTa, Longformer-style positions, new-parameter init,
clear errors and nothing half-written."""

import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, BertConfig, BertForMaskedLM, RobertaForMaskedLM, RobertaModel

from ls_hf import LongShortForMaskedLM
from ls_hf.convert_roberta import convert_roberta, main
from recipes.tiny import tiny_roberta


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

    old = source.roberta.embeddings.position_embeddings.weight
    new = model.long_short.embeddings.position_embeddings.weight
    assert new.shape[0] == 1026
    assert torch.equal(new[:514], old) and torch.equal(new[514:], old[2:])
    assert AutoTokenizer.from_pretrained(out).model_max_length == 1024


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


def test_errors_are_clear_and_leave_nothing_behind(roberta, tmp_path, capsys):
    bert = tmp_path / "bert"
    BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=16)).save_pretrained(bert)
    with pytest.raises(ValueError, match="'bert' checkpoint.*not RoBERTa-family"):
        convert_roberta(bert, tmp_path / "out")
    bare = tmp_path / "bare"
    RobertaModel.from_pretrained(roberta).save_pretrained(bare)
    AutoTokenizer.from_pretrained(roberta).save_pretrained(bare)
    with pytest.raises(ValueError, match="lacks masked-LM weights"):
        convert_roberta(bare, tmp_path / "out")
    with pytest.raises(ValueError, match="no such folder"):
        convert_roberta(str(tmp_path / "missing"), tmp_path / "out")
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
        False, 5, "regression", 0.3
    )
    assert not config.is_decoder and config.max_position_embeddings == 4098


def test_console_script_reports_errors(tmp_path):
    script = f"{sys.prefix}/bin/ls-convert-roberta"
    argv = [script, str(tmp_path / "nope"), str(tmp_path / "out")]
    result = subprocess.run(argv, check=False, capture_output=True, text=True)
    assert result.returncode == 2
    assert "SRC" in result.stderr and "no such folder" in result.stderr

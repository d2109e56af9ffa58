"""push_to_hub --dry-run: the repo folder is complete, its card carries the measured metrics, and it loads with
trust_remote_code=True in a clean process where ls_hf cannot be imported; for a classifier and for the official
character-level model (char_lm --model_type long_short_xl)."""

import json
import os
import subprocess
import sys
import tempfile

import huggingface_hub
import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoTokenizer

from ls_hf import LongShortForSequenceClassification, LongShortXLForCausalLM
from ls_hf.hub import REMOTE_CODE_FILES_XL
from recipes import char_lm, finetune_imdb, push_to_hub
from recipes.tiny import IMDB_TEST, IMDB_TRAIN, one_thread, tiny_long_short

# The start of every child's code: ls_hf must be unimportable there.
NO_LS_HF = """
import json, sys
try:
    import ls_hf
except ImportError:
    pass
else:
    sys.exit("ls_hf is importable in the child")
import torch
"""

CHILD = (
    NO_LS_HF
    + """
from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification, AutoTokenizer
folder = sys.argv[1]
model = AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True).eval()
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
ids = tokenizer(["A wonderful film, the acting was superb.", "Dull and lifeless."], padding=True, return_tensors="pt")
with torch.no_grad():
    logits = model(**ids).logits
classes = [type(model).__module__, type(AutoModel.from_pretrained(folder, trust_remote_code=True)).__name__,
           type(AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True)).__name__]
print(json.dumps({"logits": logits.tolist(), "classes": classes}))
"""
)

CHILD_XL = (
    NO_LS_HF
    + """
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
folder = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
ids = tokenizer("the plot was ", add_special_tokens=False, return_tensors="pt").input_ids
with torch.no_grad():
    logits = model(ids).logits
    generated = model.generate(ids, max_new_tokens=8, do_sample=False)
classes = [type(model).__module__, type(model).__name__, type(tokenizer).__name__,
           type(AutoModel.from_pretrained(folder, trust_remote_code=True)).__name__]
print(json.dumps({"ids": ids.tolist(), "logits": logits.tolist(), "generated": generated.tolist(), "classes": classes}))
"""
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LongShort classifier trained for a few steps by finetune_imdb (its output folder, with all_results.json)."""
    root = tmp_path_factory.mktemp("push")
    with one_thread():
        finetune_imdb.main(
            [
                "--model_name_or_path",
                str(tiny_long_short(root / "ls-tiny")),
                "--train_file",
                str(IMDB_TRAIN),
                "--validation_file",
                str(IMDB_TEST),
                "--output_dir",
                str(root / "imdb"),
                "--do_train",
                "--do_eval",
                "--max_steps",
                "4",
                "--eval_strategy",
                "no",
                "--save_strategy",
                "no",
                "--load_best_model_at_end",
                "False",
                "--learning_rate",
                "1e-3",
                "--disable_tqdm",
                "True",
            ]
        )
    return root / "imdb"


@pytest.fixture(scope="module")
def trained_xl(tmp_path_factory):
    """The official character-level model trained for a few steps by char_lm --model_type long_short_xl (its output
    folder, with all_results.json holding streaming and block-by-block test BPC)."""
    root = tmp_path_factory.mktemp("push_xl")
    text = root / "text.txt"
    words = ["the", "movie", "was", "great", "bad", "plot", "and", "but", "very", "not"]
    generator = torch.Generator().manual_seed(0)
    text.write_text(" ".join(words[i] for i in torch.randint(0, len(words), (1500,), generator=generator).tolist()))
    with one_thread():
        char_lm.main(
            [
                "--train_file",
                str(text),
                "--output_dir",
                str(root / "xl"),
                "--model_type",
                "long_short_xl",
                "--num_hidden_layers",
                "2",
                "--hidden_size",
                "32",
                "--num_attention_heads",
                "2",
                "--window_size",
                "32",
                "--causal_segment_length",
                "16",
                "--dropout",
                "0",
                "--max_seq_length",
                "64",
                "--per_device_train_batch_size",
                "2",
                "--learning_rate",
                "3e-3",
                "--max_steps",
                "4",
                "--save_strategy",
                "no",
                "--disable_tqdm",
                "True",
                "--eval_memory_length",
                "128",
                "--eval_block_length",
                "32",
                "--do_train",
                "--do_eval",
                "--do_predict",
            ]
        )
    return root / "xl"


def run_without_ls_hf(code: str, folder, tmp_path) -> dict:
    """Run ``code`` with ``folder`` in a clean child process (ls_hf blocked, run from an empty folder, its own cache
    for remote modules, offline); its last stdout line, parsed as JSON."""
    guard = tmp_path / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text("import sys\nsys.modules['ls_hf'] = None\n")
    env = {
        **os.environ,
        "PYTHONPATH": str(guard),
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    child = subprocess.run(
        [sys.executable, "-c", code, str(folder)],
        cwd=guard,
        env=env,
        check=False,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


def test_dry_run_folder_is_complete_and_loads_without_ls_hf(trained, tmp_path):
    folder = tmp_path / "hub"
    push_to_hub.main([str(trained), "someone/roberta-ls-tiny-demo", "--dry-run", str(folder)])
    assert {p.name for p in folder.iterdir()} >= {
        "model.safetensors",
        "config.json",
        "configuration_long_short.py",
        "modeling_long_short.py",
        "long_short_attention.py",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
    }
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert {
        "AutoConfig",
        "AutoModel",
        "AutoModelForMaskedLM",
        "AutoModelForCausalLM",
        "AutoModelForSequenceClassification",
    } <= set(auto_map)

    results = json.loads((trained / "all_results.json").read_text())
    card = ModelCard.load(folder / "README.md")
    assert card.data.pipeline_tag == "text-classification"
    accuracy = next(r for r in card.data.eval_results if r.metric_type == "accuracy")
    assert accuracy.metric_value == round(results["eval_accuracy"], 4) and accuracy.dataset_name == IMDB_TEST.name
    assert f"| Accuracy | {results['eval_accuracy']:.4f} |" in card.text
    assert 'from_pretrained("someone/roberta-ls-tiny-demo", trust_remote_code=True)' in card.text

    loaded = run_without_ls_hf(CHILD, folder, tmp_path)
    assert loaded["classes"][0].startswith("transformers_modules")
    assert loaded["classes"][1:] == ["LongShortModel", "LongShortForMaskedLM"]

    model = LongShortForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(
        ["A wonderful film, the acting was superb.", "Dull and lifeless."], padding=True, return_tensors="pt"
    )
    with torch.no_grad():
        expected = model(**ids).logits
    assert torch.allclose(torch.tensor(loaded["logits"]), expected, atol=1e-5)


def test_named_card_and_errors(trained, tmp_path, capsys):
    folder = tmp_path / "hub"
    push_to_hub.main([str(trained), "someone/roberta-ls-base-imdb", "--dry-run", str(folder)])
    card = ModelCard.load(folder / "README.md")
    assert card.data.base_model == "FacebookAI/roberta-base" and "Table 3" in card.text

    for argv, message in [
        ([str(trained), "someone/x", "--dry-run", str(folder)], "already exists"),
        ([str(trained), "someone/x", "--dry-run", str(tmp_path / "new"), "--model-card", "nope.md"], "--model-card"),
        ([str(trained / "checkpoint-0"), "someone/x", "--dry-run", str(tmp_path / "new")], "no config.json"),
        ([str(trained.parent / "ls-tiny-roberta"), "someone/x", "--dry-run", str(tmp_path / "new")], "not LongShort"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            push_to_hub.main(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


CHILD_CAUSAL = (
    NO_LS_HF
    + """
from transformers import pipeline
generate = pipeline("text-generation", model=sys.argv[1], trust_remote_code=True)
prompt = "A wonderful film"
ids = generate.preprocess(prompt)["input_ids"][0].tolist()
text = generate(prompt, max_new_tokens=4, do_sample=False)[0]["generated_text"]
tokenizer = generate.tokenizer
print(json.dumps({"ids": ids, "plain": tokenizer(prompt, add_special_tokens=False).input_ids, "text": text,
                  "special": [tokenizer.bos_token_id, tokenizer.eos_token_id]}))
"""
)


def test_causal_folder_continues_a_prompt_in_the_text_generation_pipeline(tmp_path):
    """A causal LongShort model saved with RoBERTa's tokenizer (which ends every text with </s>): the repo folder's
    tokenizer starts a prompt with <s> and adds nothing after it, so the text-generation pipeline, in a process
    without ls_hf, continues the prompt."""
    from ls_hf import LongShortForCausalLM

    source = tiny_long_short(tmp_path / "ls-tiny")
    LongShortForCausalLM.from_pretrained(source, is_decoder=True).save_pretrained(tmp_path / "causal")
    roberta = AutoTokenizer.from_pretrained(source)
    roberta.save_pretrained(tmp_path / "causal")
    assert roberta("A wonderful film").input_ids[-1] == roberta.eos_token_id  # the case this is about
    push_to_hub.main([str(tmp_path / "causal"), "someone/causal-ls-tiny", "--dry-run", str(tmp_path / "hub")])
    loaded = run_without_ls_hf(CHILD_CAUSAL, tmp_path / "hub", tmp_path)
    bos, eos = loaded["special"]
    assert loaded["ids"] == [bos, *loaded["plain"]] and eos not in loaded["ids"]
    assert loaded["text"].startswith("A wonderful film") and len(loaded["text"]) > len("A wonderful film")


def test_official_char_lm_folder_is_complete_and_loads_without_ls_hf(trained_xl, tmp_path):
    folder = tmp_path / "hub"
    push_to_hub.main([str(trained_xl), "someone/ls-xl-tiny-chars", "--dry-run", str(folder)])
    assert {p.name for p in folder.iterdir()} >= {
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer_config.json",
        "README.md",
        *REMOTE_CODE_FILES_XL,
    }
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert set(auto_map) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}

    results = json.loads((trained_xl / "all_results.json").read_text())
    card = ModelCard.load(folder / "README.md")  # model_cards/template-long-short-xl.md, filled
    assert card.data.pipeline_tag == "text-generation"
    bpc = {r.metric_name: r.metric_value for r in card.data.eval_results if r.metric_type == "bpc"}
    assert bpc == {
        "Bits per character, streaming with up to 128 bytes of context": round(results["test_bpc"], 4),
        "Bits per character, each block alone": round(results["test_block_bpc"], 4),
    }
    assert f"| Bits per character, each block alone | {results['test_block_bpc']:.4f} |" in card.text
    assert "LongShortXLForCausalLM: 2 layers, hidden size 32, Transformer-XL relative positions" in card.text
    assert 'from_pretrained("someone/ls-xl-tiny-chars", trust_remote_code=True)' in card.text
    assert "add_special_tokens=False" in card.text

    loaded = run_without_ls_hf(CHILD_XL, folder, tmp_path)
    assert loaded["classes"][0].startswith("transformers_modules")
    assert loaded["classes"][1:] == ["LongShortXLForCausalLM", "TokenizersBackend", "LongShortXLModel"]
    model = LongShortXLForCausalLM.from_pretrained(trained_xl).eval()
    ids = torch.tensor(loaded["ids"])
    assert ids.tolist() == [[3 + byte for byte in b"the plot was "]]
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(loaded["logits"]), model(ids).logits, atol=1e-5, rtol=1e-5)
        assert loaded["generated"] == model.generate(ids, max_new_tokens=8, do_sample=False).tolist()


@pytest.mark.parametrize("model_dir", ["trained", "trained_xl"])
def test_upload_without_login_or_network_is_a_clear_error_before_any_work(
    model_dir, request, tmp_path, capsys, monkeypatch
):
    model_dir = request.getfixturevalue(model_dir)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        push_to_hub.main([str(model_dir), "someone/ls-tiny-demo", "--token", "hf_not_a_token"])
    assert exit_info.value.code == 2 and "hf auth login" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # no repo folder was built

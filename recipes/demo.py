"""The whole path from RoBERTa to a published long-document model, on built-in small data, offline, in minutes on CPU.

    python -m recipes.demo [--output-dir DIR]

1. a tiny RoBERTa (2 layers, hidden 32) with a byte-level BPE tokenizer trained here on the shipped IMDb-format sample;
2. ``ls-convert-roberta`` turns it into a LongShort masked LM (window 16, rank 4, DualLN);
3. ``recipes/pretrain_mlm.py`` continues masked-LM pretraining for a few steps;
4. ``recipes/finetune_imdb.py`` fine-tunes it on ``recipes/data/imdb_train.csv``, keeps the epoch that is best on 10%
   of those reviews held out, and scores that model on ``recipes/data/imdb_test.csv``;
5. a causal LongShort LM warm-started from the same weights, with ``causal_tokenizer`` (a prompt gets no end token),
   trains briefly and continues a prompt through ``pipeline("text-generation")``;
6. ``recipes/push_to_hub.py --dry-run`` writes the Hub repo folder of the classifier (nothing is uploaded).
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import datasets
import transformers
from transformers import (
    AutoConfig,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainingArguments,
    pipeline,
)
from transformers.trainer_callback import PrinterCallback

from ls_hf import LongShortForCausalLM
from ls_hf.convert_roberta import causal_tokenizer
from recipes import finetune_imdb, pretrain_mlm, push_to_hub
from recipes.tiny import IMDB_TEST, IMDB_TRAIN, one_thread, sample_texts, tiny_long_short

QUIET = ["--disable_tqdm", "True", "--log_level", "error", "--dataloader_pin_memory", "False", "--seed", "0"]
PROMPT = "My whole family enjoyed"


def causal_lm(mlm_dir: Path, out: Path, steps: int) -> tuple[float, float, str]:
    """Warm-start a causal LongShort LM from ``mlm_dir``, train it ``steps`` steps, save it with its tokenizer to
    ``out``, and greedily continue ``PROMPT`` with the text-generation pipeline of that folder. Returns the first and
    last logged training loss and the generated text."""
    tokenizer = causal_tokenizer(AutoTokenizer.from_pretrained(mlm_dir))
    model = LongShortForCausalLM.from_pretrained(mlm_dir, config=AutoConfig.from_pretrained(mlm_dir, is_decoder=True))
    tokens = tokenizer(sample_texts())
    blocks = datasets.Dataset.from_dict(pretrain_mlm.group_texts(dict(tokens), block=64))
    args = TrainingArguments(
        out,
        max_steps=steps,
        learning_rate=3e-3,
        per_device_train_batch_size=16,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_pin_memory=False,
        seed=0,
    )
    trainer = Trainer(
        model,
        args,
        train_dataset=blocks,
        processing_class=tokenizer,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    trainer.save_model()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    generate = pipeline("text-generation", model=str(out))
    return losses[0], losses[-1], generate(PROMPT, max_new_tokens=12, do_sample=False)[0]["generated_text"]


def run(out: Path) -> dict:
    """Steps 1-6 into ``out``; returns the summary."""
    start = time.perf_counter()

    def step(text: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {text}", flush=True)

    step("1-2. tiny RoBERTa + local BPE tokenizer, converted with ls-convert-roberta")
    converted = tiny_long_short(out / "roberta-ls-tiny")
    step("3. continued masked-LM pretraining (recipes/pretrain_mlm.py)")
    mlm = pretrain_mlm.main(
        [
            "--model_name_or_path",
            str(converted),
            "--train_file",
            str(IMDB_TRAIN),
            "--output_dir",
            str(out / "mlm"),
            "--do_train",
            "--do_eval",
            "--max_seq_length",
            "128",
            "--max_steps",
            "60",
            "--warmup_steps",
            "5",
            "--learning_rate",
            "2e-3",
            "--per_device_train_batch_size",
            "16",
            "--save_steps",
            "30",
            *QUIET,
        ]
    )
    step("4. IMDb-format fine-tuning, best epoch on held-out reviews, test accuracy (recipes/finetune_imdb.py)")
    imdb = finetune_imdb.main(
        [
            "--model_name_or_path",
            str(out / "mlm"),
            "--train_file",
            str(IMDB_TRAIN),
            "--test_file",
            str(IMDB_TEST),
            "--validation_split_percentage",
            "10",
            "--output_dir",
            str(out / "imdb"),
            "--do_train",
            "--do_eval",
            "--do_predict",
            "--num_train_epochs",
            "8",
            "--learning_rate",
            "1e-3",
            "--per_device_train_batch_size",
            "16",
            *QUIET,
        ]
    )
    step("5. causal LongShort LM: train briefly, generate")
    first_loss, last_loss, generated = causal_lm(out / "mlm", out / "causal", steps=240)
    step("6. Hub repo folder (recipes/push_to_hub.py --dry-run)")
    push_to_hub.main([str(out / "imdb"), "demo/roberta-ls-tiny-imdb-sample", "--dry-run", str(out / "hub")])
    return {
        "tiny RoBERTa + tokenizer (source)": str(converted.with_name(converted.name + "-roberta")),
        "converted LongShort masked LM": str(converted),
        "masked-LM pretraining output": str(out / "mlm"),
        "masked-LM eval perplexity": round(mlm["perplexity"], 2),
        "IMDb-format classifier (best validation epoch)": str(out / "imdb"),
        "IMDb-format validation accuracy (held out)": f"{imdb['eval_accuracy']:.4f}",
        "IMDb-format test accuracy of that classifier": f"{imdb['test_accuracy']:.4f}",
        "causal LM output": str(out / "causal"),
        "causal LM training loss first -> last": f"{first_loss:.3f} -> {last_loss:.3f}",
        "causal LM greedy continuation": generated,
        "Hub repo folder (dry run)": str(out / "hub"),
        "seconds": round(time.perf_counter() - start, 1),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m recipes.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", help="where the artefacts go (new or empty; default: a fresh temp folder)")
    args = parser.parse_args(argv)
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="ls-demo-")).resolve()
    if out.exists() and any(out.iterdir()):
        parser.error(f"--output-dir {str(out)!r} is not empty; pick a new folder.")
    levels = transformers.utils.logging.get_verbosity(), datasets.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    try:
        with one_thread():  # a 2-layer, 32-wide model runs fastest on one thread
            summary = run(out)
    finally:  # the recipes set the libraries' log levels: restore them and the progress bars for the caller
        transformers.utils.logging.set_verbosity(levels[0])
        datasets.utils.logging.set_verbosity(levels[1])
        transformers.utils.logging.enable_progress_bar()
        datasets.enable_progress_bars()
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("\nSummary (also in summary.json):")
    for key, value in summary.items():
        print(f"  {key:<46} {value}")
    return summary


if __name__ == "__main__":
    main()

"""Tiny local stand-ins for roberta-base: a byte-level BPE tokenizer trained on local text and a small RoBERTa.

They let the demo and the tests run the real recipes offline in seconds; nothing is downloaded. As a command, a small
converted model to try every recipe with, offline:

    python -m recipes.tiny --output_dir tiny-roberta-ls

writes the LongShort masked LM (2 layers, hidden 32, 512 tokens, window 16, rank 4) to ``tiny-roberta-ls`` and the
RoBERTa it was converted from, with its tokenizer, to ``tiny-roberta-ls-roberta`` (a source for ``ls-convert``).
"""

import argparse
import contextlib
import csv
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import RobertaConfig, RobertaForMaskedLM, RobertaTokenizer

from ls_hf.convert_roberta import convert_roberta

DATA = Path(__file__).parent / "data"
IMDB_TRAIN = DATA / "imdb_train.csv"
IMDB_TEST = DATA / "imdb_test.csv"
# RoBERTa's special tokens, in RoBERTa's id order (<s>=0, <pad>=1, </s>=2, <unk>=3, <mask>=4).
SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


@contextlib.contextmanager
def one_thread():
    """Run torch on one thread inside the block: tiny models run many times faster than on two busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def sample_texts() -> list[str]:
    """The texts of the shipped IMDb-format sample (train and test)."""
    texts = []
    for path in (IMDB_TRAIN, IMDB_TEST):
        with open(path, newline="") as f:
            texts += [row["text"] for row in csv.DictReader(f)]
    return texts


def train_tokenizer(texts: list[str], vocab_size: int = 400, model_max_length: int = 512) -> RobertaTokenizer:
    """A RoBERTa tokenizer (byte-level BPE, RoBERTa's special tokens) trained on ``texts``."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        texts, vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS, show_progress=False
    )
    with tempfile.TemporaryDirectory() as folder:
        vocab, merges = bpe.save_model(folder)
        return RobertaTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def tiny_roberta(folder, texts: list[str] | None = None, *, max_length: int = 512, seed: int = 0) -> Path:
    """Save a randomly initialised 2-layer RoBERTa masked LM (hidden 32) and its tokenizer into ``folder``.

    The tokenizer is trained on ``texts`` (default: the shipped IMDb sample); the model reads ``max_length`` tokens.
    """
    tokenizer = train_tokenizer(texts or sample_texts(), model_max_length=max_length)
    config = RobertaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=max_length + tokenizer.pad_token_id + 1,
        type_vocab_size=1,
        layer_norm_eps=1e-5,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = RobertaForMaskedLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)


def tiny_long_short(folder, *, window_size: int = 16, projection_rank: int = 4, max_length: int = 512) -> Path:
    """``tiny_roberta`` converted by ``ls-convert-roberta`` (DualLN on) into ``folder``; its RoBERTa source is saved
    next to it as ``source_folder(folder)``."""
    folder = Path(folder)
    source = tiny_roberta(source_folder(folder), max_length=max_length)
    return convert_roberta(
        source,
        folder,
        max_position_embeddings=max_length,
        window_size=window_size,
        projection_rank=projection_rank,
        log=lambda message: None,
    )


def source_folder(folder) -> Path:
    """Where ``tiny_long_short`` saves the RoBERTa it converts into ``folder``: ``<folder>-roberta`` beside it."""
    return Path(folder).with_name(Path(folder).name + "-roberta")


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(
        prog="python -m recipes.tiny",
        description="Build a small RoBERTa and its tokenizer from the shipped sample and convert it into a LongShort "
        "masked LM, offline in seconds: a model to try every recipe with (--model_name_or_path OUTPUT_DIR).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--output_dir", required=True, help="the converted model; its RoBERTa goes to OUTPUT_DIR-roberta"
    )
    parser.add_argument("--max_length", type=int, default=512, help="tokens the model reads")
    parser.add_argument("--window_size", type=int, default=16, help="window segment length w")
    parser.add_argument("--projection_rank", type=int, default=4, help="dynamic projection rank r")
    parser.add_argument("--overwrite", action="store_true", help="replace the two folders if they hold files")
    args = parser.parse_args(argv)
    folder = Path(args.output_dir).expanduser().resolve()
    targets = (folder, source_folder(folder))
    for path in targets:
        if path.exists() and (not path.is_dir() or any(path.iterdir())) and not args.overwrite:
            parser.error(f"{str(path)!r} already exists and is not empty; pass --overwrite to replace it.")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as built, one_thread():  # nothing half-written in place
        try:
            tiny_long_short(
                Path(built) / folder.name,
                window_size=args.window_size,
                projection_rank=args.projection_rank,
                max_length=args.max_length,
            )
        except ValueError as err:
            parser.error(str(err))
        for path in targets:
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
            (Path(built) / path.name).rename(path)
    print(
        f"wrote {folder} (LongShort masked LM: 2 layers, hidden 32, {args.max_length} tokens, window "
        f"{args.window_size}, rank {args.projection_rank}) and its source {source_folder(folder)} (RoBERTa and its "
        f"tokenizer). Try it: python -m recipes.finetune_imdb --model_name_or_path {folder} --train_file "
        f"{IMDB_TRAIN} --output_dir {folder}-imdb --do_train --do_eval --max_steps 20"
    )
    return folder


if __name__ == "__main__":
    main()

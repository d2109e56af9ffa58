"""Tiny local stand-ins for roberta-base: a byte-level BPE tokenizer trained on local text and a small RoBERTa.

They let the demo and the tests run the real recipes offline in seconds; nothing is downloaded.
"""

import contextlib
import csv
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
    next to it as ``<folder>-roberta``."""
    folder = Path(folder)
    source = tiny_roberta(folder.with_name(folder.name + "-roberta"), max_length=max_length)
    return convert_roberta(
        source,
        folder,
        max_position_embeddings=max_length,
        window_size=window_size,
        projection_rank=projection_rank,
        log=lambda message: None,
    )

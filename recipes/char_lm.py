"""Character-level language modelling with ``LongShortForCausalLM`` trained from scratch (paper Sec. 4.2, enwik8).

    python -m recipes.char_lm --train_file enwik8.zip --output_dir ls-enwik8 --do_train --do_eval --do_predict \\
        --bf16 --max_steps 430000                       # the paper's model: a GPU
    python -m recipes.char_lm --train_file corpus.txt --output_dir ls-chars --do_train --do_eval \\
        --num_hidden_layers 4 --hidden_size 256 --num_attention_heads 4 --window_size 128 --max_seq_length 512 \\
        --max_positions 512 --per_device_train_batch_size 4 --warmup_steps 200 --max_steps 2000   # fits a CPU

``--train_file`` takes any file as bytes, or a zip archive holding one file: the raw enwik8 and text8 files
(``enwik8.zip`` and ``text8.zip`` from http://mattmahoney.net/dc/, unpacked or not) are read as they are, and cut 90/5/5
as the paper does. ``--dataset_name`` reads a Hub dataset's text column instead (``datasets`` no longer runs the
loading scripts that some Hub copies of enwik8 hold). Before training, a rough memory estimate of a step refuses a
configuration that cannot fit in the memory available.

The text is modelled byte by byte (ByT5's byte tokenizer: one token per byte, nothing to download) and split as
enwik8 is: the first 90 % of the bytes for training, the next 5 % for validation and the last 5 % for testing, unless
--validation_file / --test_file are given. Training blocks are --max_seq_length bytes. Evaluation reports bits per
character (``eval_bpc``, ``test_bpc``: the loss over ln 2) on consecutive blocks of that length, so the first bytes of
a block see little context (the paper scores each 512 bytes after 32K of context).

The defaults are the paper's smaller model and schedule (Appendix D): 12 layers of width 512 with 8 heads, w = 512,
l = 16, r = 1, dropout 0.2, weight decay 0.01, a constant learning rate of 2.5e-4 after 10k warmup steps, no
gradient clipping; its batches of 32, 32 and 16 blocks are --per_device_train_batch_size times the devices times
--gradient_accumulation_steps. The paper trains in three phases of 2048, 4096 and 8192 bytes: run the recipe three
times, each phase with the previous output as --model_name_or_path and a longer --max_seq_length. Not reproduced
here: the paper's model is Pre-LN with a relative position encoding of the projected segments and a Transformer-XL
memory; this one is the package's RoBERTa-style (Post-LN) LongShort decoder with learned absolute positions.

The saved tokenizer is ByT5's, which appends ``</s>`` unless told not to; training saw none, so encode prompts with
``add_special_tokens=False`` (also a ``pipeline("text-generation")`` argument).
"""

import math
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from datasets import Dataset, DatasetDict, load_dataset
from transformers import (
    AutoModelForCausalLM,
    ByT5Tokenizer,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainingArguments,
    set_seed,
)

from ls_hf import LongShortConfig, LongShortForCausalLM
from recipes.common import (
    UsageError,
    check_memory,
    checkpoint_to_resume,
    cli,
    finish,
    long_short_config,
    parse_args,
    setup_logging,
)

SPLITS = ("train", "validation", "test")


@dataclass
class CharLmArguments:
    """The data, and the model: a new one of the given shape, or --model_name_or_path (a previous phase)."""

    train_file: str | None = field(default=None, metadata={"help": "Local text file (bytes; split 90/5/5)."})
    validation_file: str | None = field(default=None, metadata={"help": "Local validation text (else the 5 percent after the training text)."})
    test_file: str | None = field(default=None, metadata={"help": "Local test text (else the last 5 percent of the training text)."})
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset (e.g. enwik8), its train split."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "e.g. enwik8-raw (the whole text)."})
    text_column_name: str = field(default="text", metadata={"help": "Column of --dataset_name holding the text."})
    max_seq_length: int = field(default=2048, metadata={"help": "Bytes per training block (paper: 2048/4096/8192)."})
    model_name_or_path: str | None = field(default=None, metadata={"help": "Continue from this char-LM folder."})
    num_hidden_layers: int = field(default=12, metadata={"help": "New model: layers."})
    hidden_size: int = field(default=512, metadata={"help": "New model: width."})
    num_attention_heads: int = field(default=8, metadata={"help": "New model: heads."})
    window_size: int = field(default=512, metadata={"help": "New model: short-term window w."})
    projection_rank: int = field(default=1, metadata={"help": "New model: projected rows r per segment."})
    causal_segment_length: int = field(default=16, metadata={"help": "New model: segment length l."})
    max_positions: int = field(default=8192, metadata={"help": "New model: longest block of any later phase."})
    dropout: float = field(default=0.2, metadata={"help": "New model: hidden and attention dropout."})

    def check(self) -> None:
        """Raise ``ValueError`` naming the argument if the data cannot be read."""
        if (self.train_file is None) == (self.dataset_name is None):
            raise ValueError("pass exactly one of --train_file (a local text file) and --dataset_name (Hub).")
        for split in SPLITS:
            path = getattr(self, f"{split}_file")
            if path is not None and not Path(path).is_file():
                raise ValueError(f"--{split}_file {path!r}: no such file.")
        if self.max_seq_length < 2:
            raise ValueError(f"--max_seq_length must be at least 2 bytes, got {self.max_seq_length}.")

    def data_name(self, split: str) -> str:
        """What ``split`` is read from, for model cards: its own file, else the training text's source."""
        path = getattr(self, f"{split}_file") or self.train_file
        return Path(path).name if path else self.dataset_name


@dataclass
class CharLmTrainingArguments(TrainingArguments):
    """TrainingArguments with the paper's char-LM schedule (Appendix D) as defaults."""

    learning_rate: float = field(default=2.5e-4, metadata={"help": "Peak learning rate (text8: 5e-4)."})
    prediction_loss_only: bool = field(default=True, metadata={"help": "Keep no logits when scoring (BPC only)."})
    warmup_steps: float = field(default=10000, metadata={"help": "Linear warmup steps (a fraction when below 1)."})
    lr_scheduler_type: str = field(default="constant_with_warmup", metadata={"help": "Constant after warmup."})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float = field(default=0.0, metadata={"help": "Gradient clipping (0: none, as the paper)."})
    save_total_limit: int | None = field(default=3, metadata={"help": "Checkpoints kept (the oldest are deleted)."})


def read_splits(args: CharLmArguments) -> dict[str, bytes]:
    """The bytes of each split: given files, else enwik8's contiguous 90/5/5 cut of the training text."""
    if args.train_file is not None:
        text = read_text_file(args.train_file, "--train_file")
    else:
        raw = load_dataset(args.dataset_name, args.dataset_config_name, split="train")
        if args.text_column_name not in raw.column_names:
            raise UsageError(f"--dataset_name {args.dataset_name!r} has no column {args.text_column_name!r} "
                             f"(columns: {raw.column_names}); name it with --text_column_name.")
        text = "\n".join(raw[args.text_column_name]).encode()
    given = {split: read_text_file(path, f"--{split}_file")
             for split in SPLITS[1:] if (path := getattr(args, f"{split}_file"))}
    held_out = [split for split in SPLITS[1:] if split not in given]
    part = len(text) // 20  # 5 %
    cut = len(text) - len(held_out) * part
    splits = {"train": text[:cut], **given}
    for i, split in enumerate(held_out):
        splits[split] = text[cut + i * part : cut + (i + 1) * part]
    return splits


def read_text_file(path: str, argument: str) -> bytes:
    """The bytes of ``path``, or of the one file in it if it is a zip archive (enwik8.zip, text8.zip)."""
    if not zipfile.is_zipfile(path):
        return Path(path).read_bytes()
    with zipfile.ZipFile(path) as archive:
        members = [info for info in archive.infolist() if not info.is_dir()]
        if len(members) != 1:
            raise UsageError(f"{argument} {path!r} is a zip archive of {len(members)} files; it must hold exactly one "
                             f"(as enwik8.zip and text8.zip do), or pass the unpacked file.")
        return archive.read(members[0])


def blocks(data: bytes, length: int, offset: int, name: str) -> Dataset:
    """Byte token ids (``byte + offset``) in blocks of ``length``; the remainder is dropped."""
    count = len(data) // length
    if count == 0:
        raise UsageError(f"the {name} text holds {len(data)} bytes, fewer than one block; lower --max_seq_length "
                         f"({length}) or add text.")
    ids = np.frombuffer(data[: count * length], dtype=np.uint8).astype(np.int64) + offset
    return Dataset.from_dict({"input_ids": ids.reshape(count, length)})


def bits_per_character(metrics: dict) -> dict:
    """``<prefix>_bpc`` from ``<prefix>_loss`` (nats per byte)."""
    key = next(k for k in metrics if k.endswith("_loss"))
    return {key[: -len("loss")] + "bpc": metrics[key] / math.log(2)}


def build_model(args: CharLmArguments, tokenizer: ByT5Tokenizer):
    """A new ``LongShortForCausalLM`` of the requested shape, or the byte-level one in --model_name_or_path."""
    if args.model_name_or_path is not None:
        name = args.model_name_or_path
        config = long_short_config(name, "--model_name_or_path")
        if not config.is_decoder or config.vocab_size != len(tokenizer):
            raise UsageError(f"--model_name_or_path {name!r} is not a byte-level LongShort decoder (an earlier "
                             f"output of this recipe); start a new model by leaving it out.")
        return AutoModelForCausalLM.from_pretrained(name, config=config)
    config = LongShortConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads, intermediate_size=4 * args.hidden_size,
        window_size=args.window_size, projection_rank=args.projection_rank,
        causal_segment_length=args.causal_segment_length, is_decoder=True,
        max_position_embeddings=args.max_positions + tokenizer.pad_token_id + 1,
        hidden_dropout_prob=args.dropout, attention_probs_dropout_prob=args.dropout,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
    )
    return LongShortForCausalLM(config)


@cli
def main(argv=None) -> dict:
    args, training_args = parse_args((CharLmArguments, CharLmTrainingArguments), argv,
                                     ("do_train", "do_eval", "do_predict"))
    setup_logging(training_args)
    set_seed(training_args.seed)

    tokenizer = ByT5Tokenizer()
    model = build_model(args, tokenizer)
    if args.max_seq_length > model.config.max_input_length:
        raise UsageError(f"--max_seq_length {args.max_seq_length} exceeds the {model.config.max_input_length} "
                         f"positions of the model; raise --max_positions for a new model.")
    checkpoint = checkpoint_to_resume(training_args, model)
    if training_args.do_train:
        check_memory(model, training_args.per_device_train_batch_size, args.max_seq_length, training_args)
    offset = tokenizer("\x00", add_special_tokens=False).input_ids[0]
    needed = {"train": training_args.do_train, "test": training_args.do_predict,
              "validation": training_args.do_eval or training_args.eval_strategy != "no"}
    data = DatasetDict({split: blocks(text, args.max_seq_length, offset, split)
                        for split, text in read_splits(args).items() if needed[split]})

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=data.get("train"),
        eval_dataset=data.get("validation"),
        processing_class=tokenizer,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    return finish(trainer, training_args, args, checkpoint, bits_per_character, data.get("test"))


if __name__ == "__main__":
    main()

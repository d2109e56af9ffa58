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

The text is modelled byte by byte (``byte_tokenizer``: ByT5's ids, one per byte, nothing to download) and split as
enwik8 is: the first 90 % of the bytes for training, the next 5 % for validation and the last 5 % for testing, unless
--validation_file / --test_file are given. Training blocks are --max_seq_length bytes. Evaluation reports bits per
character (``eval_bpc``, ``test_bpc``: the loss over ln 2) on consecutive blocks of that length, so the first bytes of
a block see little context (the paper scores each 512 bytes after 32K of context).

The defaults are the paper's smaller model and schedule (Appendix D): 12 layers of width 512 with 8 heads, w = 512,
l = 16, r = 1, dropout 0.2, weight decay 0.01, a constant learning rate of 2.5e-4 after 10k warmup steps, no
gradient clipping; its batches of 32, 32 and 16 blocks are --per_device_train_batch_size times the devices times
--gradient_accumulation_steps. The paper trains in three phases of 2048, 4096 and 8192 bytes: run the recipe three
times, each phase with the previous output as --model_name_or_path and a longer --max_seq_length.

--model_type long_short (the default) trains the package's RoBERTa-style (Post-LN) LongShort decoder with learned
absolute positions. --model_type long_short_xl trains the paper's model as the official code builds it
(``LongShortXLForCausalLM``: Pre-LN, Transformer-XL relative positions, a memory of earlier blocks): training batches
continue the same --per_device_train_batch_size streams (truncated backpropagation through time, --memory_length
tokens per layer, the block length by default as the official scripts), and evaluation streams each split once with
--eval_memory_length bytes of context before every block of --eval_block_length (the official 32768 and 256), also
reporting block-by-block scoring of the same model (``*_block_bpc``: each --max_seq_length block on its own). Each
stream starts as the official code starts it, with a full memory of zeros (``--stream_start zeros``:
``LongShortXLForCausalLM.initial_memory``); ``--stream_start empty`` starts it with no memory.

The saved tokenizer adds no special token to a text (training saw none), so ``generate`` and
``pipeline("text-generation")`` continue a prompt where it ends.
"""

import math
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset, DatasetDict
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DataCollatorForLanguageModeling,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.trainer_utils import PredictionOutput

from ls_hf import LongShortConfig, LongShortForCausalLM, LongShortXLConfig, LongShortXLForCausalLM
from recipes.common import (
    UsageError,
    check_memory,
    checkpoint_to_resume,
    cli,
    finish,
    hub_dataset,
    long_short_config,
    parse_args,
    setup_logging,
)

SPLITS = ("train", "validation", "test")


@dataclass
class CharLmArguments:
    """The data, and the model: a new one of the given shape, or --model_name_or_path (a previous phase)."""

    train_file: str | None = field(default=None, metadata={"help": "Local text file (bytes; split 90/5/5)."})
    validation_file: str | None = field(
        default=None, metadata={"help": "Local validation text (else the 5 percent after the training text)."}
    )
    test_file: str | None = field(
        default=None, metadata={"help": "Local test text (else the last 5 percent of the training text)."}
    )
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
    max_positions: int = field(
        default=8192,
        metadata={
            "help": "New long_short model: longest block of any later phase (long_short_xl has relative positions and "
            "no such limit)."
        },
    )
    dropout: float = field(default=0.2, metadata={"help": "New model: hidden and attention dropout."})
    attention_dropout: float | None = field(
        default=None,
        metadata={
            "help": "New long_short model: attention dropout (default: --dropout; 0 lets --recompute_window_tiles "
            "take effect)."
        },
    )
    recompute_window_tiles: bool = field(
        default=False,
        metadata={
            "help": "long_short: memory-lean training on CPU (window tiles built again in the backward pass; needs no "
            "attention dropout)."
        },
    )
    model_type: str = field(
        default="long_short",
        metadata={
            "help": "New model: long_short (Post-LN, absolute positions) or long_short_xl (the paper's official model: "
            "Pre-LN, relative positions, memory).",
            "choices": ["long_short", "long_short_xl"],
        },
    )
    use_dual_ln: bool = field(default=True, metadata={"help": "New model: DualLN (False: the paper's ablation)."})
    window_rule: str = field(
        default="token",
        metadata={
            "help": "New long_short_xl model: token (official, w keys per token) or segment (paper Appendix D).",
            "choices": ["token", "segment"],
        },
    )
    projection_input: str = field(
        default="raw",
        metadata={
            "help": "New long_short_xl model: raw (official) or normalized (paper Sec. 3.4) keys into the projection.",
            "choices": ["raw", "normalized"],
        },
    )
    memory_length: int | None = field(
        default=None,
        metadata={"help": "long_short_xl: tokens of memory per layer in training (default --max_seq_length; 0: none)."},
    )
    eval_memory_length: int = field(default=32768, metadata={"help": "long_short_xl: context bytes when scoring."})
    eval_block_length: int = field(default=256, metadata={"help": "long_short_xl: bytes scored per step."})
    eval_streams: int = field(
        default=1,
        metadata={
            "help": "long_short_xl: score a split as this many parallel streams (1: exact, as the official batch 1)."
        },
    )
    stream_start: str = field(
        default="zeros",
        metadata={
            "help": "long_short_xl: how a stream starts, in training and scoring: zeros (official: a full memory of "
            "zeros) or empty (no memory).",
            "choices": ["zeros", "empty"],
        },
    )

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
        for name in ("eval_block_length", "eval_streams"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1, got {getattr(self, name)}.")

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
        raw = hub_dataset(args.dataset_name, args.dataset_config_name, split="train")
        if args.text_column_name not in raw.column_names:
            raise UsageError(
                f"--dataset_name {args.dataset_name!r} has no column {args.text_column_name!r} "
                f"(columns: {raw.column_names}); name it with --text_column_name."
            )
        text = "\n".join(raw[args.text_column_name]).encode()
    given = {
        split: read_text_file(path, f"--{split}_file")
        for split in SPLITS[1:]
        if (path := getattr(args, f"{split}_file"))
    }
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
            raise UsageError(
                f"{argument} {path!r} is a zip archive of {len(members)} files; it must hold exactly one "
                f"(as enwik8.zip and text8.zip do), or pass the unpacked file."
            )
        return archive.read(members[0])


def blocks(data: bytes, length: int, offset: int, name: str) -> Dataset:
    """Byte token ids (``byte + offset``) in blocks of ``length``; the remainder is dropped."""
    count = len(data) // length
    if count == 0:
        raise UsageError(
            f"the {name} text holds {len(data)} bytes, fewer than one block; lower --max_seq_length "
            f"({length}) or add text."
        )
    ids = np.frombuffer(data[: count * length], dtype=np.uint8).astype(np.int64) + offset
    return Dataset.from_dict({"input_ids": ids.reshape(count, length)})


def bits_per_character(metrics: dict) -> dict:
    """``<prefix>_bpc`` from ``<prefix>_loss`` (nats per byte)."""
    key = next(k for k in metrics if k.endswith("_loss"))
    return {key[: -len("loss")] + "bpc": metrics[key] / math.log(2)}


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """ByT5's byte tokenizer (``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, byte b -> b + 3, ``<extra_id_i>`` 259 + i: the
    same ids and decoding) as a fast tokenizer that adds nothing to a text, where ``ByT5Tokenizer`` appends ``</s>``,
    which would end a prompt with an end token. ``AutoTokenizer`` loads it anywhere."""
    chars = bytes_to_unicode()  # byte-level BPE's one character per byte; no merges: one token per byte
    backend = Tokenizer(
        models.BPE(
            vocab={"<pad>": 0, "</s>": 1, "<unk>": 2, **{chars[b]: b + 3 for b in range(256)}},
            merges=[],
            unk_token="<unk>",
        )
    )
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    pad, eos, unk = (AddedToken(token, lstrip=True, rstrip=True) for token in ("<pad>", "</s>", "<unk>"))  # as ByT5
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=pad,
        eos_token=eos,
        unk_token=unk,
        extra_special_tokens=[f"<extra_id_{i}>" for i in range(125)],
        padding_side="left",
    )


def build_model(args: CharLmArguments, tokenizer: PreTrainedTokenizerFast):
    """A new ``LongShortForCausalLM`` of the requested shape, or the byte-level one in --model_name_or_path."""
    if args.model_type == LongShortXLConfig.model_type:
        return build_xl_model(args, tokenizer)
    if args.model_name_or_path is not None:
        name = args.model_name_or_path
        config = long_short_config(name, "--model_name_or_path")
        if not config.is_decoder or config.vocab_size != len(tokenizer):
            raise UsageError(
                f"--model_name_or_path {name!r} is not a byte-level LongShort decoder (an earlier "
                f"output of this recipe); start a new model by leaving it out."
            )
        config.recompute_window_tiles = args.recompute_window_tiles
        return AutoModelForCausalLM.from_pretrained(name, config=config)
    attention_dropout = args.dropout if args.attention_dropout is None else args.attention_dropout
    config = LongShortConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads,
        intermediate_size=4 * args.hidden_size,
        window_size=args.window_size,
        projection_rank=args.projection_rank,
        causal_segment_length=args.causal_segment_length,
        is_decoder=True,
        max_position_embeddings=args.max_positions + tokenizer.pad_token_id + 1,
        hidden_dropout_prob=args.dropout,
        attention_probs_dropout_prob=attention_dropout,
        use_dual_ln=args.use_dual_ln,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        recompute_window_tiles=args.recompute_window_tiles,
    )
    return LongShortForCausalLM(config)


def build_xl_model(args: CharLmArguments, tokenizer: PreTrainedTokenizerFast) -> LongShortXLForCausalLM:
    """A new ``LongShortXLForCausalLM`` (the official model: dropout on hidden states, embeddings and positions, none
    on attention probabilities), or the byte-level one in --model_name_or_path with --memory_length if given."""
    memory_length = args.max_seq_length if args.memory_length is None else args.memory_length
    if args.model_name_or_path is not None:
        name = args.model_name_or_path
        try:
            config = AutoConfig.from_pretrained(name)
        except OSError as err:
            raise UsageError(f"--model_name_or_path {name!r}: no model there ({err}).") from err
        if config.model_type != LongShortXLConfig.model_type or config.vocab_size != len(tokenizer):
            raise UsageError(
                f"--model_name_or_path {name!r} is not a byte-level long_short_xl model (an earlier output "
                f"of this recipe with --model_type long_short_xl); start a new model by leaving it out."
            )
        config.memory_length = memory_length if args.memory_length is not None else config.memory_length
        config.check_long_short()
        return LongShortXLForCausalLM.from_pretrained(name, config=config)
    try:
        config = LongShortXLConfig(
            vocab_size=len(tokenizer),
            hidden_size=args.hidden_size,
            num_hidden_layers=args.num_hidden_layers,
            num_attention_heads=args.num_attention_heads,
            intermediate_size=4 * args.hidden_size,
            window_size=args.window_size,
            projection_rank=args.projection_rank,
            causal_segment_length=args.causal_segment_length,
            hidden_dropout_prob=args.dropout,
            use_dual_ln=args.use_dual_ln,
            memory_length=memory_length,
            window_rule=args.window_rule,
            projection_input=args.projection_input,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
        )
    except ValueError as err:
        raise UsageError(f"--model_type long_short_xl: {err}") from err
    return LongShortXLForCausalLM(config)


def stream_blocks(data: bytes, length: int, streams: int, offset: int, name: str) -> Dataset:
    """The text as ``streams`` contiguous streams cut into blocks of ``length``, ordered so that row ``k * streams +
    s`` is block k of stream s: batches of ``streams`` rows continue the previous batch's streams. Each row holds
    ``input_ids`` and ``shift_labels`` (the next byte of every input byte)."""
    per_stream = (len(data) - 1) // streams // length * length
    if per_stream == 0:
        raise UsageError(
            f"the {name} text holds {len(data)} bytes, fewer than one block per stream; lower "
            f"--max_seq_length ({length}) or --per_device_train_batch_size ({streams}), or add text."
        )
    ids = np.frombuffer(data, dtype=np.uint8).astype(np.int64) + offset
    rows = [ids[s * per_stream : (s + 1) * per_stream + 1] for s in range(streams)]
    inputs = np.stack([row[:-1] for row in rows]).reshape(streams, -1, length).transpose(1, 0, 2)
    labels = np.stack([row[1:] for row in rows]).reshape(streams, -1, length).transpose(1, 0, 2)
    return Dataset.from_dict({"input_ids": inputs.reshape(-1, length), "shift_labels": labels.reshape(-1, length)})


@torch.no_grad()
def stream_loss(
    model: LongShortXLForCausalLM,
    data: bytes,
    offset: int,
    block_length: int,
    memory_length: int,
    streams: int = 1,
    stream_start: str = "zeros",
) -> float:
    """Nats per byte of every byte after the first given all bytes before it that the memory holds: the text is cut
    into ``streams`` contiguous parts, each scored ``block_length`` bytes at a time with up to ``memory_length`` bytes
    of memory (0: every block on its own), starting from ``memory_length`` zeros (``stream_start="zeros"``, official)
    or from no memory (``"empty"``). Official evaluation: one stream, blocks of 256, memory 32768."""
    per_stream = (len(data) - 1) // streams
    if per_stream < 1:
        raise UsageError(f"a text of {len(data)} bytes cannot be scored as {streams} streams; lower --eval_streams.")
    ids = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).astype(np.int64) + offset).to(model.device)
    inputs = torch.stack([ids[s * per_stream : (s + 1) * per_stream] for s in range(streams)])
    targets = torch.stack([ids[s * per_stream + 1 : (s + 1) * per_stream + 1] for s in range(streams)])
    memory = model.initial_memory(streams, memory_length) if stream_start == "zeros" else None
    training, total = model.training, 0.0
    model.eval()
    for start in range(0, per_stream, block_length):
        out = model(
            inputs[:, start : start + block_length], memory=memory, memory_length=memory_length, use_cache=False
        )
        logp = out.logits.to(torch.promote_types(out.logits.dtype, torch.float32)).log_softmax(-1)
        total -= logp.gather(-1, targets[:, start : start + block_length, None]).sum().item()
        memory = out.memory
    model.train(training)
    return total / (streams * per_stream)


class StreamTrainer(Trainer):
    """A ``Trainer`` for ``LongShortXLForCausalLM``: training batches continue the same streams (a ``stream_blocks``
    dataset read in order, ``train_sampling_strategy="sequential"``) and each step passes the previous step's memory,
    detached (truncated backpropagation through time; the first step ``initial_memory`` when ``stream_start`` is
    ``"zeros"``); ``evaluate`` and ``predict`` score the raw split with ``stream_loss``, streaming and block by
    block."""

    def __init__(self, *args, texts: dict, scoring: dict, stream_start: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.texts, self.scoring, self.stream_start, self.memory = texts, scoring, stream_start, None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.memory is None and self.stream_start == "zeros":
            self.memory = self.model.initial_memory(len(inputs["input_ids"]))
        outputs = model(**inputs, memory=self.memory)
        self.memory = outputs.memory
        return (outputs.loss, outputs) if return_outputs else outputs.loss

    def _score(self, split: str, prefix: str) -> dict:
        model, s = self.model, self.scoring
        metrics = {
            f"{prefix}_loss": stream_loss(
                model,
                self.texts[split],
                s["offset"],
                s["eval_block_length"],
                s["eval_memory_length"],
                s["eval_streams"],
                self.stream_start,
            ),
            f"{prefix}_block_bpc": stream_loss(
                model, self.texts[split], s["offset"], s["block_length"], 0, s["eval_streams"]
            )
            / math.log(2),
            f"{prefix}_memory_length": s["eval_memory_length"],
        }
        self.log(metrics)
        return metrics

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        return self._score("validation", metric_key_prefix)

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix="test"):
        return PredictionOutput(predictions=None, label_ids=None, metrics=self._score("test", metric_key_prefix))


@cli
def main(argv=None) -> dict:
    args, training_args = parse_args(
        (CharLmArguments, CharLmTrainingArguments), argv, ("do_train", "do_eval", "do_predict")
    )
    setup_logging(training_args)
    set_seed(training_args.seed)

    tokenizer = byte_tokenizer()
    model = build_model(args, tokenizer)
    if not isinstance(model, LongShortXLForCausalLM) and args.max_seq_length > model.config.max_input_length:
        raise UsageError(
            f"--max_seq_length {args.max_seq_length} exceeds the {model.config.max_input_length} "
            f"positions of the model; raise --max_positions for a new model."
        )
    checkpoint = checkpoint_to_resume(training_args, model)
    if training_args.do_train:
        check_memory(
            model,
            training_args.per_device_train_batch_size,
            args.max_seq_length,
            training_args,
            dropout_option="--attention_dropout",
        )
    offset = tokenizer("\x00", add_special_tokens=False).input_ids[0]
    needed = {
        "train": training_args.do_train,
        "test": training_args.do_predict,
        "validation": training_args.do_eval or training_args.eval_strategy != "no",
    }
    if isinstance(model, LongShortXLForCausalLM):
        texts = {split: text for split, text in read_splits(args).items() if needed[split]}
        trainer = stream_trainer(model, args, training_args, tokenizer, texts, offset)
        return finish(trainer, training_args, args, checkpoint, bits_per_character)
    data = DatasetDict(
        {
            split: blocks(text, args.max_seq_length, offset, split)
            for split, text in read_splits(args).items()
            if needed[split]
        }
    )

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=data.get("train"),
        eval_dataset=data.get("validation"),
        processing_class=tokenizer,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    return finish(trainer, training_args, args, checkpoint, bits_per_character, data.get("test"))


def stream_trainer(model, args, training_args, tokenizer, texts: dict, offset: int) -> StreamTrainer:
    """The ``StreamTrainer`` of a long_short_xl run: --per_device_train_batch_size streams of the training text."""
    if training_args.world_size > 1:
        raise UsageError(
            "--model_type long_short_xl trains the streams of one process (its memory continues "
            "them batch to batch); run it in a single process."
        )
    segment = model.config.causal_segment_length
    if args.eval_memory_length < 0 or args.eval_memory_length % segment:
        raise UsageError(
            f"--eval_memory_length must be a multiple of the segment length l = {segment} (the memory "
            f"is compressed segment by segment), got {args.eval_memory_length}."
        )
    train = None
    if "train" in texts:
        train = stream_blocks(
            texts["train"], args.max_seq_length, training_args.per_device_train_batch_size, offset, "train"
        )
    training_args.label_names = ["shift_labels"]
    training_args.train_sampling_strategy = "sequential"  # the dataset is in stream order
    scoring = {
        "offset": offset,
        "block_length": args.max_seq_length,
        "eval_block_length": args.eval_block_length,
        "eval_memory_length": args.eval_memory_length,
        "eval_streams": args.eval_streams,
    }
    return StreamTrainer(
        model=model,
        args=training_args,
        train_dataset=train,
        processing_class=tokenizer,
        data_collator=default_data_collator,
        texts=texts,
        scoring=scoring,
        stream_start=args.stream_start,
    )


if __name__ == "__main__":
    main()

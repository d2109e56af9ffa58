"""What the recipes share: argument dataclasses, parsing with clear errors, data loading, logging, resuming."""

import ast
import codecs
import csv
import functools
import json
import logging
import re
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import torch
import transformers
from datasets import DatasetDict, load_dataset
from datasets.exceptions import DatasetGenerationError
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoTokenizer, HfArgumentParser, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from ls_hf import LongShortConfig, LongShortXLConfig
from ls_hf.convert_roberta import misspelt_folder
from ls_hf.hub import is_local_path
from recipes import memory

logger = logging.getLogger("recipes")
# File extension -> datasets builder for --train_file / --validation_file.
BUILDERS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".txt": "text"}


class UsageError(ValueError):
    """A bad argument or unusable data; the message names the argument and the fix."""


class FinishedRun(Exception):
    """--output_dir holds a run that has reached this run's limit: nothing is left to train. ``cli`` prints the
    message and returns ``results`` (the run's ``all_results.json``)."""

    def __init__(self, message: str, results: dict):
        super().__init__(message)
        self.results = results


def cli(main):
    """Decorate a recipe's ``main(argv=None)``: a ``UsageError`` exits with status 2 and its message, no traceback; a
    ``FinishedRun`` prints its message and returns the finished run's results, writing nothing.
    In a distributed run (``accelerate launch``, ``torchrun``), a ``main`` that returns destroys the process group:
    a process that exits with it alive may abort in the interpreter's shutdown (SIGABRT, "terminate called without an
    active exception": gloo's threads still hold tensors), which fails the launch although training went well. After
    an error it is left alone, as destroying it while other processes wait on it can hang."""

    @functools.wraps(main)
    def run(argv=None):
        try:
            results = main(argv)
        except UsageError as err:
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(2) from err
        except FinishedRun as finished:
            print(finished)
            results = finished.results
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        return results

    return run


def long_short_config(
    name, argument: str, trust_remote_code: bool = False, model_types: tuple[str, ...] = (LongShortConfig.model_type,)
):
    """The config of the model at ``name``; a ``UsageError`` naming ``argument`` unless its ``model_type`` is one of
    ``model_types`` (default: the LongShort encoder/decoder's)."""
    try:
        config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except OSError as err:
        where = "no model there" if is_local_path(name) else "no local folder of that name, and no model on the Hub"
        raise UsageError(f"{argument} {str(name)!r}: {where} ({err}).") from err
    if config.model_type not in model_types:
        if config.model_type == LongShortXLConfig.model_type:
            raise UsageError(
                f"{argument} {str(name)!r} holds a {config.model_type!r} model (LongShortXLForCausalLM, "
                f"the official character-level model), which only `recipes.char_lm --model_type "
                f"long_short_xl` continues training and `recipes.push_to_hub` publishes."
            )
        raise UsageError(
            f"{argument} {str(name)!r} holds a {config.model_type!r} model, not LongShort; convert a "
            f"RoBERTa checkpoint with ls-convert-roberta first."
        )
    return config


@dataclass
class ModelArguments:
    model_name_or_path: str = field(
        metadata={"help": "LongShort checkpoint: a folder written by ls-convert-roberta or a recipe, or a Hub id."}
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Run the checkpoint's own code (a Hub LongShort model without ls_hf)."}
    )
    recompute_window_tiles: bool = field(
        default=False,
        metadata={
            "help": "Memory-lean training on CPU: window tiles built again in the backward pass (needs no attention "
            "dropout: --attention_probs_dropout_prob 0)."
        },
    )
    attention_probs_dropout_prob: float | None = field(
        default=None,
        metadata={
            "help": "Attention dropout, instead of the checkpoint's (0 lets --recompute_window_tiles take effect)."
        },
    )

    def check(self) -> None:
        name, dropout = self.model_name_or_path, self.attention_probs_dropout_prob
        if dropout is not None and not 0 <= dropout < 1:
            raise ValueError(f"--attention_probs_dropout_prob is a probability, 0 <= p < 1; got {dropout}.")
        if is_local_path(name) and not (Path(name).expanduser() / "config.json").is_file():
            raise ValueError(
                f"--model_name_or_path {name!r}: no model folder there (no config.json); pass a folder "
                f"written by ls-convert-roberta or a recipe, or a Hub id."
            )
        if (close := misspelt_folder(name)) is not None:
            raise ValueError(
                f"--model_name_or_path {name!r}: no such local folder; did you mean {close!r}? (A Hub "
                f"model: give its id with the owner, owner/name.)"
            )

    def config(self):
        """The LongShort config of the model (``long_short_config``): read first, so that a model that is not there
        stops the run before its data are loaded."""
        return long_short_config(
            self.model_name_or_path, "--model_name_or_path", trust_remote_code=self.trust_remote_code
        )

    def load(self, auto_class, **kwargs):
        """The tokenizer and the ``auto_class`` model (in float32, ``kwargs`` for its config, with
        --recompute_window_tiles and --attention_probs_dropout_prob)."""
        name, remote = self.model_name_or_path, self.trust_remote_code
        self.config()
        kwargs["recompute_window_tiles"] = self.recompute_window_tiles
        if self.attention_probs_dropout_prob is not None:
            kwargs["attention_probs_dropout_prob"] = self.attention_probs_dropout_prob
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=remote)
        return tokenizer, auto_class.from_pretrained(name, dtype=torch.float32, trust_remote_code=remote, **kwargs)


@dataclass
class DataArguments:
    dataset_name: str | None = field(
        default=None, metadata={"help": "Hub dataset to load with load_dataset (ignored when --train_file is given)."}
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "Configuration of --dataset_name."})
    train_file: str | None = field(default=None, metadata={"help": "Local training data (.csv, .json, .jsonl, .txt)."})
    validation_file: str | None = field(default=None, metadata={"help": "Local evaluation data (same formats)."})
    eval_split: str = field(
        default="validation", metadata={"help": "Split of --dataset_name used for evaluation, if the dataset has it."}
    )
    validation_split_percentage: int = field(
        default=5,
        metadata={
            "help": "Percent of the training examples held out for evaluation when there is no validation data "
            "(--validation_file or --eval_split)."
        },
    )
    text_column_name: str = field(default="text", metadata={"help": "Column holding the text."})
    max_seq_length: int | None = field(
        default=None, metadata={"help": "Tokens per example; default: what the model and tokenizer allow."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only this many training examples."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep only this many evaluation examples."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenization."})
    # Set by load_data when the validation examples are --validation_split_percentage of the training ones.
    held_out: bool = field(default=False, init=False, repr=False)

    def files(self) -> dict[str, str]:
        """The local data file of each split given, e.g. ``{"train": ..., "validation": ...}``."""
        files = {"train": self.train_file, "validation": self.validation_file}
        return {split: path for split, path in files.items() if path is not None}

    def hub_splits(self) -> dict[str, str]:
        """The split of --dataset_name read for each split."""
        return {"train": "train", "validation": self.eval_split}

    def data_name(self, split: str) -> str:
        """What ``split`` is read from, for model cards: a local file's name or the Hub dataset, and for held-out
        validation examples the share of the training examples they are."""
        name = self.dataset_name if self.train_file is None else Path(self.files().get(split, self.train_file)).name
        if split == "validation" and self.held_out:
            return f"{name} ({self.validation_split_percentage} % held out)"
        return name

    def check(self) -> None:
        """Raise ``ValueError`` naming the argument if the data cannot be loaded."""
        if self.dataset_name is None and self.train_file is None:
            raise ValueError("no data: pass --dataset_name (a Hub dataset) or --train_file (a local file).")
        if self.train_file is None and is_local_path(self.dataset_name) and not Path(self.dataset_name).exists():
            raise ValueError(
                f"--dataset_name {self.dataset_name!r}: no such local folder; pass a dataset folder or a "
                f"Hub id (owner/name)."
            )
        files = self.files()
        if files and self.train_file is None:
            raise ValueError(f"--{next(iter(files))}_file needs --train_file (local files are used together).")
        for split, path in files.items():
            if Path(path).suffix not in BUILDERS:
                raise ValueError(f"--{split}_file {path!r}: unsupported extension; use one of {', '.join(BUILDERS)}.")
            if not Path(path).is_file():
                raise ValueError(f"--{split}_file {path!r}: no such file.")
            if Path(path).stat().st_size == 0:
                raise ValueError(f"--{split}_file {path!r} is empty; pass a file holding examples.")
        if len({BUILDERS[Path(path).suffix] for path in files.values()}) > 1:
            raise ValueError(
                f"{', '.join(f'--{split}_file' for split in files)} must have the same format (extension)."
            )
        for name in ("max_seq_length", "max_train_samples", "max_eval_samples"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name} must be a positive integer, got {getattr(self, name)}.")
        if not 0 < self.validation_split_percentage < 100:
            raise ValueError(f"--validation_split_percentage must be in 1..99, got {self.validation_split_percentage}.")


def parse_args(types, argv=None, actions=("do_train", "do_eval")):
    """Parse ``argv`` (default: the command line, or a single .json/.yaml file) into the ``types`` dataclasses.

    Invalid values, including those the dataclasses' ``check()`` or ``TrainingArguments`` reject, and a run with
    none of the recipe's ``actions`` (--do_train, ...) exit with status 2 and a message naming the argument.
    """
    parser = HfArgumentParser(types)
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if len(argv) == 1 and argv[0].endswith(".json"):
            args = parser.parse_json_file(argv[0])
        elif len(argv) == 1 and argv[0].endswith((".yaml", ".yml")):
            args = parser.parse_yaml_file(argv[0])
        else:
            args = parser.parse_args_into_dataclasses(argv)
        for group in args:
            if hasattr(group, "check"):
                group.check()
            if isinstance(group, transformers.TrainingArguments):
                if not any(getattr(group, a) for a in actions):
                    raise ValueError(f"nothing to do: pass at least one of {', '.join('--' + a for a in actions)}.")
                other = [a for a in ("do_train", "do_eval", "do_predict") if getattr(group, a) and a not in actions]
                if other:
                    raise ValueError(
                        f"--{other[0]} is not an action of this recipe; it takes "
                        f"{', '.join('--' + a for a in actions)}."
                    )
    except ValueError as err:
        parser.error(str(err))
    return args


def setup_logging(training_args) -> None:
    """Log to stderr at the Trainer's level for this process (info on the main process, warnings elsewhere)."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", handlers=[logging.StreamHandler()])
    level = training_args.get_process_log_level()
    logger.setLevel(level)
    datasets.utils.logging.set_verbosity(level)
    transformers.utils.logging.set_verbosity(level)


def hub_dataset(name: str, config_name: str | None, **kwargs):
    """``load_dataset(name, config_name, **kwargs)`` for --dataset_name; a ``UsageError`` naming the fix when the Hub
    cannot be reached (offline) or has no such dataset."""
    try:
        return load_dataset(name, config_name, **kwargs)
    except (ConnectionError, FileNotFoundError) as err:  # offline; DatasetNotFoundError is a FileNotFoundError
        raise UsageError(
            f"--dataset_name {name!r} could not be loaded ({str(err).splitlines()[0]}): without the Hub, "
            f"pass local files (--train_file, --validation_file, --test_file), or use a copy in the "
            f"datasets cache with HF_HUB_OFFLINE=1."
        ) from err


def column_option(data_args: DataArguments, column: str) -> str:
    """The option that names ``column``: --text_column_name or --label_column_name."""
    return "--text_column_name" if column == data_args.text_column_name else "--label_column_name"


def file_columns(path: str) -> list[str] | None:
    """The columns ``load_dataset`` reads from a local data file, as its first line tells them: a CSV's header, the
    keys of a JSON Lines file's first object, ``text`` for a text file; None when the first line does not tell (a JSON
    array spread over lines)."""
    if Path(path).suffix == ".txt":
        return ["text"]
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        if Path(path).suffix == ".csv":
            return next(csv.reader(f), [])
        try:
            first = json.loads(f.readline())
        except ValueError:
            return None
    return list(first) if isinstance(first, dict) else None


def utf8_error(path: str) -> str | None:
    """Where ``path`` stops being UTF-8 text, and why; None if all of it is."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            pending = len(decoder.getstate()[0])
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as err:
                at = offset - pending + err.start
                return f"byte {at}, {err.object[err.start : err.start + 1]!r}: {err.reason}"
            if not chunk:
                return None
            offset += len(chunk)


def unreadable_data(files: dict[str, str], err: Exception) -> str:
    """Why ``load_dataset`` could not read the local ``files`` (split -> path), naming the file and the fix: text that
    is not UTF-8, files with different columns, or a file without examples."""
    for split, path in files.items():
        if (problem := utf8_error(path)) is not None:
            utf8 = Path(path).with_name(f"{Path(path).stem}.utf8{Path(path).suffix}")
            return (
                f"--{split}_file {path!r} is not UTF-8 text ({problem}); the recipes read UTF-8: re-encode it, e.g. "
                f"from Latin-1: iconv -f latin1 -t utf-8 {path} > {utf8}"
            )
    columns = {split: file_columns(path) for split, path in files.items()}
    if len({frozenset(found) for found in columns.values() if found is not None}) > 1:
        listed = "; ".join(f"--{split}_file: {', '.join(found)}" for split, found in columns.items() if found)
        return (
            f"the data files have different columns ({listed}); they are read as one dataset, so give every file the "
            f"same columns."
        )
    return (
        f"no examples could be read from {', '.join(files.values())} ({err}); a CSV needs a header row and at least "
        f"one example row."
    )


def load_data(data_args: DataArguments, columns: list[str], need_eval: bool, need_test: bool = False) -> DatasetDict:
    """``train``, ``validation`` if ``need_eval`` and ``test`` if ``need_test``, with ``columns`` checked.

    The validation data is --validation_file, else the dataset's --eval_split, else --validation_split_percentage of
    the training examples, held out with a fixed seed (the same examples in every run, a resumed one included).
    """
    if data_args.train_file is not None:
        files = data_args.files()
        for split, path in files.items():
            found = file_columns(path)
            missing = [column for column in columns if found is not None and column not in found]
            if missing:
                raise UsageError(
                    f"--{split}_file {path!r} has no column {missing[0]!r} (its columns: {', '.join(found)}); every "
                    f"data file needs the columns the recipe reads: rename that column in the file, or name the "
                    f"column with {column_option(data_args, missing[0])}."
                )
        try:
            raw = load_dataset(BUILDERS[Path(data_args.train_file).suffix], data_files=files)
        except (ValueError, DatasetGenerationError) as err:
            raise UsageError(unreadable_data(files, err)) from err
        sources = {split: split for split in files}
    else:
        raw = hub_dataset(data_args.dataset_name, data_args.dataset_config_name)
        sources = data_args.hub_splits()
    wanted = {"train": True, "validation": need_eval, "test": need_test}
    data = DatasetDict({split: raw[source] for split, source in sources.items() if source in raw and wanted[split]})
    if "train" not in data:
        raise UsageError(f"the dataset has no split 'train' (it has {list(raw)}); pass --train_file instead.")
    if need_test and "test" not in data:
        fix = "--test_file" if data_args.train_file else f"a --test_split of {list(raw)}"
        raise UsageError(f"--do_predict needs test data: pass {fix}.")
    for split, dataset in data.items():
        if len(dataset) == 0:
            raise UsageError(f"the {split} data holds no examples ({data_args.data_name(split)}).")
    if need_eval and "validation" not in data:
        if len(data["train"]) < 2:
            raise UsageError(
                f"the training data holds {len(data['train'])} example; holding some out for evaluation "
                f"needs at least 2: add examples or pass --validation_file."
            )
        percent = data_args.validation_split_percentage
        held_out = data["train"].train_test_split(test_size=percent / 100, seed=0)
        data["train"], data["validation"] = held_out["train"], held_out["test"]
        data_args.held_out = True
        logger.info("Evaluating on %d%% of the training examples, held out (%d).", percent, len(data["validation"]))
    for split, dataset in data.items():
        missing = [column for column in columns if column not in dataset.column_names]
        if missing:
            raise UsageError(
                f"{split} data has no column {missing[0]!r} (columns: {dataset.column_names}); name the right one "
                f"with {column_option(data_args, missing[0])}."
            )
    for split, limit in (("train", data_args.max_train_samples), ("validation", data_args.max_eval_samples)):
        if split in data and limit is not None:
            data[split] = data[split].select(range(min(limit, len(data[split]))))
    return data


def max_tokens(config, tokenizer, requested: int | None) -> int:
    """Tokens per example: ``requested``, capped by the model's ``max_input_length`` and the tokenizer."""
    limit = min(config.max_input_length, tokenizer.model_max_length)
    if requested is not None and requested > limit:
        logger.warning("max_seq_length %d exceeds what the model reads (%d); using %d.", requested, limit, limit)
    return min(requested or limit, limit)


# Config entries that may differ between a checkpoint and the run that resumes it: what the Trainer and
# save_pretrained record about the run rather than the model, and how memory is spent (not what the model computes).
RESUMABLE_CHANGES = (
    "_name_or_path",
    "architectures",
    "auto_map",
    "dtype",
    "problem_type",
    "transformers_version",
    "use_cache",
    "recompute_window_tiles",
)


def checkpoint_to_resume(training_args, model) -> str | None:
    """--resume_from_checkpoint, else the last checkpoint in --output_dir when training (the examples' behaviour,
    said on stderr). Before any work, a ``UsageError`` if a file of that checkpoint cannot be read (``damaged``) or
    its config differs from ``model``'s in anything but ``RESUMABLE_CHANGES`` (another window, rank, width, ...:
    resuming would mix two models), and a ``FinishedRun`` if it has reached this run's limit (``reached``)."""
    checkpoint = training_args.resume_from_checkpoint
    output_dir = Path(training_args.output_dir)
    if checkpoint is None and training_args.do_train and output_dir.is_dir():
        checkpoint = get_last_checkpoint(output_dir)
    if checkpoint is None:
        return None
    if not Path(checkpoint).is_dir():
        raise UsageError(f"--resume_from_checkpoint {checkpoint!r}: no such folder.")
    if (problem := damaged(Path(checkpoint))) is not None:
        folder, name = Path(checkpoint).parent, Path(checkpoint).name
        found = [path.name for path in checkpoints(folder)]
        earlier = found[: found.index(name)] if name in found else []
        fix = (
            f"To resume from the checkpoint before it, {folder / earlier[-1]}, delete {checkpoint}; to start afresh, "
            f"use a new --output_dir."
            if earlier
            else f"No earlier checkpoint is there: delete {checkpoint}, or use a new --output_dir, to start afresh."
        )
        raise UsageError(f"the checkpoint {checkpoint} cannot be read: {problem}. {fix}")
    if (Path(checkpoint) / "config.json").is_file():
        saved, wanted = type(model.config).from_pretrained(checkpoint).to_dict(), model.config.to_dict()
        changed = {
            key: (saved.get(key), wanted.get(key))
            for key in sorted(saved.keys() | wanted.keys())
            if key not in RESUMABLE_CHANGES and saved.get(key) != wanted.get(key)
        }
        if changed:
            raise UsageError(
                f"the checkpoint {checkpoint} holds a model with other settings: {changed} (saved, this "
                f"run's); use a new --output_dir, or the same model arguments as that run."
            )
    if training_args.do_train and (limit := reached(Path(checkpoint), training_args)) is not None:
        finished_run(output_dir, checkpoint, *limit)
    if training_args.resume_from_checkpoint is None:
        print(f"Resuming training from {checkpoint} (use a new --output_dir to start over).", file=sys.stderr)
    return checkpoint


def checkpoints(folder: Path) -> list[Path]:
    """The Trainer's checkpoint folders in ``folder``, by step."""
    pattern = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
    found = [path for path in folder.iterdir() if path.is_dir() and pattern.match(path.name)]
    return sorted(found, key=lambda path: int(pattern.match(path.name).group(1)))


def damaged(checkpoint: Path) -> str | None:
    """The first file of a Trainer checkpoint that cannot be read, and why; None if all can. Reads the JSON files,
    the safetensors headers and the zip directories of torch's files (.pt, .pth, .bin), not the tensors."""
    if not (checkpoint / "trainer_state.json").is_file():
        return "it has no trainer_state.json (was it written to the end?)"
    for path in sorted(checkpoint.iterdir()):
        try:
            if path.suffix == ".json":
                json.loads(path.read_text())
            elif path.suffix == ".safetensors":
                with safe_open(path, "pt"):
                    pass
            elif path.suffix in (".pt", ".pth", ".bin"):
                zipfile.ZipFile(path).close()
        except (ValueError, OSError, SafetensorError, zipfile.BadZipFile) as err:
            return f"{path.name}: {err}"
    return None


def reached(checkpoint: Path, training_args) -> tuple[str, str] | None:
    """The limit of this run that ``checkpoint`` has reached, as a phrase naming its step, and the option setting it
    (--max_steps, else --num_train_epochs); None if training goes on from it."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    step, epochs = state["global_step"], training_args.num_train_epochs
    if training_args.max_steps > 0:
        done = step >= training_args.max_steps
        return (f"step {step} of --max_steps {training_args.max_steps}", "--max_steps") if done else None
    if step >= state["max_steps"] and state["epoch"] >= epochs - 1e-6:
        return f"step {step}, epoch {state['epoch']:g} of --num_train_epochs {epochs:g}", "--num_train_epochs"
    return None


def finished_run(output_dir: Path, checkpoint: str, limit: str, option: str) -> None:
    """Raise ``FinishedRun`` with the results of the run in ``output_dir``, whose ``checkpoint`` reached ``limit``
    (set by ``option``); a ``UsageError`` if the run's results are missing (it stopped after its last checkpoint)."""
    try:
        results = json.loads((output_dir / "all_results.json").read_text())
    except (OSError, ValueError) as err:
        raise UsageError(
            f"{checkpoint} has reached {limit}, but {output_dir / 'all_results.json'} cannot be read ({err}): the run "
            f"stopped after its last checkpoint. Evaluate that checkpoint with --model_name_or_path {checkpoint} "
            f"and --do_eval without --do_train, raise {option} to train on, or use a new --output_dir to start over."
        ) from err
    shown = ", ".join(
        f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}"
        for key, value in results.items()
        if not key.endswith(("_runtime", "_per_second", "total_flos"))
    )
    raise FinishedRun(
        f"{output_dir} holds a finished run ({limit}): {shown} ({output_dir / 'all_results.json'}). Nothing was "
        f"trained or written; raise {option} to train on, or use a new --output_dir to start over.",
        results,
    )


class TiedKeysFilter(logging.Filter):
    """Drop the Trainer's "missing keys" warning on resume when the only keys missing are tied weights, which
    checkpoints do not store (the LM head's decoder is the word embedding)."""

    def __init__(self, model):
        super().__init__()
        self.tied = set(getattr(model, "_tied_weights_keys", None) or ())

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        prefix = "There were missing keys in the checkpoint model loaded: "
        if not message.startswith(prefix):
            return True
        return not set(ast.literal_eval(message[len(prefix) :].rstrip("."))) <= self.tied


def check_memory(
    model, batch_size: int, seq_length: int, training_args, dropout_option: str = "--attention_probs_dropout_prob"
) -> None:
    """A ``UsageError`` before training when a Trainer step of ``model`` on ``batch_size`` blocks of ``seq_length``
    tokens needs more memory than the device has available (``recipes.memory``), naming the fixes with their
    estimates: --gradient_checkpointing, --recompute_window_tiles (with ``dropout_option`` 0 when the model has
    attention dropout, which that path skips; not for ``long_short_xl``) and a smaller --per_device_train_batch_size."""
    config = model.config
    vocab = config.vocab_size if model.get_output_embeddings() is not None else 0  # an LM head's logits
    has_lean_path = hasattr(config, "recompute_window_tiles")

    def step(batch_size: int, checkpointing: bool, lean: bool) -> memory.TrainingStep:
        return memory.TrainingStep(
            model.num_parameters(),
            memory.long_short_layers(config, seq_length, lean=lean),
            batch_size,
            vocab,
            seq_length,
            checkpointing,
            half_precision=training_args.bf16 or training_args.fp16,
        )

    lean = has_lean_path and config.recompute_window_tiles and not config.attention_probs_dropout_prob
    fixes = {"checkpointing": "--gradient_checkpointing", "batch_size": "--per_device_train_batch_size"}
    if has_lean_path:
        fixes["lean"] = "--recompute_window_tiles" + (
            f" {dropout_option} 0" if config.attention_probs_dropout_prob else ""
        )
    settings = {"batch_size": batch_size, "checkpointing": training_args.gradient_checkpointing, "lean": lean}
    memory.check_memory(
        step,
        settings,
        training_args.device,
        fixes,
        error=UsageError,
        note=" A smaller batch with more --gradient_accumulation_steps keeps the batch trained on.",
    )


class WarmupCheck(TrainerCallback):
    """A warning when training starts if the warmup lasts the whole run: the learning rate never reaches its peak
    (a fraction of the steps, --warmup_steps below 1, always ends within the run)."""

    def on_train_begin(self, args, state, control, **kwargs):
        warmup, steps = args.get_warmup_steps(state.max_steps), state.max_steps
        if (
            warmup < steps
            or args.lr_scheduler_type in ("constant", "reduce_lr_on_plateau")
            or not state.is_world_process_zero
        ):
            return
        limit = (
            f"--max_steps {args.max_steps}" if args.max_steps > 0 else f"--num_train_epochs {args.num_train_epochs:g}"
        )
        logger.warning(
            "--warmup_steps %d is at least as long as this run, %d training steps (%s): the learning rate rises all "
            "run and never reaches --learning_rate %g. Lower --warmup_steps (e.g. --warmup_steps 0.1, a tenth of the "
            "run) or train longer.",
            warmup,
            steps,
            limit,
            args.learning_rate,
        )


def finish(trainer, training_args, data_args, checkpoint, extra_metrics=None, test_dataset=None) -> dict:
    """Train (resuming from ``checkpoint``; ``WarmupCheck`` warns of a warmup as long as the run), evaluate on the
    validation data (--do_eval) and on ``test_dataset`` (--do_predict), saving the model, the metrics and the state.

    ``extra_metrics`` adds derived numbers to the evaluation and test metrics, which also name their data
    (``eval_dataset``, ``test_dataset``: a Hub dataset or a local file name, for model cards). Returns all metrics.
    """
    results = {}
    if training_args.do_train and trainer.is_world_process_zero():  # a new model: earlier metrics no longer apply
        for prefix in ("all", "eval", "test"):
            (Path(training_args.output_dir) / f"{prefix}_results.json").unlink(missing_ok=True)

    def report(prefix: str, split: str, metrics: dict) -> None:
        metrics.update(extra_metrics(metrics) if extra_metrics else {})
        metrics[f"{prefix}_dataset"] = data_args.data_name(split)
        trainer.log_metrics(prefix, metrics)
        trainer.save_metrics(prefix, metrics)
        results.update(metrics)

    if training_args.do_train:
        trainer.add_callback(WarmupCheck)
        tied_keys = TiedKeysFilter(trainer.model)
        transformers.trainer.logger.addFilter(tied_keys)
        try:
            train = trainer.train(resume_from_checkpoint=checkpoint)
        finally:
            transformers.trainer.logger.removeFilter(tied_keys)
        best = trainer.state.best_model_checkpoint
        if training_args.load_best_model_at_end and best is not None:
            step = int(Path(best).name.split("-")[-1])
            scores = next(
                (log for log in trainer.state.log_history if log.get("step") == step and "eval_loss" in log), {}
            )
            shown = ", ".join(f"{key} = {scores[key]:.4g}" for key in ("eval_accuracy", "eval_loss") if key in scores)
            print(
                f"Kept the best model: {best} (epoch {scores.get('epoch')}, {training_args.metric_for_best_model} = "
                f"{trainer.state.best_metric:.4g}; {shown}); saved to {training_args.output_dir}.",
                file=sys.stderr,
            )
        trainer.save_model()
        trainer.log_metrics("train", train.metrics)
        trainer.save_metrics("train", train.metrics)
        trainer.save_state()
        results.update(train.metrics)
    if training_args.do_eval:
        report("eval", "validation", trainer.evaluate())
    if training_args.do_predict:
        report("test", "test", trainer.predict(test_dataset, metric_key_prefix="test").metrics)
    return results

"""Fine-tune a LongShort model for sequence classification on any labelled text, up to the model's length.

    python -m recipes.finetune_classification --model_name_or_path roberta-ls-base --output_dir docs-ls \\
        --train_file train.csv --validation_file dev.csv --test_file test.csv \\
        --text_column_name text --label_column_name label --max_seq_length 4096 \\
        --do_train --do_eval --do_predict --bf16

Data: local CSV/JSON/JSON Lines files (``--train_file``, ``--validation_file``, ``--test_file``) or a ``datasets``
dataset (``--dataset_name``, its ``--eval_split`` and ``--test_split``), with a text column (``--text_column_name``),
optionally a second one for text pairs (``--text_pair_column_name``), and a label column (``--label_column_name``;
any values: the classes are the training data's, in sorted order). Documents are cut to ``--max_seq_length`` tokens
(default and cap: what the model reads); how many were cut is logged and reported per split
(``truncated_train``, ``truncated_validation``, ``truncated_test``). The first token is global by default (the
classification head's, as Longformer's). The best epoch is chosen on validation data (``--validation_file``, the
dataset's split, or ``--validation_split_percentage`` (5) of the training examples held out with a fixed seed;
among epochs of equal accuracy the one with the lower loss, ``classification_metrics``); ``--do_predict`` then
scores the kept model once on the test data (``test_accuracy``). The kept model is saved to ``--output_dir``; an
interrupted run resumes from its last checkpoint. Runs under ``accelerate launch`` as is.
"""

import logging
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from datasets import ClassLabel
from transformers import (
    AutoModelForSequenceClassification,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
    set_seed,
)

import ls_hf  # noqa: F401  (registers LongShort with the Auto classes)
from recipes.common import (
    DataArguments,
    ModelArguments,
    UsageError,
    check_memory,
    checkpoint_to_resume,
    cli,
    finish,
    load_data,
    logger,
    max_tokens,
    parse_args,
    setup_logging,
)


@dataclass
class ClassificationDataArguments(DataArguments):
    test_file: str | None = field(default=None, metadata={"help": "Local test data for --do_predict (same formats)."})
    test_split: str = field(default="test", metadata={"help": "Split of --dataset_name that --do_predict scores."})
    label_column_name: str = field(default="label", metadata={"help": "Column holding the class label."})
    text_pair_column_name: str | None = field(
        default=None, metadata={"help": "Column holding the second text of a pair (e.g. a hypothesis), if any."}
    )
    class_names: list[str] | None = field(
        default=None,
        metadata={
            "help": "Names of the integer labels 0, 1, ... for the model's id2label (e.g. neg pos), where the data "
            "names none; default: the numbers (a string label is its own name)."
        },
    )

    def check(self) -> None:
        super().check()
        if self.class_names is not None and len(set(self.class_names)) != len(self.class_names):
            raise ValueError(f"--class_names must be distinct names, got {self.class_names}.")

    def files(self) -> dict[str, str]:
        return {**super().files(), **({"test": self.test_file} if self.test_file else {})}

    def hub_splits(self) -> dict[str, str]:
        return {**super().hub_splits(), "test": self.test_split}


@dataclass
class ClassificationTrainingArguments(TrainingArguments):
    """TrainingArguments with defaults for keeping the best model: evaluate (on the validation data) and save every
    epoch; --eval_strategy no keeps the last model instead."""

    eval_strategy: str = field(default="epoch", metadata={"help": "When to evaluate (no, steps, epoch)."})
    save_strategy: str = field(default="epoch", metadata={"help": "When to save a checkpoint (same choices)."})
    load_best_model_at_end: bool = field(
        default=True,
        metadata={"help": "Keep the checkpoint with the best validation metric (off with --eval_strategy no)."},
    )
    metric_for_best_model: str | None = field(
        default="accuracy_loss_tiebreak",
        metadata={
            "help": "Metric choosing the best model (accuracy_loss_tiebreak: the accuracy, equal ones by the loss)."
        },
    )
    save_total_limit: int | None = field(default=2, metadata={"help": "Checkpoints kept (the best one is kept too)."})
    learning_rate: float = field(default=3e-5, metadata={"help": "Peak AdamW learning rate."})

    def __post_init__(self):
        if self.eval_strategy == "no":  # nothing to choose the best model by: keep the last one
            self.load_best_model_at_end = False
        super().__post_init__()


def classification_metrics(prediction) -> dict[str, float]:
    """The Trainer's ``compute_metrics``: ``accuracy`` (argmax of the logits against the labels) and
    ``accuracy_loss_tiebreak``, the accuracy less ``loss / (1 + loss) / N`` for the mean cross-entropy ``loss`` of N
    examples: less than one example's worth, so it orders epochs by accuracy and equal accuracies by the loss (the
    best model's metric by default)."""
    logits, labels = np.asarray(prediction.predictions), np.asarray(prediction.label_ids)
    accuracy = float((logits.argmax(-1) == labels).mean())
    loss = float(F.cross_entropy(torch.from_numpy(logits).double(), torch.from_numpy(labels)))
    return {"accuracy": accuracy, "accuracy_loss_tiebreak": accuracy - loss / (1 + loss) / len(labels)}


def class_names(feature, values: list, given: list[str] | None) -> list[str]:
    """The names of the sorted label ``values``: a ``ClassLabel``'s own, else ``given`` (--class_names) for integer
    labels, else the values as strings."""
    if isinstance(feature, ClassLabel):
        return [feature.int2str(value) for value in values]
    if given is None or not all(isinstance(value, int) for value in values):
        return [str(value) for value in values]
    outside = [value for value in values if not 0 <= value < len(given)]
    if outside:
        raise UsageError(
            f"--class_names names the labels 0 to {len(given) - 1} ({' '.join(given)}), but the training data has "
            f"label {outside[0]}: pass --class_names with a name for each of the labels {values}."
        )
    return [given[value] for value in values]


def finetune(data_arguments: type[ClassificationDataArguments], argv=None) -> dict:
    """Parse ``argv`` with ``data_arguments`` (a preset may change its defaults), train, select, score; returns the
    metrics."""
    model_args, data_args, training_args = parse_args(
        (ModelArguments, data_arguments, ClassificationTrainingArguments), argv, ("do_train", "do_eval", "do_predict")
    )
    setup_logging(training_args)
    set_seed(training_args.seed)
    model_args.config()

    text, pair, label = data_args.text_column_name, data_args.text_pair_column_name, data_args.label_column_name
    data = load_data(data_args, [text, label], training_args.do_eval, training_args.do_predict)
    for split, dataset in data.items():
        if pair is not None and pair not in dataset.column_names:
            raise UsageError(
                f"{split} data has no column {pair!r} (columns: {dataset.column_names}); name the "
                f"second text with --text_pair_column_name, or leave it out."
            )
    feature = data["train"].features[label]
    values = sorted(set(data["train"][label]))
    if len(values) < 2:
        raise UsageError(
            f"the training data holds the single label {values} (--max_train_samples takes the first "
            f"rows, which may be sorted by label); a classifier needs at least two."
        )
    names = class_names(feature, values, data_args.class_names)
    label_ids = {value: i for i, value in enumerate(values)}

    tokenizer, model = model_args.load(
        AutoModelForSequenceClassification,
        num_labels=len(values),
        id2label=dict(enumerate(names)),
        label2id={name: i for i, name in enumerate(names)},
    )
    checkpoint = checkpoint_to_resume(training_args, model)
    length = max_tokens(model.config, tokenizer, data_args.max_seq_length)
    if training_args.do_train:  # batches are padded to their longest document: up to `length` tokens
        check_memory(model, training_args.per_device_train_batch_size, length, training_args)

    def tokenize(batch):
        unknown = set(batch[label]) - set(label_ids)
        if unknown:
            raise UsageError(f"labels {sorted(unknown)} do not occur in the training data (labels: {values}).")
        texts = (batch[text],) + ((batch[pair],) if pair is not None else ())
        encoded = tokenizer(*texts, truncation=True, max_length=length)
        full = tokenizer(*texts, truncation=False, verbose=False)["input_ids"]
        encoded["truncated"] = [len(ids) > length for ids in full]  # dropped by the Trainer (not a model input)
        encoded["labels"] = [label_ids[value] for value in batch[label]]
        return encoded

    with training_args.main_process_first(desc="tokenization"):
        data = data.map(
            tokenize,
            batched=True,
            remove_columns=data["train"].column_names,
            num_proc=data_args.preprocessing_num_workers,
            desc="Tokenizing",
        )
    truncated = {f"truncated_{split}": int(sum(dataset["truncated"])) for split, dataset in data.items()}
    for split, dataset in data.items():  # a warning when documents were cut: shown at the default log level
        count = truncated[f"truncated_{split}"]
        logger.log(
            logging.WARNING if count else logging.INFO,
            "%s: %d of %d documents are longer than %d tokens and were truncated (--max_seq_length).",
            split,
            count,
            len(dataset),
            length,
        )

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=data["train"] if training_args.do_train else None,
        eval_dataset=data.get("validation"),
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=classification_metrics,
    )
    extra = {"max_seq_length": length, **truncated}
    return finish(trainer, training_args, data_args, checkpoint, lambda metrics: extra, data.get("test"))


@cli
def main(argv=None) -> dict:
    return finetune(ClassificationDataArguments, argv)


if __name__ == "__main__":
    main()

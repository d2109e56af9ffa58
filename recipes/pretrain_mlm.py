"""Continue masked-LM pretraining of a converted LongShort model on long documents, the Longformer way.

    python -m recipes.pretrain_mlm --model_name_or_path roberta-ls-base --dataset_name wikitext \\
        --dataset_config_name wikitext-103-raw-v1 --output_dir roberta-ls-base-mlm --do_train --do_eval --bf16

Documents are tokenized, concatenated and cut into blocks of the model length (4096 tokens after
``ls-convert-roberta``); 15% of the tokens are masked; the learning rate warms up, then decays (Longformer: peak 3e-5,
500 warmup steps, polynomial decay of power 3). Evaluation reports the loss, perplexity and bits per token on a
validation split (``--validation_file``, the dataset's split, or ``--validation_split_percentage`` of the training
documents). An interrupted run resumes from its last checkpoint.
"""

import math
from dataclasses import dataclass, field
from itertools import chain

from transformers import (
    AutoModelForMaskedLM,
    DataCollatorForLanguageModeling,
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
    max_tokens,
    parse_args,
    setup_logging,
)


@dataclass
class MlmDataArguments(DataArguments):
    mlm_probability: float = field(default=0.15, metadata={"help": "Fraction of tokens masked."})

    def check(self) -> None:
        super().check()
        if not 0 < self.mlm_probability < 1:
            raise ValueError(f"--mlm_probability must be between 0 and 1, got {self.mlm_probability}.")


@dataclass
class MlmTrainingArguments(TrainingArguments):
    """TrainingArguments with Longformer's continued-pretraining schedule as defaults."""

    learning_rate: float = field(default=3e-5, metadata={"help": "Peak AdamW learning rate."})
    warmup_steps: float = field(
        default=500, metadata={"help": "Linear warmup: steps, or a fraction of all steps when below 1."}
    )
    lr_scheduler_type: str = field(default="polynomial", metadata={"help": "Decay after warmup."})
    lr_scheduler_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Scheduler options (JSON); polynomial decay defaults to power 3."}
    )
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay."})
    adam_epsilon: float = field(default=1e-6, metadata={"help": "AdamW epsilon."})
    save_total_limit: int | None = field(default=3, metadata={"help": "Checkpoints kept (the oldest are deleted)."})

    def __post_init__(self):
        if self.lr_scheduler_kwargs is None and self.lr_scheduler_type == "polynomial":
            self.lr_scheduler_kwargs = {"power": 3.0}  # Longformer's cubic decay; other schedules take no power
        super().__post_init__()


def group_texts(examples: dict, block: int) -> dict:
    """Concatenate tokenized documents and cut them into blocks of ``block`` tokens (the remainder is dropped)."""
    joined = {key: list(chain.from_iterable(values)) for key, values in examples.items()}
    usable = len(joined["input_ids"]) // block * block
    return {key: [values[i : i + block] for i in range(0, usable, block)] for key, values in joined.items()}


def language_model_data(data, tokenizer, data_args, training_args, block: int):
    """Raw documents -> blocks of ``block`` tokens."""
    with training_args.main_process_first(desc="tokenization and grouping"):
        data = data.map(
            lambda batch: tokenizer(batch[data_args.text_column_name], return_special_tokens_mask=True),
            batched=True,
            remove_columns=data["train"].column_names,
            num_proc=data_args.preprocessing_num_workers,
            desc="Tokenizing",
        )
        data = data.map(
            group_texts,
            fn_kwargs={"block": block},
            batched=True,
            num_proc=data_args.preprocessing_num_workers,
            desc=f"Packing into blocks of {block} tokens",
        )
    for split, dataset in data.items():
        if len(dataset) == 0:
            raise UsageError(f"the {split} data holds fewer than {block} tokens; lower --max_seq_length or add text.")
    return data


def language_model_metrics(metrics: dict) -> dict:
    """Perplexity and bits per token from the evaluation loss (nats per masked token)."""
    loss = metrics["eval_loss"]
    return {"perplexity": math.exp(min(loss, 700)), "bits_per_token": loss / math.log(2)}


@cli
def main(argv=None) -> dict:
    model_args, data_args, training_args = parse_args((ModelArguments, MlmDataArguments, MlmTrainingArguments), argv)
    setup_logging(training_args)
    set_seed(training_args.seed)
    model_args.config()

    data = load_data(data_args, [data_args.text_column_name], need_eval=training_args.do_eval)
    tokenizer, model = model_args.load(AutoModelForMaskedLM)
    block = max_tokens(model.config, tokenizer, data_args.max_seq_length)
    checkpoint = checkpoint_to_resume(training_args, model)
    if training_args.do_train:
        check_memory(model, training_args.per_device_train_batch_size, block, training_args)
    data = language_model_data(data, tokenizer, data_args, training_args, block)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=data["train"] if training_args.do_train else None,
        eval_dataset=data.get("validation"),
        processing_class=tokenizer,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm_probability=data_args.mlm_probability),
    )
    return finish(trainer, training_args, data_args, checkpoint, language_model_metrics)


if __name__ == "__main__":
    main()

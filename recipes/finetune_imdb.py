"""Fine-tune a LongShort model for sequence classification on IMDb (paper Table 3) with the Transformers Trainer.

    python -m recipes.finetune_imdb --model_name_or_path roberta-ls-base --output_dir imdb-ls \\
        --do_train --do_eval --do_predict --bf16

A preset of ``recipes.finetune_classification`` (same arguments): ``load_dataset("stanfordnlp/imdb")`` by default,
or local CSV/JSON files with text,label columns (``--train_file``, ``--validation_file``, ``--test_file``; labels 0
and 1, named ``neg`` and ``pos`` in the model's ``id2label`` as the Hub dataset's). The best epoch is chosen on
validation data: IMDb has no validation split, so ``--validation_split_percentage`` (5) of the training reviews are
held out (fixed seed); ``--do_predict`` then scores the kept model once on the test split (``test_accuracy``, what the
paper reports).
"""

from dataclasses import dataclass, field

from recipes.common import cli
from recipes.finetune_classification import ClassificationDataArguments, finetune

__all__ = ["ImdbDataArguments", "main"]


@dataclass
class ImdbDataArguments(ClassificationDataArguments):
    dataset_name: str | None = field(
        default="stanfordnlp/imdb", metadata={"help": "Hub dataset (ignored when --train_file is given)."}
    )
    class_names: list[str] | None = field(
        default_factory=lambda: ["neg", "pos"],
        metadata={"help": "Names of the labels 0 and 1 (IMDb's: 0 negative, 1 positive) for the model's id2label."},
    )


@cli
def main(argv=None) -> dict:
    return finetune(ImdbDataArguments, argv)


if __name__ == "__main__":
    main()

"""Long Range Arena data (Tay et al., 2021) as the paper's LRA experiments used it (Sec. 4.1, Appendix B).

* ListOps: generated here by the benchmark's rules, deterministic by seed, cached as ``.npz`` under the data folder.
* Text (IMDb bytes), Retrieval (AAN document pairs, bytes) and Image (CIFAR-10 as grey pixels): loaded from data that
  users bring (a ``datasets`` folder saved with ``save_to_disk``, or ``train``/``dev``/``test`` json/jsonl/csv/parquet
  files); nothing is downloaded.

Every split becomes an ``Examples``: token ids concatenated in one array with per-example offsets (one or two
sequences per example), and the labels. Id 0 is padding.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

SPLITS = ("train", "dev", "test")

# ------------------------------------------------------------------------------------------------- ListOps
OPERATORS = ("MIN", "MAX", "MED", "SM")  # SM = sum modulo 10
OPERATOR_P = 0.25  # below the maximum depth a node is an operator with this probability, else a digit
# Token ids. LRA's released input pipeline (the one behind the paper's numbers) splits the source text into
# alphanumeric tokens, so "[MAX", "]" and the parentheses lose their brackets: only the operator names and the digits
# remain (vocabulary of 14, plus padding). ``brackets=True`` keeps "[OP" and "]" as tokens, the corrected rule.
LISTOPS_VOCAB = ("<pad>", *OPERATORS, *(str(d) for d in range(10)), "]")


@dataclass(frozen=True)
class ListOpsRules:
    """The generator's parameters; LRA's values are the defaults. Lengths count operators, digits and closing
    brackets (LRA's count), kept when ``min_length < length < max_length``."""

    max_depth: int = 10
    max_args: int = 10
    min_length: int = 500
    max_length: int = 2000
    train: int = 96_000
    dev: int = 2_000
    test: int = 2_000
    brackets: bool = False

    def check(self) -> None:
        for name, low in (("max_depth", 1), ("max_args", 2), ("min_length", 0), ("train", 1), ("dev", 1), ("test", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ValueError(f"--listops_{name} must be an integer >= {low}, got {value!r}.")
        if self.max_length <= self.min_length + 1:
            raise ValueError(
                f"--listops_max_length ({self.max_length}) must exceed --listops_min_length "
                f"({self.min_length}) by at least 2 (lengths are kept strictly between them)."
            )


class _TooLong(Exception):
    pass


def _tree(rng: random.Random, depth: int, rules: ListOpsRules, out: list[int], limit: int) -> int:
    """Append one node's tokens (prefix order, ']' id included) to ``out``; return its value. LRA's rule: below the
    maximum depth a node is an operator with probability 0.25, with 2..max_args arguments, else a digit 0-9."""
    if depth < rules.max_depth and rng.random() < OPERATOR_P:
        op = rng.randrange(len(OPERATORS))
        out.append(1 + op)
        values = [_tree(rng, depth + 1, rules, out, limit) for _ in range(rng.randint(2, rules.max_args))]
        out.append(len(LISTOPS_VOCAB) - 1)
        if len(out) >= limit:
            raise _TooLong
        if op == 0:
            return min(values)
        if op == 1:
            return max(values)
        if op == 2:  # the lower middle pair's mean, rounded down (LRA: int(np.median(values)))
            ordered = sorted(values)
            half = len(ordered) // 2
            return ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) // 2
        return sum(values) % 10
    digit = rng.randrange(10)
    out.append(5 + digit)
    return digit


def generate_listops(seed: int, rules: ListOpsRules, progress: bool = False) -> dict[str, Examples]:
    """``train``/``dev``/``test`` of distinct ListOps expressions (LRA: distinct trees, split after generation);
    ``progress``: a progress bar of the expressions kept."""
    rules.check()
    rng = random.Random(seed)
    seen, kept = set(), []
    total = rules.train + rules.dev + rules.test
    with tqdm(
        total=total, desc="generating ListOps", unit=" expressions", disable=not progress, file=sys.stdout
    ) as bar:
        while len(kept) < total:
            out = []
            try:
                value = _tree(rng, 1, rules, out, rules.max_length)
            except _TooLong:
                continue
            if rules.min_length < len(out) < rules.max_length:
                key = bytes(out)
                if key not in seen:
                    seen.add(key)
                    kept.append((out, value))
                    bar.update(1)
    close = len(LISTOPS_VOCAB) - 1
    splits, start = {}, 0
    for split, size in zip(SPLITS, (rules.train, rules.dev, rules.test)):
        part = kept[start : start + size]
        start += size
        seqs = [[t for t in ids if t != close] if not rules.brackets else ids for ids, _ in part]
        splits[split] = Examples.build([seqs], [value for _, value in part])
    return splits


def listops(data_dir: str | os.PathLike, seed: int, rules: ListOpsRules, progress: bool = False) -> dict[str, Examples]:
    """The generated splits, read from ``data_dir`` if this seed and these rules were generated before. Generating
    says so on stdout (``progress``: with a progress bar)."""
    rules.check()
    key = hashlib.sha1(json.dumps(asdict(rules), sort_keys=True).encode()).hexdigest()[:10]
    path = Path(data_dir) / f"listops_seed{seed}_{key}.npz"
    if path.exists():
        with np.load(path) as npz:
            return {split: Examples.from_arrays(npz, split) for split in SPLITS}
    print(
        f"Generating {rules.train:,} / {rules.dev:,} / {rules.test:,} ListOps expressions (data seed {seed}) into "
        f"{path}; later runs with this seed and these rules read them from there.",
        flush=True,
    )
    splits = generate_listops(seed, rules, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp.npz")
    arrays = {f"{split}.{name}": value for split, ex in splits.items() for name, value in ex.arrays().items()}
    np.savez(tmp, rules=json.dumps(asdict(rules)), **arrays)
    os.replace(tmp, path)
    return splits


def fresh_listops(seed: int, size: int, rules: ListOpsRules, exclude: Examples) -> Examples:
    """Up to ``size`` new expressions by ``rules``, drawn with generator seed ``seed``, leaving out any that
    ``exclude`` (a run's training split) holds: an independent sample of the distribution its test split is one of."""
    drawn = generate_listops(seed, replace(rules, train=1, dev=1, test=size))["test"]
    seen = {exclude.tokens[a:b].tobytes() for a, b in zip(exclude.offsets[0, :-1], exclude.offsets[0, 1:])}
    keep = [
        i
        for i, (a, b) in enumerate(zip(drawn.offsets[0, :-1], drawn.offsets[0, 1:]))
        if drawn.tokens[a:b].tobytes() not in seen
    ]
    sequences = [drawn.tokens[drawn.offsets[0, i] : drawn.offsets[0, i + 1]].tolist() for i in keep]
    return Examples.build([sequences], drawn.labels[keep])


# --------------------------------------------------------------------------------------------- examples
@dataclass
class Examples:
    """One split: ``tokens`` (all ids, concatenated), ``offsets`` (num_seqs, N + 1) and ``labels`` (N,)."""

    tokens: np.ndarray
    offsets: np.ndarray
    labels: np.ndarray

    @classmethod
    def build(cls, sequences: list[list[list[int]]], labels) -> Examples:
        """``sequences[j][i]``: the ids of sequence j (one, or two for Retrieval) of example i."""
        flat = [ids for seqs in sequences for ids in seqs]
        lengths = np.array([len(ids) for ids in flat], dtype=np.int64).reshape(len(sequences), -1)
        offsets = np.concatenate([np.zeros((len(sequences), 1), np.int64), lengths], 1).cumsum(1)
        offsets[1:] += offsets[:-1, -1:].cumsum(0)
        tokens = np.fromiter((t for ids in flat for t in ids), dtype=np.int16, count=int(lengths.sum()))
        return cls(tokens, offsets, np.asarray(labels, dtype=np.int64))

    @classmethod
    def from_arrays(cls, arrays, split: str) -> Examples:
        return cls(*(np.asarray(arrays[f"{split}.{name}"]) for name in ("tokens", "offsets", "labels")))

    def arrays(self) -> dict[str, np.ndarray]:
        return {"tokens": self.tokens, "offsets": self.offsets, "labels": self.labels}

    def __len__(self) -> int:
        return len(self.labels)

    def lengths(self) -> np.ndarray:
        """(num_seqs, N) sequence lengths."""
        return np.diff(self.offsets, axis=1)

    def batch(self, index, multiple: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """Ids and masks (one pair per sequence), padded with 0 to the batch's longest rounded up to ``multiple``,
        and the labels of examples ``index``."""
        index = np.asarray(index)
        ids, masks = [], []
        for offsets in self.offsets:
            starts, ends = offsets[index], offsets[index + 1]
            width = -(-int((ends - starts).max()) // multiple) * multiple
            batch = np.zeros((len(index), width), dtype=np.int64)
            for row, (a, b) in enumerate(zip(starts, ends)):
                batch[row, : b - a] = self.tokens[a:b]
            batch = torch.from_numpy(batch)
            ids.append(batch)
            masks.append(torch.arange(width)[None] < torch.from_numpy(ends - starts)[:, None])
        return ids, masks, torch.from_numpy(self.labels[index])


# ------------------------------------------------------------------------------------- user-provided data
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
# Per task: the columns read and how a value becomes ids (bytes + 1 for text, grey level + 1 for pixels).
COLUMNS = {"text": ("text",), "retrieval": ("text1", "text2"), "image": ("image",)}


def _bytes(text: str, max_length: int) -> list[int]:
    return [b + 1 for b in text.encode("utf-8")[:max_length]]


def _pixels(image, max_length: int) -> list[int]:
    """CIFAR-10 as LRA feeds it: the image in grey levels (ITU-R 601-2 luma), row by row, ids = level + 1."""
    from PIL import Image

    if isinstance(image, dict):  # a datasets Image column read without decoding
        import io

        image = Image.open(io.BytesIO(image["bytes"]))
    if not isinstance(image, Image.Image):
        image = Image.fromarray(np.asarray(image, dtype=np.uint8))
    grey = np.asarray(image.convert("L"), dtype=np.int64).reshape(-1)
    if grey.size > max_length:
        raise ValueError(f"an image has {grey.size} pixels, more than --max_length {max_length}; raise --max_length.")
    return (grey + 1).tolist()


def class_ids(labels: dict[str, list], num_classes: int, where: str) -> dict[str, np.ndarray]:
    """Each split's labels as class ids: integer labels as they are (0 .. ``num_classes`` - 1); any other values
    (e.g. "neg"/"pos") numbered in the sorted order of the training split's values, as
    ``recipes.finetune_classification`` numbers them. A ``ValueError`` names a label that does not fit."""
    if all(
        isinstance(value, (int, np.integer)) and not isinstance(value, bool)
        for split in labels.values()
        for value in split
    ):
        for split, values in labels.items():
            wrong = [value for value in values if not 0 <= value < num_classes]
            if wrong:
                raise ValueError(
                    f"{where}: the {split} split has the label {wrong[0]}; integer labels are class ids "
                    f"0 .. {num_classes - 1} for this task."
                )
        return {split: np.asarray(values, dtype=np.int64) for split, values in labels.items()}
    classes = sorted(set(labels["train"]), key=str)
    if len(classes) > num_classes:
        raise ValueError(
            f"{where}: the train split holds {len(classes)} label values {classes[:12]}, more than the "
            f"task's {num_classes} classes."
        )
    ids = {value: i for i, value in enumerate(classes)}
    for split, values in labels.items():
        unknown = sorted(set(values) - set(ids), key=str)
        if unknown:
            raise ValueError(
                f"{where}: the {split} split has the label(s) {unknown[:5]}, which the train split does "
                f"not (labels: {classes})."
            )
    return {split: np.asarray([ids[value] for value in values], dtype=np.int64) for split, values in labels.items()}


def load_user_data(task: str, data_path: str | os.PathLike, max_length: int, num_classes: int) -> dict[str, Examples]:
    """Text/Retrieval/Image splits from a ``save_to_disk`` folder or ``{train,dev,test}.<ext>`` files in
    ``data_path``, with columns ``text`` | ``text1``, ``text2`` | ``image`` and ``label`` (``class_ids``)."""
    import datasets

    path = Path(data_path)
    if not path.is_dir():
        raise ValueError(f"--data_dir {str(path)!r} is not a folder; give the folder holding the {task} data.")
    if (path / "dataset_dict.json").exists():
        data = datasets.load_from_disk(str(path))
    else:
        files = {}
        for split in SPLITS:
            found = [p for p in sorted(path.glob(f"{split}.*")) if p.suffix in FILE_BUILDERS]
            if len(found) != 1:
                raise ValueError(
                    f"--data_dir {str(path)!r}: expected exactly one {split}.<json|jsonl|csv|parquet> file, found "
                    f"{[p.name for p in found]}; or save a DatasetDict there with save_to_disk."
                )
            files[split] = str(found[0])
        builders = {FILE_BUILDERS[Path(f).suffix] for f in files.values()}
        if len(builders) > 1:
            raise ValueError(f"--data_dir {str(path)!r}: the three splits must share one format, got {builders}.")
        data = datasets.load_dataset(builders.pop(), data_files=files)
    missing = [split for split in SPLITS if split not in data]
    columns = COLUMNS[task] + ("label",)
    if missing:
        raise ValueError(f"--data_dir {str(path)!r} lacks the split(s) {missing}; it needs {list(SPLITS)}.")
    for split in SPLITS:
        absent = [c for c in columns if c not in data[split].column_names]
        if absent:
            raise ValueError(
                f"--data_dir {str(path)!r}: the {split} split lacks the column(s) {absent}; the "
                f"{task} task reads {list(columns)}."
            )
    labels = class_ids({split: data[split]["label"] for split in SPLITS}, num_classes, f"--data_dir {str(path)!r}")
    encode = _pixels if task == "image" else _bytes
    return {
        split: Examples.build(
            [[encode(value, max_length) for value in data[split][column]] for column in COLUMNS[task]], labels[split]
        )
        for split in SPLITS
    }

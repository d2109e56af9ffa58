"""Publish a trained LongShort model on the Hugging Face Hub, loadable with or without this package.

    python -m recipes.push_to_hub MODEL_DIR REPO_ID            # build the repo folder and upload it
    python -m recipes.push_to_hub MODEL_DIR REPO_ID --dry-run DIR   # only write the folder to DIR

The folder holds the safetensors weights, ``config.json`` whose ``auto_map`` names every head, the remote-code files
(``trust_remote_code=True`` works where ``ls_hf`` is not installed), the tokenizer (a causal model's adds no end token
to a prompt: ``causal_tokenizer``) and ``README.md``: the model card
``model_cards/<repo name>.md`` (or ``--model-card``; otherwise ``model_cards/template.md``, or
``model_cards/template-long-short-xl.md`` for the official character-level model of ``recipes.char_lm --model_type
long_short_xl``) with the metrics measured by the recipes (``MODEL_DIR/all_results.json``) filled into its metadata
and results section.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from huggingface_hub import EvalResult, HfApi, ModelCard
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import ls_hf
from ls_hf import LongShortConfig, LongShortForCausalLM, LongShortXLConfig
from ls_hf.convert_roberta import causal_tokenizer
from ls_hf.hub import save_for_hub
from ls_hf.modeling_long_short import HEADS
from ls_hf.modeling_long_short_xl import HEADS_XL
from recipes.common import long_short_config

CARDS = Path(__file__).resolve().parents[1] / "model_cards"
# model_type -> the card template used when model_cards/ has none named after the repository.
TEMPLATES = {LongShortConfig.model_type: "template.md", LongShortXLConfig.model_type: "template-long-short-xl.md"}
RESULTS_MARKER = "<!-- measured results -->"
# Trainer metric -> (model-index metric type, display name).
METRICS = {
    "eval_accuracy": ("accuracy", "Accuracy"),
    "perplexity": ("perplexity", "Perplexity"),
    "bits_per_token": ("bits_per_token", "Bits per token"),
    "eval_bpc": ("bpc", "Bits per character"),
    "eval_block_bpc": ("bpc", "Bits per character, each block alone"),
    "eval_loss": ("loss", "Loss"),
}


def model_config(model_dir: Path):
    """The config of the LongShort model (``long_short`` or ``long_short_xl``) saved in ``model_dir``."""
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"MODEL_DIR {str(model_dir)!r} has no config.json; pass the --output_dir of a recipe.")
    return long_short_config(model_dir, "MODEL_DIR", model_types=tuple(TEMPLATES))


def load_model(model_dir: Path, config):
    """The LongShort model saved in ``model_dir`` (its ``architectures`` class) and its tokenizer; a causal
    ``long_short`` model gets ``causal_tokenizer`` of it, so that a prompt ends with no end token."""
    architecture = (config.architectures or [f"{type(config).__name__.removesuffix('Config')}Model"])[0]
    model = getattr(ls_hf, architecture).from_pretrained(model_dir, config=config)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if isinstance(model, LongShortForCausalLM) and isinstance(tokenizer, PreTrainedTokenizerFast):
        tokenizer = causal_tokenizer(tokenizer)
    return model, tokenizer


def measured_metrics(model_dir: Path) -> tuple[dict, str | None, int | None]:
    """The card's metrics, the data they were measured on and the context of streaming scoring (bytes before each
    block; char_lm --model_type long_short_xl), from the recipe's ``all_results.json``: the test metrics when it has
    them (--do_predict), the evaluation metrics otherwise."""
    path = model_dir / "all_results.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    prefix = "test_" if "test_dataset" in results else "eval_"
    names = {key: key.replace("eval_", prefix) for key in METRICS}
    metrics = {key: results[name] for key, name in names.items() if name in results}
    return metrics, results.get(prefix + "dataset"), results.get(prefix + "memory_length")


def summary(model) -> str:
    """One line on the architecture: size, attention and, for ``LongShortXLForCausalLM``, positions and memory."""
    c = model.config
    if isinstance(c, LongShortXLConfig):
        positions = (
            f"Transformer-XL relative positions (no length limit), memory_length={c.memory_length}, "
            f"causal_segment_length={c.causal_segment_length}, window_rule={c.window_rule}, "
            f"projection_input={c.projection_input}"
        )
    else:
        positions = f"{c.max_input_length} tokens"
    return (
        f"{type(model).__name__}: {c.num_hidden_layers} layers, hidden size {c.hidden_size}, {positions}, "
        f"window_size={c.window_size}, projection_rank={c.projection_rank}, use_dual_ln={c.use_dual_ln}"
    )


def model_card(
    template: str, repo_id: str, model, metrics: dict, dataset: str | None = None, context: int | None = None
) -> str:
    """Fill ``template``: ``{{repo_id}}``, ``{{auto_class}}``, ``{{architecture}}``, the metadata defaults, and the
    ``metrics`` measured on ``dataset`` (model-index metadata and the table at ``<!-- measured results -->``;
    ``context``: bytes before each block in streaming scoring, named beside ``eval_bpc``)."""
    auto_class, pipeline_tag = {**HEADS, **HEADS_XL}[type(model)]
    for key, value in {"repo_id": repo_id, "auto_class": auto_class, "architecture": summary(model)}.items():
        template = template.replace("{{" + key + "}}", value)
    card = ModelCard(template)
    card.data.library_name = card.data.library_name or "transformers"
    card.data.pipeline_tag = card.data.pipeline_tag or pipeline_tag
    if not metrics:
        card.text = card.text.replace(RESULTS_MARKER, "Not measured yet: no `all_results.json` in the model folder.")
        return str(card)
    dataset = dataset or (card.data.datasets or ["local data"])[0]
    names = {key: METRICS[key][1] for key in metrics}
    if context is not None and "eval_bpc" in names:
        names["eval_bpc"] += f", streaming with up to {context:,} bytes of context"
    card.data.model_name = repo_id.split("/")[-1]
    card.data.eval_results = [
        EvalResult(
            task_type=card.data.pipeline_tag,
            dataset_type=dataset,
            dataset_name=dataset,
            metric_type=METRICS[key][0],
            metric_name=names[key],
            metric_value=round(value, 4),
        )
        for key, value in metrics.items()
    ]
    rows = "\n".join(f"| {names[key]} | {value:.4f} |" for key, value in metrics.items())
    card.text = card.text.replace(RESULTS_MARKER, f"| metric ({dataset}) | value |\n|---|---|\n{rows}")
    return str(card)


def build_repo_folder(model_dir, repo_id: str, folder, card_path=None, overwrite: bool = False) -> Path:
    """Write the Hub repo folder for ``model_dir`` to ``folder``; ``ValueError`` names a bad argument."""
    model_dir = Path(model_dir)
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(f"REPO_ID {repo_id!r} is not a valid repo id such as user/roberta-ls-base ({err}).") from err
    if card_path is not None and not Path(card_path).is_file():
        raise ValueError(f"--model-card {str(card_path)!r}: no such file.")
    if Path(folder).exists() and not overwrite:
        raise ValueError(f"--dry-run {str(folder)!r} already exists; pick a new folder or pass --overwrite.")
    config = model_config(model_dir)
    if card_path is None:
        named = CARDS / f"{repo_id.split('/')[-1]}.md"
        card_path = named if named.is_file() else CARDS / TEMPLATES[config.model_type]
    model, tokenizer = load_model(model_dir, config)
    card = model_card(Path(card_path).read_text(), repo_id, model, *measured_metrics(model_dir))
    return save_for_hub(model, folder, tokenizer, files={"README.md": card}, overwrite=overwrite)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m recipes.push_to_hub", description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="a LongShort model folder (a recipe's --output_dir)")
    parser.add_argument("repo_id", metavar="REPO_ID", help="Hub repository, e.g. user/roberta-ls-base-imdb")
    parser.add_argument("--dry-run", metavar="DIR", help="write the repo folder to DIR and upload nothing")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --dry-run DIR")
    parser.add_argument("--model-card", metavar="PATH", help="card template (default: model_cards/<repo name>.md)")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--token", help="Hub token (default: the one saved by `hf auth login`)")
    parser.add_argument("--commit-message", default="Upload LongShort model", help="commit message of the upload")
    args = parser.parse_args(argv)
    try:
        if args.dry_run:
            folder = build_repo_folder(args.model_dir, args.repo_id, args.dry_run, args.model_card, args.overwrite)
            print(f"wrote the Hub repo folder for {args.repo_id} to {folder} (nothing uploaded)")
            return
        api = HfApi(token=args.token)
        hub_call(api.whoami)  # logged in and online, before any work
        with tempfile.TemporaryDirectory() as tmp:
            folder = build_repo_folder(args.model_dir, args.repo_id, Path(tmp) / "repo", args.model_card)
            url = hub_call(api.create_repo, args.repo_id, private=args.private, exist_ok=True)
            hub_call(api.upload_folder, folder_path=folder, repo_id=args.repo_id, commit_message=args.commit_message)
            print(f"uploaded {args.model_dir} to {url}")
    except ValueError as err:
        parser.error(str(err))


def hub_call(method, *args, **kwargs):
    """``method(*args, **kwargs)`` of ``HfApi``; a missing login, a refused token or no network is a ``ValueError``
    saying what to do (the Hub client raises different types for each, by version)."""
    try:
        return method(*args, **kwargs)
    except Exception as err:  # LocalTokenNotFoundError, HfHubHTTPError, offline and network errors
        raise ValueError(
            f"the Hub refused or could not be reached ({type(err).__name__}: {str(err).splitlines()[0]}); log in with "
            f"`hf auth login` (or pass --token) and check the network, or write the folder only with --dry-run DIR."
        ) from err


if __name__ == "__main__":
    sys.exit(main())

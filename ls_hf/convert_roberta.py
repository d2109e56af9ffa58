"""``ls-convert SRC OUT`` (also ``ls-convert-roberta``): turn an encoder checkpoint into a LongShort model.

Sources (``SOURCES``): RoBERTa, XLM-RoBERTa and CamemBERT masked LMs, BERT masked LMs (SciBERT, domain BERTs), the
ELECTRA discriminator (written as a bare ``LongShortModel``: its replaced-token head has no LongShort counterpart and
is left out), and Longformer masked LMs (its 4,096 trained positions kept; its ``query_global``/``key_global``/
``value_global`` become the global tokens' own projections, ``global_projections=True``).

Longformer's recipe (Beltagy et al., 2020, Sec. 5), applied to Long-Short attention:

* every source weight is copied, renamed by the source's key mapping (the attention core owns its output
  projection, so ``attention.output.dense`` becomes ``attention.self.output``);
* the position table grows to ``max_position_embeddings`` tokens: the ``pad_token_id + 1`` offset rows are kept and
  the learned rows are tiled (copying, not random init, is what lets training start well). BERT and ELECTRA count
  positions from 0, RoBERTa from ``pad_token_id + 1``: their table is moved down by ``pad_token_id + 1`` rows, so the
  model keeps RoBERTa's one position rule (padding aware) and computes the source's positions exactly;
* the new parameters get the model's init (``_init_weights``): W^P of the dynamic projection U(+-1/sqrt(d)) (about
  N(0, 0.02) at d = 768), so its softmax starts close to uniform pooling with the symmetry broken, and DualLN gains 1,
  biases 0;
* the tokenizer is saved with ``model_max_length = max_position_embeddings``; ``sep_token_id`` is the tokenizer's.

``causal=True`` (``--causal``) writes a ``LongShortForCausalLM`` (``is_decoder=True``: causal attention, Eq. 5)
warm-started from a masked LM's weights, with ``causal_tokenizer``: it adds the start token and no end token, so that
``generate`` and ``pipeline("text-generation")`` continue a prompt.

With ``use_dual_ln=False``, ``projection_rank=0`` and a window covering the input the converted model computes the
source's function (tested to 1e-5 on the logits or hidden states, with global tokens).
"""

import argparse
import difflib
import re
import ssl
import sys
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import torch
from huggingface_hub import constants, is_offline_mode
from tokenizers import Tokenizer
from transformers import (
    AutoConfig,
    AutoModelForMaskedLM,
    AutoModelForPreTraining,
    AutoTokenizer,
    PreTrainedTokenizerFast,
)

from .configuration_long_short import LongShortConfig
from .hub import is_local_path, save_for_hub
from .modeling_long_short import ROBERTA_KEY_MAPPING, LongShortForCausalLM, LongShortForMaskedLM, LongShortModel

__all__ = ["ROBERTA_FAMILY", "SOURCES", "Source", "causal_tokenizer", "convert_roberta", "main", "misspelt_folder"]

POSITIONS = "embeddings.position_embeddings.weight"
OUTPUT_DENSE = {r"\.attention\.output\.dense\.": ".attention.self.output."}


class Source(NamedTuple):
    """How one source model type converts."""

    auto_class: type  # loads the source checkpoint
    kind: str  # what the source must be, for errors
    key_mapping: dict  # regex -> replacement, applied in order, onto the written model's keys
    head: type  # the LongShort class written
    positions_from_zero: bool = False  # BERT-style positions (0, 1, ...) rather than RoBERTa's pad_token_id + 1
    dropped: str | None = None  # regex of source keys with no LongShort counterpart (left out, logged)
    long_short_fields: tuple = ()  # (LongShortConfig field, value) pairs


_ROBERTA = Source(
    AutoModelForMaskedLM,
    "a *ForMaskedLM checkpoint (e.g. roberta-base), not a bare encoder",
    ROBERTA_KEY_MAPPING,
    LongShortForMaskedLM,
)
_BERT_MLM_HEAD = {
    r"^cls\.predictions\.transform\.dense\.": "lm_head.dense.",
    r"^cls\.predictions\.transform\.LayerNorm\.": "lm_head.layer_norm.",
    r"^cls\.predictions\.": "lm_head.",
}
SOURCES = {
    "roberta": _ROBERTA,
    "xlm-roberta": _ROBERTA,
    "camembert": _ROBERTA,
    "bert": Source(
        AutoModelForMaskedLM,
        "a BertForMaskedLM checkpoint (e.g. bert-base-uncased), not a bare encoder",
        {r"^bert\.": "long_short.", **OUTPUT_DENSE, **_BERT_MLM_HEAD},
        LongShortForMaskedLM,
        positions_from_zero=True,
    ),
    "electra": Source(
        AutoModelForPreTraining,
        "an ELECTRA discriminator (ElectraForPreTraining, e.g. google/electra-base-discriminator)",
        {r"^electra\.": "", **OUTPUT_DENSE},
        LongShortModel,
        positions_from_zero=True,
        dropped=r"^discriminator_predictions\.",
    ),
    "longformer": Source(
        AutoModelForMaskedLM,
        "a LongformerForMaskedLM checkpoint (e.g. allenai/longformer-base-4096)",
        {
            r"^longformer\.": "long_short.",
            **OUTPUT_DENSE,
            r"\.attention\.self\.(query|key|value)_global\.": r".attention.self.global_\1.",
        },
        LongShortForMaskedLM,
        long_short_fields=(("global_projections", True),),
    ),
}
# Model types whose masked LM has RoBERTa's exact layout (post-LN encoder, learned positions after pad_token_id).
ROBERTA_FAMILY = tuple(name for name, source in SOURCES.items() if source is _ROBERTA)


def _rename(key: str, source: Source) -> str:
    for pattern, replacement in source.key_mapping.items():
        key = re.sub(pattern, replacement, key)
    return key


def _pattern(key: str) -> str:
    """``...layer.3.x`` -> ``...layer.*.x``, to print one line per kind of weight."""
    return re.sub(r"\.\d+\.", ".*.", key)


def misspelt_folder(name) -> str | None:
    """For a ``name`` that is no local path but reads as a Hub id: a model folder (one with a ``config.json``) beside
    where it would be whose name is close to it, as a typo makes, else None. Asked before the Hub, whose retries take
    half a minute without a network."""
    path = Path(str(name)).expanduser()
    if is_local_path(name) or not path.parent.is_dir():
        return None
    folders = [entry.name for entry in path.parent.iterdir() if (entry / "config.json").is_file()]
    close = difflib.get_close_matches(path.name, folders, n=1, cutoff=0.8)
    return str(path.parent / close[0]) if close else None


def hub_unreachable() -> str | None:
    """Why the Hub cannot be asked for a model now: offline mode (``HF_HUB_OFFLINE``), or no answer from its endpoint
    within 5 s; None when it answers. One request, without the retries of a download (about 30 s with no network)."""
    if is_offline_mode():
        return "HF_HUB_OFFLINE is set"
    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=5).close()
    except urllib.error.HTTPError:
        return None  # it answered
    except urllib.error.URLError as err:
        if isinstance(err.reason, ssl.SSLError):  # it answered; certificates are the Hub client's to judge
            return None
        return f"the Hub ({constants.ENDPOINT}) cannot be reached ({err.reason})"
    except OSError as err:  # a timeout
        return f"the Hub ({constants.ENDPOINT}) cannot be reached ({err})"
    return None


def _load_source(src: str):
    """Source config, masked LM and tokenizer; ``ValueError`` naming the problem if SRC is unusable."""
    src = str(src)
    path = Path(src).expanduser()
    local = is_local_path(src)
    if local and not path.is_dir():
        raise ValueError(f"SRC {src!r}: no such folder. Pass a local checkpoint folder or a Hub id (roberta-base).")
    if (close := misspelt_folder(src)) is not None:
        raise ValueError(
            f"SRC {src!r}: no such local folder; did you mean {close!r}? (A Hub model: give its id with "
            f"the owner, owner/name.)"
        )
    src = str(path) if local else src
    offline = None if local else hub_unreachable()
    cached = {"local_files_only": True} if offline else {}  # only the Hub cache: no download to retry
    try:
        config = AutoConfig.from_pretrained(src, **cached)
    except (OSError, ValueError) as err:
        if offline:
            raise ValueError(
                f"SRC {src!r}: no local folder of that name, {offline}, and the Hub cache ({constants.HF_HUB_CACHE}) "
                f"holds no copy of it. Pass a local checkpoint folder, or convert where the Hub can be reached"
                f"{' (without HF_HUB_OFFLINE)' if is_offline_mode() else ''}."
            ) from err
        where = "" if local else " no local folder of that name, and"
        raise ValueError(f"SRC {src!r}:{where} could not load a config.json from it ({err}).") from err
    if config.model_type not in SOURCES:
        raise ValueError(
            f"SRC {src!r} is a {config.model_type!r} checkpoint (architectures {config.architectures}), which "
            f"ls-convert does not convert; it converts model types {', '.join(SOURCES)} (ELECTRA: the discriminator)."
        )
    family = SOURCES[config.model_type]
    if config.model_type == "electra" and config.embedding_size != config.hidden_size:
        raise ValueError(
            f"SRC {src!r} is an ELECTRA with embedding_size={config.embedding_size} != hidden_size="
            f"{config.hidden_size} (an embeddings projection, as electra-small); LongShort's embeddings have the "
            f"model width, so only ELECTRAs with equal sizes (base, large) convert."
        )
    if family.head is LongShortForMaskedLM and config.hidden_act != "gelu":
        raise ValueError(
            f"SRC {src!r} has hidden_act={config.hidden_act!r}; the LongShort masked-LM head applies gelu, as "
            f"RoBERTa's, so only gelu models convert."
        )
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        raise ValueError(
            f"SRC {src!r} uses position_embedding_type={config.position_embedding_type!r}; only RoBERTa's absolute "
            f"positions can be extended."
        )
    if config.pad_token_id is None:
        raise ValueError(
            f"SRC {src!r} has pad_token_id=None in its config; RoBERTa positions start at pad_token_id + 1, so set "
            f"it to the tokenizer's pad id (RoBERTa's is 1) in SRC's config.json."
        )
    try:
        source, info = family.auto_class.from_pretrained(src, dtype=torch.float32, output_loading_info=True, **cached)
    except OSError as err:
        raise ValueError(f"SRC {src!r}: could not load masked-LM weights from it ({err}).") from err
    if info["missing_keys"]:
        raise ValueError(f"SRC {src!r} lacks masked-LM weights {sorted(info['missing_keys'])[:5]}; pass {family.kind}.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(src, **cached)
    except (OSError, ValueError) as err:
        raise ValueError(f"SRC {src!r} has no usable tokenizer ({err}); save one next to the weights.") from err
    problem = _tokenizer_problem(tokenizer, config)
    if problem:
        raise ValueError(
            f"SRC {src!r} has no usable tokenizer: {problem}. Save the checkpoint's own tokenizer next to the weights "
            f"(tokenizer.save_pretrained(SRC)); its pad token must be the config's pad_token_id."
        )
    return config, source, tokenizer, family


def _tokenizer_problem(tokenizer, config) -> str | None:
    """Why ``tokenizer`` cannot go with a model of ``config`` (from no files Transformers builds an empty one)."""
    if len(tokenizer) <= len(tokenizer.all_special_ids):
        return f"it holds only its {len(tokenizer)} special tokens (no vocabulary files?)"
    if len(tokenizer) > config.vocab_size:
        return f"its {len(tokenizer)} tokens exceed the model's vocab_size={config.vocab_size}"
    if tokenizer.pad_token_id != config.pad_token_id:  # padded positions and embeddings key on the config's pad id
        return f"its pad_token_id is {tokenizer.pad_token_id}, the model's is {config.pad_token_id}"
    return None


def _long_short_config(
    config, max_position_embeddings, window_size, projection_rank, use_dual_ln, causal, **fields
) -> LongShortConfig:
    """``LongShortConfig.from_roberta``, bidirectional (a masked LM or an encoder) unless ``causal``, with the new
    position count and ``fields``."""
    long_short = {"window_size": window_size, "projection_rank": projection_rank}
    return LongShortConfig.from_roberta(
        config,
        **{key: value for key, value in long_short.items() if value is not None},
        max_position_embeddings=max_position_embeddings + config.pad_token_id + 1,
        use_dual_ln=use_dual_ln,
        is_decoder=causal,
        **fields,
    )


def causal_tokenizer(tokenizer):
    """``tokenizer`` for a causal checkpoint: the same vocabulary, pre-tokenizer, decoder and special tokens, adding
    the start token (``bos_token``, else ``cls_token``) before a text and nothing after it. RoBERTa's and BERT's
    tokenizers end every text with ``</s>`` / ``[SEP]``, so a prompt would end with an end token and generation would
    start over after it; GPT-style tokenizers add none. A ``PreTrainedTokenizerFast`` with ``add_bos_token=True,
    add_eos_token=False`` (saved in its ``tokenizer_config.json``) and left padding, as Transformers decoders use:
    ``AutoTokenizer`` loads it anywhere, without this package."""
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise TypeError(f"a causal checkpoint needs a fast (tokenizers) tokenizer, got {type(tokenizer).__name__}.")
    specials = {
        name: getattr(tokenizer, name)
        for name in tokenizer.SPECIAL_TOKENS_ATTRIBUTES
        if getattr(tokenizer, name) is not None
    }
    start = tokenizer.bos_token or tokenizer.cls_token  # a byte tokenizer has none: nothing is added then
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer.backend_tokenizer.to_str()),
        **{**specials, **({"bos_token": start} if start else {})},
        add_bos_token=start is not None,
        add_eos_token=False,
        padding_side="left",
        model_max_length=tokenizer.model_max_length,
        clean_up_tokenization_spaces=tokenizer.clean_up_tokenization_spaces,
    )


def _extend_positions(old: torch.Tensor, new_rows: int, offset: int) -> torch.Tensor:
    """Keep the ``offset`` rows before the first position, tile the learned rows up to ``new_rows`` (Longformer)."""
    learned = old[offset:]
    repeats = -(-(new_rows - offset) // len(learned))
    return torch.cat([old[:offset], learned.repeat(repeats, 1)[: new_rows - offset]])


def _copy_weights(source, model, family: Source, log) -> None:
    """Copy the source checkpoint into ``model``; raise if the layouts do not match one to one."""
    kept = {
        key: value
        for key, value in source.state_dict().items()
        if family.dropped is None or not re.search(family.dropped, key)
    }
    state = {_rename(key, family): value for key, value in kept.items()}
    positions_key = next((key for key in state if key.endswith(POSITIONS)), None)
    if positions_key is None or positions_key not in dict(model.named_parameters()):
        found = sorted({key.split(".")[0] for key in source.state_dict()})
        raise ValueError(f"SRC weights do not have the {source.config.model_type} layout: found key prefixes {found}.")
    offset = model.config.pad_token_id + 1
    old_positions = state.pop(positions_key)
    if family.positions_from_zero:  # row t of the source serves the t-th real token, which LongShort puts at t + offset
        old_positions = torch.cat([old_positions.new_zeros(offset, old_positions.shape[1]), old_positions])
    new_positions = model.get_parameter(positions_key)
    state[positions_key] = _extend_positions(old_positions, len(new_positions), offset)
    missing, unexpected = model.load_state_dict(state, strict=False)
    new = [key for key in missing if "dynamic_projection" in key or "dual_ln" in key]
    if unexpected or set(missing) - set(new):
        raise ValueError(
            f"SRC weights do not match the {source.config.model_type} layout: unexpected {sorted(unexpected)[:5]}, "
            f"missing {sorted(set(missing) - set(new))[:5]}."
        )
    renamed = Counter((_pattern(key), _pattern(_rename(key, family))) for key in kept)
    log(f"mapped {len(state)} tensors from SRC:")
    for (old, target), count in renamed.items():
        log(f"  {old} -> {target}" + (f"  (x{count})" if count > 1 else ""))
    for key in sorted({_pattern(key) for key in source.state_dict()} - {_pattern(key) for key in kept}):
        log(f"  left out {key} (no LongShort counterpart)")
    shifted = f", moved down {offset} rows (positions from 0)" if family.positions_from_zero else ""
    if len(new_positions) >= len(old_positions):
        log(
            f"extended {POSITIONS}: {len(old_positions)} -> {len(new_positions)} rows (offset rows kept, rest tiled"
            f"{shifted})"
        )
    else:
        log(f"truncated {POSITIONS}: {len(old_positions)} -> {len(new_positions)} rows (the first ones kept{shifted})")
    if new:
        bound = 1 / model.config.hidden_size**0.5
        log(f"initialised {len(new)} new tensors (W^P: U(+-{bound:.4f}), bias 0; DualLN: weight 1, bias 0):")
    for key in sorted({_pattern(key) for key in new}):
        log(f"  {key}")


def convert_roberta(
    src: str,
    out: str,
    *,
    max_position_embeddings: int = 4096,
    window_size: int | None = None,
    projection_rank: int | None = None,
    use_dual_ln: bool = True,
    causal: bool = False,
    overwrite: bool = False,
    log=print,
) -> Path:
    """Convert the checkpoint ``src`` (folder or Hub id; a model type of ``SOURCES``) into a LongShort masked LM
    (ELECTRA discriminator: a ``LongShortModel``; ``causal``: a ``LongShortForCausalLM`` with ``causal_tokenizer``)
    saved at ``out``.

    ``max_position_embeddings`` counts tokens (the config gets ``+ pad_token_id + 1`` rows); ``window_size`` and
    ``projection_rank`` default to ``LongShortConfig``'s. Writes safetensors weights, a config with a complete
    ``auto_map``, the remote-code files and the tokenizer into a temporary folder, then moves it to ``out``.
    Raises ``ValueError``, before writing anything, for a missing folder, an unsupported model type, missing weights,
    ``pad_token_id=None``, a missing or mismatched tokenizer, or an existing ``out`` without ``overwrite``. Returns
    ``Path(out)``.
    """
    out = Path(out).expanduser()
    if not isinstance(max_position_embeddings, int) or max_position_embeddings < 1:
        raise ValueError(f"max_position_embeddings must be a positive token count, got {max_position_embeddings!r}.")
    if out.exists() and not overwrite:
        raise ValueError(f"OUT {str(out)!r} already exists; pass --overwrite (overwrite=True) to replace it.")
    config, source, tokenizer, family = _load_source(src)
    if causal and (family.head is not LongShortForMaskedLM or family.long_short_fields):
        raise ValueError(
            f"--causal warm-starts a causal LM from a RoBERTa or BERT masked LM; SRC {str(src)!r} is a "
            f"{config.model_type!r} checkpoint ({family.kind}), whose extra parts (an ELECTRA "
            f"discriminator's head, Longformer's global projections) a causal model has no use for."
        )
    long_short_config = _long_short_config(
        config,
        max_position_embeddings,
        window_size,
        projection_rank,
        use_dual_ln,
        causal,
        sep_token_id=tokenizer.sep_token_id,
        **dict(family.long_short_fields),
    )
    if family.head is LongShortModel:
        model = LongShortModel(long_short_config, add_pooling_layer=False)
    else:
        model = (LongShortForCausalLM if causal else family.head)(long_short_config)
    _copy_weights(source, model, family, log)
    tokenizer.model_max_length = tokenizer.init_kwargs["model_max_length"] = max_position_embeddings
    if causal:
        tokenizer = causal_tokenizer(tokenizer)

    save_for_hub(model, out, tokenizer, overwrite=overwrite)
    c = model.config
    log(
        f"wrote {out}: {type(model).__name__}, {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
        f"{max_position_embeddings} tokens, window_size={c.window_size}, projection_rank={c.projection_rank}, "
        f"use_dual_ln={c.use_dual_ln}; tokenizer model_max_length={tokenizer.model_max_length}"
    )
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="ls-convert",
        description="Convert a RoBERTa, XLM-RoBERTa, CamemBERT, BERT or Longformer masked LM, or an ELECTRA "
        "discriminator, into a LongShort model (also installed as ls-convert-roberta).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    defaults = LongShortConfig()
    parser.add_argument(
        "src", metavar="SRC", help=f"local checkpoint folder or Hub id; model types: {', '.join(SOURCES)}"
    )
    parser.add_argument("out", metavar="OUT", help="output folder (created; see --overwrite)")
    parser.add_argument("--max-position-embeddings", type=int, default=4096, help="tokens the model reads")
    parser.add_argument("--window-size", type=int, default=defaults.window_size, help="window segment length w")
    parser.add_argument(
        "--projection-rank",
        type=int,
        default=defaults.projection_rank,
        help="dynamic projection rank r; 0 turns it off",
    )
    parser.add_argument("--no-dual-ln", action="store_true", help="leave DualLN out (exact RoBERTa function)")
    parser.add_argument(
        "--causal",
        action="store_true",
        help="write a causal LM (LongShortForCausalLM) warm-started "
        "from the masked LM, with a tokenizer that ends a prompt with no end token",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    args = parser.parse_args(argv)
    try:
        convert_roberta(
            args.src,
            args.out,
            max_position_embeddings=args.max_position_embeddings,
            window_size=args.window_size,
            projection_rank=args.projection_rank,
            use_dual_ln=not args.no_dual_ln,
            causal=args.causal,
            overwrite=args.overwrite,
        )
    except ValueError as err:
        parser.error(str(err))


if __name__ == "__main__":
    sys.exit(main())

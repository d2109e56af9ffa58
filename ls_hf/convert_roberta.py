"""``ls-convert-roberta SRC OUT``: turn a RoBERTa-family masked LM into a LongShort masked LM.

Longformer's recipe (Beltagy et al., 2020, Sec. 5), applied to Long-Short attention:

* every RoBERTa weight is copied, renamed by ``ROBERTA_KEY_MAPPING`` (the attention core owns its output
  projection, so ``attention.output.dense`` becomes ``attention.self.output``);
* the position table grows from 512 to ``max_position_embeddings`` tokens: the ``pad_token_id + 1`` offset rows
  are kept and the learned rows are tiled (copying, not random init, is what lets training start well);
* the new parameters get the model's init (``_init_weights``): W^P of the dynamic projection U(+-1/sqrt(d)) (about
  N(0, 0.02) at d = 768), so its softmax starts close to uniform pooling with the symmetry broken, and DualLN gains 1,
  biases 0;
* the tokenizer is saved with ``model_max_length = max_position_embeddings``.

With ``use_dual_ln=False``, ``projection_rank=0`` and a window covering the input the converted model computes the
source's function (tested to 1e-4 on the masked-LM logits).
"""

import argparse
import os
import re
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForMaskedLM, AutoTokenizer

from .configuration_long_short import LongShortConfig
from .hub import save_for_hub
from .modeling_long_short import ROBERTA_KEY_MAPPING, LongShortForMaskedLM

__all__ = ["ROBERTA_FAMILY", "convert_roberta", "main", "write_folder"]

# Model types whose masked LM has RoBERTa's exact layout (post-LN encoder, learned positions after pad_token_id).
ROBERTA_FAMILY = ("roberta", "xlm-roberta", "camembert")
POSITIONS = "embeddings.position_embeddings.weight"


def _rename(key: str) -> str:
    for pattern, replacement in ROBERTA_KEY_MAPPING.items():
        key = re.sub(pattern, replacement, key)
    return key


def _pattern(key: str) -> str:
    """``...layer.3.x`` -> ``...layer.*.x``, to print one line per kind of weight."""
    return re.sub(r"\.\d+\.", ".*.", key)


def _load_source(src: str):
    """Source config, masked LM and tokenizer; ``ValueError`` naming the problem if SRC is unusable."""
    src = str(src)
    path = Path(src).expanduser()
    looks_local = src.startswith((".", "/", "~")) or src.count("/") > 1 or path.exists()
    if looks_local and not path.is_dir():
        raise ValueError(f"SRC {src!r}: no such folder. Pass a local checkpoint folder or a Hub id (roberta-base).")
    src = str(path) if looks_local else src
    try:
        config = AutoConfig.from_pretrained(src)
    except (OSError, ValueError) as err:
        raise ValueError(f"SRC {src!r}: could not load a config.json from it ({err}).") from err
    if config.model_type not in ROBERTA_FAMILY:
        raise ValueError(
            f"SRC {src!r} is a {config.model_type!r} checkpoint (architectures {config.architectures}), not "
            f"RoBERTa-family; ls-convert-roberta converts model types {', '.join(ROBERTA_FAMILY)}."
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
        source, info = AutoModelForMaskedLM.from_pretrained(src, dtype=torch.float32, output_loading_info=True)
    except OSError as err:
        raise ValueError(f"SRC {src!r}: could not load masked-LM weights from it ({err}).") from err
    if info["missing_keys"]:
        raise ValueError(
            f"SRC {src!r} lacks masked-LM weights {sorted(info['missing_keys'])[:5]}; pass a *ForMaskedLM checkpoint "
            f"(e.g. roberta-base), not a bare encoder."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError) as err:
        raise ValueError(f"SRC {src!r} has no usable tokenizer ({err}); save one next to the weights.") from err
    problem = _tokenizer_problem(tokenizer, config)
    if problem:
        raise ValueError(
            f"SRC {src!r} has no usable tokenizer: {problem}. Save the checkpoint's own tokenizer next to the weights "
            f"(tokenizer.save_pretrained(SRC)); its pad token must be the config's pad_token_id."
        )
    return config, source, tokenizer


def _tokenizer_problem(tokenizer, config) -> str | None:
    """Why ``tokenizer`` cannot go with a model of ``config`` (from no files Transformers builds an empty one)."""
    if len(tokenizer) <= len(tokenizer.all_special_ids):
        return f"it holds only its {len(tokenizer)} special tokens (no vocabulary files?)"
    if len(tokenizer) > config.vocab_size:
        return f"its {len(tokenizer)} tokens exceed the model's vocab_size={config.vocab_size}"
    if tokenizer.pad_token_id != config.pad_token_id:  # padded positions and embeddings key on the config's pad id
        return f"its pad_token_id is {tokenizer.pad_token_id}, the model's is {config.pad_token_id}"
    return None


def _long_short_config(config, max_position_embeddings, window_size, projection_rank, use_dual_ln) -> LongShortConfig:
    """``LongShortConfig.from_roberta``, bidirectional (the output is a masked LM), with the new position count."""
    long_short = {"window_size": window_size, "projection_rank": projection_rank}
    return LongShortConfig.from_roberta(
        config,
        **{key: value for key, value in long_short.items() if value is not None},
        max_position_embeddings=max_position_embeddings + config.pad_token_id + 1,
        use_dual_ln=use_dual_ln,
        is_decoder=False,
    )


def _extend_positions(old: torch.Tensor, new_rows: int, offset: int) -> torch.Tensor:
    """Keep the ``offset`` rows before the first position, tile the learned rows up to ``new_rows`` (Longformer)."""
    learned = old[offset:]
    repeats = -(-(new_rows - offset) // len(learned))
    return torch.cat([old[:offset], learned.repeat(repeats, 1)[: new_rows - offset]])


def _copy_weights(source, model, log) -> None:
    """Copy the source masked LM into ``model``; raise if the layouts do not match one to one."""
    state = {_rename(key): value for key, value in source.state_dict().items()}
    if not any(key.startswith("long_short.") for key in state):
        found = sorted({key.split(".")[0] for key in source.state_dict()})
        raise ValueError(f"SRC weights are not RoBERTa-family: expected keys 'roberta.*', found prefixes {found}.")
    prefix = "long_short."
    old_positions = state.pop(prefix + POSITIONS)
    new_positions = model.get_parameter(prefix + POSITIONS)
    state[prefix + POSITIONS] = _extend_positions(old_positions, len(new_positions), model.config.pad_token_id + 1)
    missing, unexpected = model.load_state_dict(state, strict=False)
    new = [key for key in missing if "dynamic_projection" in key or "dual_ln" in key]
    if unexpected or set(missing) - set(new):
        raise ValueError(
            f"SRC weights do not match RoBERTa's layout: unexpected {sorted(unexpected)[:5]}, missing "
            f"{sorted(set(missing) - set(new))[:5]}."
        )
    renamed = Counter((_pattern(key), _pattern(_rename(key))) for key in source.state_dict())
    log(f"mapped {len(state)} tensors from SRC:")
    for (old, target), count in renamed.items():
        log(f"  {old} -> {target}" + (f"  (x{count})" if count > 1 else ""))
    log(f"extended {POSITIONS}: {len(old_positions)} -> {len(new_positions)} rows (offset rows kept, rest tiled)")
    if new:
        bound = 1 / model.config.hidden_size**0.5
        log(f"initialised {len(new)} new tensors (W^P: U(+-{bound:.4f}), bias 0; DualLN: weight 1, bias 0):")
    for key in sorted({_pattern(key) for key in new}):
        log(f"  {key}")


def write_folder(out, model, tokenizer, files: dict | None = None, overwrite: bool = False) -> Path:
    """Save ``model`` and ``tokenizer`` as a Hub folder (``save_for_hub``) plus ``files`` (name -> text) at ``out``.

    Everything is written next to ``out`` first and moved into place at the end (replacing ``out`` only when
    ``overwrite``), so a failure leaves neither a half-written nor a missing folder.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise ValueError(f"{str(out)!r} already exists; pass --overwrite (overwrite=True) to replace it.")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_for_hub(model, staging / "new", tokenizer)
        for name, text in (files or {}).items():
            (staging / "new" / name).write_text(text)
        if out.exists():
            os.replace(out, staging / "old")
        os.replace(staging / "new", out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def convert_roberta(
    src: str,
    out: str,
    *,
    max_position_embeddings: int = 4096,
    window_size: int | None = None,
    projection_rank: int | None = None,
    use_dual_ln: bool = True,
    overwrite: bool = False,
    log=print,
) -> Path:
    """Convert the RoBERTa-family masked LM ``src`` (folder or Hub id) into a LongShort masked LM saved at ``out``.

    ``max_position_embeddings`` counts tokens (the config gets ``+ pad_token_id + 1`` rows); ``window_size`` and
    ``projection_rank`` default to ``LongShortConfig``'s. Writes safetensors weights, a config with a complete
    ``auto_map``, the remote-code files and the tokenizer into a temporary folder, then moves it to ``out``.
    Raises ``ValueError``, before writing anything, for a missing folder, a non-RoBERTa checkpoint, missing weights,
    ``pad_token_id=None``, a missing or mismatched tokenizer, or an existing ``out`` without ``overwrite``. Returns
    ``Path(out)``.
    """
    out = Path(out).expanduser()
    if not isinstance(max_position_embeddings, int) or max_position_embeddings < 1:
        raise ValueError(f"max_position_embeddings must be a positive token count, got {max_position_embeddings!r}.")
    if out.exists() and not overwrite:
        raise ValueError(f"OUT {str(out)!r} already exists; pass --overwrite (overwrite=True) to replace it.")
    config, source, tokenizer = _load_source(src)
    model = LongShortForMaskedLM(
        _long_short_config(config, max_position_embeddings, window_size, projection_rank, use_dual_ln)
    )
    _copy_weights(source, model, log)
    tokenizer.model_max_length = tokenizer.init_kwargs["model_max_length"] = max_position_embeddings

    write_folder(out, model, tokenizer, overwrite=overwrite)
    c = model.config
    log(
        f"wrote {out}: LongShortForMaskedLM, {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
        f"{max_position_embeddings} tokens, window_size={c.window_size}, projection_rank={c.projection_rank}, "
        f"use_dual_ln={c.use_dual_ln}; tokenizer model_max_length={tokenizer.model_max_length}"
    )
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="ls-convert-roberta",
        description="Convert a RoBERTa-family masked LM (roberta-base, roberta-large, ...) into a LongShort model.",
    )
    parser.add_argument("src", metavar="SRC", help="local checkpoint folder or Hub id of a RoBERTa-family masked LM")
    parser.add_argument("out", metavar="OUT", help="output folder (created; see --overwrite)")
    parser.add_argument("--max-position-embeddings", type=int, default=4096, help="tokens the model reads (4096)")
    parser.add_argument("--window-size", type=int, help="window segment length w (default: LongShortConfig's)")
    parser.add_argument("--projection-rank", type=int, help="dynamic projection rank r; 0 turns it off")
    parser.add_argument("--no-dual-ln", action="store_true", help="leave DualLN out (exact RoBERTa function)")
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
            overwrite=args.overwrite,
        )
    except ValueError as err:
        parser.error(str(err))


if __name__ == "__main__":
    sys.exit(main())

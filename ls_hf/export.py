"""Export LongShort models for deployment: ``torch.export`` (ExecuTorch, AOTInductor) and ONNX (ONNX Runtime), with
the batch size and the sequence length left dynamic, up to the position table's length.

On the CPU a LongShort model runs the grouped SDPA path (``long_short_tiles``), which exports; so do every head's
plain forward and the causal LM's forward without a cache. What does not export: cached generation (its cache is
Python state that grows with each step) and attention maps (``output_attentions``). In an exported graph the global
tokens' count cannot be read from the data: it is ``config.max_global_tokens`` per sample (later global tokens attend
as ordinary ones there); a classifier that only makes its first token global exports fastest with
``config.max_global_tokens=1``.

    from ls_hf.export import export_onnx
    export_onnx(model, "model.onnx")  # inputs: input_ids, attention_mask (and global_attention_mask)

Optimum's ``optimum-cli export onnx`` is not the way: optimum-onnx 0.1.0 requires transformers < 4.58, and it exports
with the TorchScript exporter (``dynamo=False``), which fixes the lengths the tiles are laid out with.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.export import Dim, ExportedProgram

__all__ = ["export_inputs", "export_onnx", "export_program"]


def export_inputs(model, *, batch_size: int = 2, length: int | None = None, choices: int = 2) -> dict:
    """Example inputs for exporting ``model`` (a LongShort model): random token ids (B, n), an ``attention_mask`` with
    padding at the end of the last row, and for a bidirectional model a ``global_attention_mask`` with the first token
    global; (B, choices, n) each for multiple choice. ``length``: n, by default ``min(max_input_length, 3 w + 5)``
    (several window segments and a last one cut short). The exported graph serves other sizes."""
    config = model.config
    window = max(config.window_size) if isinstance(config.window_size, list) else config.window_size
    n = length if length is not None else min(config.max_input_length, 3 * max(window, 1) + 5)
    if not 2 <= n <= config.max_input_length:
        raise ValueError(
            f"length must be between 2 and the model's max_input_length ({config.max_input_length}), got {n}."
        )
    shape = (batch_size, choices, n) if type(model).__name__.endswith("MultipleChoice") else (batch_size, n)
    generator = torch.Generator().manual_seed(0)
    special = max(token for token in (config.pad_token_id, config.bos_token_id, 2) if token is not None) + 1
    device = next(model.parameters()).device
    inputs = {"input_ids": torch.randint(special, config.vocab_size, shape, generator=generator)}
    inputs["attention_mask"] = torch.ones(shape, dtype=torch.long)
    inputs["attention_mask"][-1, ..., n - n // 4 :] = 0
    if not config.is_decoder:
        inputs["global_attention_mask"] = torch.zeros(shape, dtype=torch.long)
        inputs["global_attention_mask"][..., 0] = 1
    else:
        inputs["use_cache"] = False
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in inputs.items()}


def _dynamic_shapes(inputs: dict) -> dict:
    """Every size of every input tensor dynamic, its range found by the export (``Dim.AUTO``)."""
    return {
        key: {axis: Dim.AUTO for axis in range(value.dim())} if isinstance(value, torch.Tensor) else None
        for key, value in inputs.items()
    }


def _check_exportable(model) -> None:
    """Refuse what does not export, before any work: attention maps."""
    if getattr(model.config, "output_attentions", False):
        raise ValueError(
            "output_attentions=True does not export (the attention maps are an explicit softmax per window); set "
            "model.config.output_attentions = False."
        )


def export_program(model, inputs: dict | None = None) -> ExportedProgram:
    """``torch.export.export`` of ``model`` in eval mode on ``inputs`` (``export_inputs(model)`` by default), every size
    dynamic: the program serves any batch size and any length up to ``config.max_input_length``."""
    _check_exportable(model)
    inputs = export_inputs(model) if inputs is None else inputs
    model.eval()
    with torch.no_grad():
        return torch.export.export(model, (), inputs, dynamic_shapes=_dynamic_shapes(inputs), strict=False)


def export_onnx(model, path, inputs: dict | None = None, *, opset_version: int | None = None) -> Path:
    """``model`` in eval mode as an ONNX file at ``path`` (``torch.onnx.export(dynamo=True)``), every size of its
    inputs dynamic: ONNX Runtime runs it at any batch size and any length up to ``config.max_input_length``. Its
    inputs are named as the model's (``export_inputs``: ``input_ids``, ``attention_mask``, and for bidirectional models
    ``global_attention_mask``), its outputs as the model output's fields. Returns ``Path(path)``."""
    _check_exportable(model)
    inputs = export_inputs(model) if inputs is None else inputs
    path = Path(path)
    if path.suffix != ".onnx":
        raise ValueError(f"path must name an .onnx file, got {str(path)!r}.")
    model.eval()
    with torch.no_grad():
        outputs = model(**inputs)
    names = [key for key, value in outputs.items() if isinstance(value, torch.Tensor)]
    tensors = [key for key, value in inputs.items() if isinstance(value, torch.Tensor)]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")  # moved into place once written: no half-written file
    with torch.no_grad():
        torch.onnx.export(
            model,
            (),
            str(partial),
            kwargs=inputs,
            dynamic_shapes=_dynamic_shapes(inputs),
            input_names=tensors,
            output_names=names,
            dynamo=True,
            opset_version=opset_version,
            external_data=False,
        )
    partial.replace(path)
    return path

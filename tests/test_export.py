"""Deployment: the text models and the timm entries export with ``torch.export`` and to ONNX, every size dynamic, and
run in ONNX Runtime as in PyTorch at shapes other than the export's (float32, tolerances scaled to the outputs);
``torch.compile(fullgraph=True)`` runs the default CPU path without a graph break."""

import warnings

import numpy as np
import pytest
import timm
import torch

import ls_timm  # noqa: F401  (registers the timm entries)
from ls_hf import (
    LongShortConfig,
    LongShortForCausalLM,
    LongShortForMaskedLM,
    LongShortForMultipleChoice,
    LongShortForQuestionAnswering,
    LongShortForSequenceClassification,
    LongShortForTokenClassification,
    LongShortModel,
)
from ls_hf.export import export_inputs, export_onnx, export_program

ort = pytest.importorskip("onnxruntime")

pytestmark = pytest.mark.filterwarnings("ignore")
# Lengths other than the export's: shorter than a window, not a multiple of w = 8, and above 2,048 tokens.
SHAPES = [(1, 5), (3, 67), (4, 2101)]


def tiny(model_class, **overrides):
    """A 2-layer, 32-wide model (w = 8, r = 2, l = 4), float32, eval mode, fixed weights."""
    config = {
        "vocab_size": 100,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "window_size": 8,
        "projection_rank": 2,
        "max_position_embeddings": 2200,
        "causal_segment_length": 4,
        "max_global_tokens": 4,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    }
    torch.manual_seed(0)
    return model_class(LongShortConfig(**{**config, **overrides})).eval()


def inputs_at(model, batch: int, length: int, seed: int) -> dict:
    """``export_inputs`` at another shape, with padding on the left of the first row (causal: each row counts from its
    first real token) or a second global token (bidirectional)."""
    inputs = export_inputs(model, batch_size=batch, length=length)
    generator = torch.Generator().manual_seed(seed)
    inputs["input_ids"] = torch.randint(3, model.config.vocab_size, inputs["input_ids"].shape, generator=generator)
    if model.config.is_decoder:
        inputs["attention_mask"][0, : length // 3] = 0
    else:
        inputs["global_attention_mask"][0, ..., length // 2] = 1
    return inputs


def first(outputs):
    return outputs["logits"] if "logits" in outputs else outputs[0]


def assert_matches(got, expected):
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4 * max(scale, 1.0))


@pytest.mark.parametrize(
    "model_class, overrides",
    [
        (LongShortModel, {}),
        (LongShortForSequenceClassification, {}),
        (LongShortForCausalLM, {"is_decoder": True}),
        # the other heads over the same encoder: the deeper tier
        pytest.param(LongShortForMaskedLM, {}, marks=pytest.mark.slow),
        pytest.param(LongShortForTokenClassification, {}, marks=pytest.mark.slow),
        pytest.param(LongShortForQuestionAnswering, {}, marks=pytest.mark.slow),
        pytest.param(LongShortForMultipleChoice, {}, marks=pytest.mark.slow),
    ],
    ids=lambda value: value.__name__.removeprefix("LongShortFor") if isinstance(value, type) else "",
)
def test_exported_program_matches_eager(model_class, overrides):
    """``torch.export`` of every head (the causal LM's forward without a cache), at shapes other than the export's,
    with padding and global tokens: the program's output is the model's."""
    model = tiny(model_class, **overrides)
    program = export_program(model)
    for seed, (batch, length) in enumerate(SHAPES):
        inputs = inputs_at(model, batch, length, seed)
        with torch.no_grad():
            expected, got = first(model(**inputs)), first(program.module()(**inputs))
        assert_matches(got.numpy(), expected.numpy())


@pytest.mark.parametrize(
    "model_class",
    [LongShortForSequenceClassification, pytest.param(LongShortForCausalLM, marks=pytest.mark.slow)],
)
def test_onnx_runtime_matches_pytorch(model_class, tmp_path):
    """``export_onnx``, then ONNX Runtime on the CPU at three other shapes (batch 1-4; lengths below w, not a multiple
    of w, and above 2,048), with padding and global tokens: PyTorch's output to 1e-4 of its magnitude."""
    model = tiny(model_class, is_decoder=model_class is LongShortForCausalLM)
    path = export_onnx(model, tmp_path / "model.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [node.name for node in session.get_inputs()]
    assert names == (["input_ids", "attention_mask"] + ([] if model.config.is_decoder else ["global_attention_mask"]))
    for seed, (batch, length) in enumerate(SHAPES):
        inputs = inputs_at(model, batch, length, seed)
        with torch.no_grad():
            expected = first(model(**inputs)).numpy()
        got = session.run(None, {name: inputs[name].numpy() for name in names})[0]
        assert_matches(got, expected)


def test_exported_graph_serves_max_global_tokens():
    """An exported graph cannot read the global tokens' count: it serves ``config.max_global_tokens`` of a sample (4
    here), and later ones attend as ordinary tokens, as in eager with the mask cut to the first 4."""
    model = tiny(LongShortModel)
    program = export_program(model)
    inputs = inputs_at(model, 2, 40, seed=0)
    inputs["global_attention_mask"][0, 10:16] = 1  # 1 + 6 + 1 global tokens in row 0
    kept = inputs["global_attention_mask"].clone()
    kept[0] = kept[0] * (kept[0].cumsum(0) <= 4)
    with torch.no_grad():
        got = program.module()(**inputs)[0]
        expected = model(**{**inputs, "global_attention_mask": kept})[0]
        full = model(**inputs)[0]
    assert_matches(got.numpy(), expected.numpy())
    assert not torch.allclose(got, full, atol=1e-3)  # eager serves all of them


def test_what_does_not_export_is_refused(tmp_path):
    """Attention maps do not export; the path must name an .onnx file; nothing is written on refusal."""
    model = tiny(LongShortForSequenceClassification)
    with pytest.raises(ValueError, match="length must be between 2 and"):
        export_inputs(model, length=5000)
    with pytest.raises(ValueError, match=r"an \.onnx file"):
        export_onnx(model, tmp_path / "model.bin")
    model.set_attn_implementation("eager")  # Transformers allows config.output_attentions only there
    model.config.output_attentions = True
    with pytest.raises(ValueError, match="output_attentions=True does not export"):
        export_onnx(model, tmp_path / "model.onnx")
    assert not any(tmp_path.iterdir())


@pytest.mark.compiled
def test_compile_fullgraph_runs_the_default_cpu_path():
    """``torch.compile(model, fullgraph=True)`` of a classifier on the default CPU path, with padding and global tokens,
    compiles without a graph break (nothing is read back from the device) and gives the eager output."""
    model = tiny(LongShortForSequenceClassification)
    compiled = torch.compile(model, fullgraph=True)
    inputs = inputs_at(model, 2, 67, seed=0)
    with torch.no_grad():
        expected = model(**inputs).logits
        got = compiled(**inputs).logits
    assert_matches(got.numpy(), expected.numpy())


@pytest.mark.parametrize(
    "name, kwargs",
    [
        pytest.param("cvt_ls_13", {"depths": (1, 1, 1)}, id="cvt"),
        pytest.param("vil_ls_small", {"depths": (1, 1, 1, 1), "img_size": 64}, id="vil", marks=pytest.mark.slow),
    ],
)
def test_timm_entries_export_with_a_dynamic_batch(name, kwargs, tmp_path):
    """timm's own export (``timm.utils.onnx.onnx_export(use_dynamo=True)``) of a reduced ``cvt_ls_13`` and
    ``vil_ls_small`` at 64 x 64, then ONNX Runtime at batch sizes 1 and 3, and ``torch.export`` with a dynamic batch:
    the logits are PyTorch's."""
    from timm.utils.onnx import onnx_export

    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=7, **kwargs).eval()
    path = tmp_path / f"{name}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onnx_export(model, str(path), input_size=(3, 64, 64), batch_size=2, use_dynamo=True)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(model, (torch.randn(2, 3, 64, 64),), dynamic_shapes=({0: batch},))
    for size in (1, 3):
        x = torch.randn(size, 3, 64, 64, generator=torch.Generator().manual_seed(size))
        with torch.no_grad():
            expected = model(x)
            exported = program.module()(x)
        got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
        assert_matches(got, expected.numpy())
        assert_matches(exported.numpy(), expected.numpy())

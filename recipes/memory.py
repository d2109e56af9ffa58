"""The memory a training step adds to a loaded model, estimated before training, and the check every training recipe
runs with it.

The estimate is linear in what a step holds at its peak (the backward pass, from the second step on, when AdamW's
moments exist); its ``Coefficients`` are fitted to the peak resident memory (RSS) of real training steps on the CPU
in float32 (``recipes/memory_calibration.py``; ``bench/RESULTS.md``, "Training memory"):

* a fixed amount that any first training step adds (the training loop's and the libraries' buffers);
* per parameter, its float32 gradient and AdamW's two moments (the weights are loaded already);
* per token and attention layer, bytes proportional to the width d: what the layer keeps for its backward pass
  (inputs of its projections, the feed-forward's inner activations, LayerNorm statistics, dropout masks) and the
  backward pass's own temporaries; fewer on the memory-lean path (``recompute_window_tiles``);
* with active attention dropout the attention probabilities are materialised: bytes per token, head and key on top
  (S keys per query: w + 2e + r bidirectionally, Sec. 3.2; causally w + r n / l, the rows of every segment, Eq. 5,
  which fits the measured causal steps better than the r n / (2l) a query sees on average);
* with gradient checkpointing every layer keeps bytes per token and unit of width, and one layer at a time holds
  its activations again;
* a language-model head, bytes per token and vocabulary entry (the logits, their log-softmax and its gradient).

Under bfloat16 autocast (``--bf16``; ``--fp16`` is counted the same) a share of the activation and logit bytes remains,
fitted to bfloat16 steps on the CPU. CUDA, whose attention takes other kernels, is counted as the CPU: an
extrapolation, not measured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch


@dataclass(frozen=True)
class Coefficients:
    """Bytes per unit of what a training step holds (see the module docstring)."""

    fixed: float  # per step
    parameter: float  # per parameter
    width: float  # per token, layer and unit of width d, default path
    tile: float  # per token, layer, unit of width and key per query of a window segment (S / w): the gathered tiles
    width_lean: float  # per token, layer and unit of width on the memory-lean path (which keeps no tiles)
    intermediate: float  # per token, layer and unit of the feed-forward's inner width
    dropout: float  # per token, layer and unit of width, with hidden dropout (its masks and outputs)
    probability: float  # per token, layer, head and key when the probabilities are materialised
    checkpoint: float  # per token, layer and unit of width kept under gradient checkpointing
    logit: float  # per token and vocabulary entry of a language-model head
    half: float  # share of those activation and logit bytes left under bfloat16 or float16 autocast


# Fitted to recipes/memory_calibration_cpu.json (python -m recipes.memory_calibration --fit), rounded; see
# bench/RESULTS.md, "Training memory", for how close the estimate comes to each measured step.
CALIBRATED = Coefficients(
    fixed=74 * 2**20,
    parameter=12,
    width=63,
    tile=20,
    width_lean=76,
    intermediate=12.5,
    dropout=68,
    probability=14,
    checkpoint=50,
    logit=12,
    half=0.72,
)


@dataclass(frozen=True)
class AttentionLayer:
    """One block as the estimate sees it: the tokens of an example it reads, width d, feed-forward inner width, heads
    H, keys per query S, window w (the queries that share a tile of keys: w, or w x w on an image), whether it has
    hidden dropout, whether its attention probabilities are materialised (active attention dropout) and whether it
    runs the memory-lean path."""

    tokens: int
    width: int
    intermediate: int
    heads: int
    keys: float
    window: int
    dropout: bool = False
    probabilities: bool = False
    lean: bool = False

    def example_bytes(self, c: Coefficients) -> float:
        """Bytes one example adds to this layer's share of the peak."""
        per_width = c.width_lean if self.lean else c.width + c.tile * self.keys / max(self.window, 1)
        per_width += c.dropout if self.dropout else 0
        probabilities = c.probability * self.heads * self.keys if self.probabilities else 0
        return self.tokens * (per_width * self.width + c.intermediate * self.intermediate + probabilities)


@dataclass(frozen=True)
class TrainingStep:
    """What a training step's memory depends on: the model (its parameters, its attention layers, and the vocabulary
    of a language-model head over ``head_tokens`` tokens of an example; 0 for a classifier) and the run (examples a
    step, gradient checkpointing, half precision)."""

    parameters: int
    layers: tuple[AttentionLayer, ...]
    examples: int
    vocab: int = 0
    head_tokens: int = 0
    checkpointing: bool = False
    half_precision: bool = False

    def activation_bytes(self, c: Coefficients = CALIBRATED) -> float:
        per_example = [layer.example_bytes(c) for layer in self.layers]
        if self.checkpointing:
            held = sum(c.checkpoint * layer.tokens * layer.width for layer in self.layers) + max(per_example)
        else:
            held = sum(per_example)
        logits = c.logit * self.head_tokens * self.vocab
        return self.examples * (held + logits) * (c.half if self.half_precision else 1)

    def bytes(self, c: Coefficients = CALIBRATED) -> float:
        """The memory the step adds to the loaded model, at its peak."""
        return c.fixed + c.parameter * self.parameters + self.activation_bytes(c)


def long_short_layers(config, seq_length: int, *, lean: bool = False) -> tuple[AttentionLayer, ...]:
    """The attention layers of a ``LongShortConfig`` or ``LongShortXLConfig`` model training on ``seq_length``
    tokens; ``lean``: on the memory-lean path (``recompute_window_tiles`` with no attention dropout)."""
    count = config.num_hidden_layers
    windows, ranks = (
        [value] * count if isinstance(value, int) else value for value in (config.window_size, config.projection_rank)
    )
    probabilities = not lean and config.attention_probs_dropout_prob > 0
    layers = []
    for w, r in zip(windows, ranks):
        if config.is_decoder:  # w window keys and r rows of each of the n / l segments (Eq. 5), the form that fits
            rows = seq_length + getattr(config, "memory_length", 0)  # the measured causal steps best
            keys = w + r * rows / config.causal_segment_length
        else:
            keys = w + 2 * max(w // 2, 1) + r
        layers.append(
            AttentionLayer(
                seq_length,
                config.hidden_size,
                config.intermediate_size,
                config.num_attention_heads,
                keys,
                w,
                config.hidden_dropout_prob > 0,
                probabilities,
                lean,
            )
        )
    return tuple(layers)


def available_bytes(device: torch.device) -> int:
    """Memory a new allocation can have on ``device``: free CUDA memory, else the system's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _fitting_batch(step: Callable[..., TrainingStep], settings: dict, available: float) -> dict:
    """``settings`` with the largest batch size up to theirs whose step fits ``available`` (1 if none does); the
    estimate grows linearly with the batch."""
    one, two = (step(**{**settings, "batch_size": size}).bytes() for size in (1, 2))
    size = int((available - one) // (two - one)) + 1
    return {**settings, "batch_size": max(1, min(settings["batch_size"], size))}


def check_memory(
    step: Callable[..., TrainingStep],
    settings: dict,
    device: torch.device,
    fixes: dict[str, str],
    error: Callable[[str], BaseException] = ValueError,
    note: str = "",
) -> None:
    """Raise ``error(message)`` before any work when the training step ``step(**settings)`` needs more memory than
    ``device`` has available, with the estimates under the recipe's ``fixes``: each alone, and all together when
    none is enough alone.

    ``settings`` holds ``batch_size``, ``checkpointing`` and ``lean`` (the memory-lean path of
    ``recompute_window_tiles``); ``fixes`` maps those the recipe offers to its arguments, e.g.
    ``{"checkpointing": "--gradient_checkpointing", "lean": "--recompute_window_tiles", "batch_size":
    "--per_device_train_batch_size"}`` (the lean path is a CPU path: not offered on CUDA); ``note`` ends the
    message."""
    available, first = available_bytes(device), step(**settings)
    if device.type not in ("cpu", "cuda") or first.bytes() <= available:
        return
    switches = [
        name
        for name in ("checkpointing", "lean")
        if name in fixes and not settings[name] and (name != "lean" or device.type == "cpu")
    ]
    options = [([fixes[name]], {**settings, name: True}) for name in switches]
    if "batch_size" in fixes and settings["batch_size"] > 1:
        smaller = _fitting_batch(step, {**settings, "batch_size": settings["batch_size"] - 1}, available)
        options.append(([f"{fixes['batch_size']} {smaller['batch_size']}"], smaller))
    if len(options) > 1 and all(step(**changed).bytes() > available for _, changed in options):
        together = _fitting_batch(step, {**settings, **dict.fromkeys(switches, True)}, available)
        size = [f"{fixes['batch_size']} {together['batch_size']}"] if "batch_size" in fixes else []
        options.append(([fixes[name] for name in switches] + size, together))
    estimates = "; ".join(
        f"{' '.join(labels)}: about {_gib(step(**changed).bytes())}"
        + ("" if step(**changed).bytes() <= available else " (too much still)")
        for labels, changed in options
    )
    raise error(
        f"a training step needs about {_gib(first.bytes())} ({_gib(first.activation_bytes())} of activations for "
        f"{first.examples:,} examples of {first.layers[0].tokens:,} tokens through {len(first.layers)} layers of width "
        f"{first.layers[0].width}), but "
        f"the {device.type} has {_gib(available)} available. Estimates with {estimates or 'no option of the recipe'}"
        f"; shorter sequences or a smaller model need less too.{note}"
    )

"""The paper's LRA model (Appendix B; the official ``lra/model.py`` and ``lra/model_wrapper.py``).

Pre-LN blocks ``X + Attn(LN(X))`` then ``X + FFN(LN(X))`` (FFN: Linear, GELU, Linear), learned word and position
embeddings (normal, std 0.02), and a CLS embedding (zeros) that joins only the last layer as a global token: it is
a key/value of every query and attends to the other tokens' outputs (``cls_hidden`` of ``LongShortSelfAttention``,
the official "post-CLS"). The classifier reads the final LayerNorm of the CLS output through Linear, ReLU, Linear;
Retrieval's dual tower encodes both documents with one encoder and classifies ``[x0, x1, x0 * x1, x0 - x1]``.
Parameter names and initialisation follow the official model (``tests/test_lra.py`` loads its weights).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from ls_hf.long_short_attention import LongShortSelfAttention, masked_sdpa, validate_long_short_args
from recipes.memory import AttentionLayer

ATTENTIONS = ("long_short", "full", "window", "projection")


@dataclass
class LRAConfig:
    """Appendix B's model: 2 layers, width 64, 2 heads, FFN 128. ``attention`` picks Long-Short (w, r), dense
    softmax attention (``full``), the window alone (r = 0) or the dynamic projection alone (w = 0)."""

    vocab_size: int
    max_length: int
    num_classes: int
    attention: str = "long_short"
    window_size: int = 8
    projection_rank: int = 32
    hidden_size: int = 64
    num_heads: int = 2
    intermediate_size: int = 128
    num_layers: int = 2
    dropout: float = 0.0
    attention_dropout: float = 0.0
    dual: bool = False
    recompute_window_tiles: bool = False  # memory, not function: LongShortSelfAttention's, in training on CPU

    def __post_init__(self):
        if self.attention not in ATTENTIONS:
            raise ValueError(f"--attention must be one of {ATTENTIONS}, got {self.attention!r}.")
        for name in ("vocab_size", "max_length", "num_classes", "intermediate_size", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name} must be an integer >= 1, got {value!r}.")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"--dropout is a probability, 0 <= p < 1; got {self.dropout!r}.")
        validate_long_short_args(
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            window_size=self.window,
            projection_rank=self.rank,
            attention_dropout=self.attention_dropout,
            names={
                "window_size": "--window_size",
                "projection_rank": "--projection_rank",
                "hidden_size": "--hidden_size",
                "num_heads": "--num_heads",
                "attention_dropout": "--attention_dropout",
            },
        )

    @property
    def window(self) -> int:
        """w as used: 0 for the projection alone (and unused by full attention)."""
        return 0 if self.attention == "projection" else self.window_size

    @property
    def rank(self) -> int:
        """r as used: 0 for the window alone (and unused by full attention)."""
        return 0 if self.attention in ("window", "full") else self.projection_rank

    def to_dict(self) -> dict:
        return asdict(self)

    def attention_layers(self, seq_length: int, lean: bool = False) -> tuple[AttentionLayer, ...]:
        """The layers as ``recipes.memory`` estimates them, training on ``seq_length`` tokens (the CLS a key more);
        ``lean``: on the memory-lean path (``recompute_window_tiles``; Long-Short attention only)."""
        if self.attention == "full":  # every query sees every key: one tile
            keys, window, lean = seq_length + 1, seq_length + 1, False
        else:
            keys, window = self.window + 2 * max(self.window // 2, 1) + self.rank + 1, self.window
        probabilities = not lean and self.attention_dropout > 0
        layer = AttentionLayer(
            seq_length,
            self.hidden_size,
            self.intermediate_size,
            self.num_heads,
            keys,
            window,
            self.dropout > 0,
            probabilities,
            lean,
        )
        return (layer,) * self.num_layers


class DenseSelfAttention(nn.Module):
    """Full softmax attention (the "Full Attention" row of Table 1) with ``LongShortSelfAttention``'s interface:
    in the last layer the CLS joins the sequence as one more token that every query sees and that sees all."""

    def __init__(self, hidden_size: int, num_heads: int, attention_dropout: float = 0.0):
        super().__init__()
        self.num_heads = num_heads
        self.attention_dropout = attention_dropout
        self.query, self.key, self.value, self.output = (nn.Linear(hidden_size, hidden_size) for _ in range(4))

    def forward(self, hidden_states: Tensor, attention_mask: Tensor, *, cls_hidden: Tensor | None = None):
        x, valid = hidden_states, attention_mask.bool()
        if cls_hidden is not None:
            x = torch.cat([cls_hidden, x], 1)
            valid = torch.cat([valid.new_ones(valid.shape[0], 1), valid], 1)
        q, k, v = (
            proj(x).unflatten(-1, (self.num_heads, -1)).transpose(1, 2) for proj in (self.query, self.key, self.value)
        )
        dropout = self.attention_dropout if self.training else 0.0
        context = masked_sdpa(q, k, v, valid[:, None, None, :], dropout_p=dropout)
        context = context.transpose(1, 2).flatten(2) * valid[:, :, None].to(context.dtype)  # padded rows: bias only
        return self.output(context), None


class Block(nn.Module):
    """``X + Attn(LN_1(X))``, then ``X + FFN(LN_2(X))``; with a CLS, ``[cls; X]`` is the residual of the attention."""

    def __init__(self, config: LRAConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size)
        if config.attention == "full":
            self.attention = DenseSelfAttention(config.hidden_size, config.num_heads, config.attention_dropout)
        else:
            self.attention = LongShortSelfAttention(
                config.hidden_size,
                config.num_heads,
                config.window,
                config.rank,
                attention_dropout=config.attention_dropout,
                recompute_window_tiles=config.recompute_window_tiles,
            )
        self.dropout1 = nn.Dropout(config.dropout)
        self.norm2 = nn.LayerNorm(config.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(config.hidden_size, config.intermediate_size),
            nn.GELU(),
            nn.Dropout(config.dropout),
            nn.Linear(config.intermediate_size, config.hidden_size),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: Tensor, mask: Tensor, cls: Tensor | None = None) -> Tensor:
        out, _ = self.attention(self.norm1(x), mask, cls_hidden=cls)  # the official code passes the CLS un-normed
        x = self.dropout1(out) + (x if cls is None else torch.cat([cls, x], 1))
        return self.mlp(self.norm2(x)) + x


class LRAEncoder(nn.Module):
    """Embeddings, the blocks (the CLS joins the last), the final LayerNorm of the CLS output: (B, d)."""

    def __init__(self, config: LRAConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_length, config.hidden_size)
        nn.init.normal_(self.word_embeddings.weight, std=0.02)
        nn.init.normal_(self.position_embeddings.weight, std=0.02)
        self.dropout = nn.Dropout(config.dropout)
        self.cls_embed = nn.Parameter(torch.zeros(1, 1, config.hidden_size))
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.hidden_size)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        n = input_ids.shape[1]
        if n > self.position_embeddings.num_embeddings:
            raise ValueError(
                f"input of {n} tokens is longer than max_length ({self.position_embeddings.num_embeddings})"
            )
        x = self.dropout(self.word_embeddings(input_ids) + self.position_embeddings.weight[:n])
        for layer in self.layers[:-1]:
            x = layer(x, attention_mask)
        cls = self.cls_embed.expand(x.shape[0], -1, -1).to(x.dtype)
        return self.norm(self.layers[-1](x, attention_mask, cls)[:, 0])


class LRAClassifier(nn.Module):
    """Encoder and head (Linear d -> FFN width, ReLU, Linear -> classes); ``dual``: one encoder for both documents,
    the head reads ``[x0, x1, x0 * x1, x0 - x1]``. ``forward`` takes lists of ids and masks (one or two) and returns
    the logits."""

    def __init__(self, config: LRAConfig):
        super().__init__()
        self.config = config
        self.encoder = LRAEncoder(config)
        width = config.hidden_size * (4 if config.dual else 1)
        self.head = nn.Sequential(
            nn.Linear(width, config.intermediate_size),
            nn.ReLU(),
            nn.Linear(config.intermediate_size, config.num_classes),
        )

    def forward(self, input_ids: list[Tensor], attention_mask: list[Tensor]) -> Tensor:
        pooled = [self.encoder(ids, mask) for ids, mask in zip(input_ids, attention_mask)]
        if self.config.dual:
            x0, x1 = pooled
            return self.head(torch.cat([x0, x1, x0 * x1, x0 - x1], -1))
        return self.head(pooled[0])


# Official ``lra/model.py`` / ``model_wrapper.py`` state-dict names -> ours (``transformer_{i}`` blocks).
OFFICIAL_NAMES = {
    "mha.W_q": "attention.query",
    "mha.W_k": "attention.key",
    "mha.W_v": "attention.value",
    "mha.W_o": "attention.output",
    "mha.dconv_fc": "attention.dynamic_projection",
    "mha.dual_ln_l": "attention.dual_ln_local",
    "mha.dual_ln_s": "attention.dual_ln_global",
    "mlpblock": "mlp",
}


def from_official(model_state: dict, head_state: dict) -> dict:
    """Our ``LRAClassifier`` state dict from an official ``Model`` and ``SCHead`` (or ``SCHeadDual``) state dict; the
    zero-sized ``dconv_fc`` of r = 0 is dropped."""
    state = {}
    for key, value in model_state.items():
        if not value.numel():
            continue
        if key.startswith("transformer_"):
            index, rest = key[len("transformer_") :].split(".", 1)
            for official, ours in OFFICIAL_NAMES.items():
                if rest.startswith(official + "."):
                    rest = ours + rest[len(official) :]
            key = f"layers.{index}.{rest}"
        state[f"encoder.{key.removeprefix('embeddings.')}"] = value
    state.update({f"head.{key.removeprefix('mlpblock.')}": value for key, value in head_state.items()})
    return state

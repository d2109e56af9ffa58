# Copyright 2026 The transformer-ls authors. Licensed under the MIT License.
"""LongShort configuration: RoBERTa's fields plus the Long-Short attention ones (Zhu et al., 2021)."""

from dataclasses import fields

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from .long_short_attention import validate_long_short_args

__all__ = ["LongShortConfig"]


@strict
class LongShortConfig(PreTrainedConfig):
    r"""Configuration of a LongShort model: a RoBERTa encoder whose self-attention is Long-Short attention.

    The RoBERTa fields keep RoBERTa's names and meaning, so a RoBERTa config maps onto this one field by field
    (``modeling_long_short.ROBERTA_KEY_MAPPING`` renames the weights). The defaults are roberta-base's checkpoint
    (``type_vocab_size=1``, ``layer_norm_eps=1e-5``) with 4096 positions (``max_position_embeddings=4098``:
    RoBERTa's positions start at ``pad_token_id + 1``).

    Long-Short fields (paper Sec. 3, Appendix D):
        window_size (`int` or `list[int]`, defaults to 256): segment length w of the sliding window; a query sees
            its segment plus ``max(w // 2, 1)`` keys on each side (``long_short_rules.window_extent``): span 2w for
            an even w, w + 2 (w // 2) = 2w - 1 for an odd w >= 3, and 3 for w = 1. Causally it sees the w keys left
            of its segment and its segment's past (w >= 1). w = 0, bidirectional only, turns the window off: the
            projection only, each query sees the r projected rows (and the global tokens), so r must be >= 1. One
            value for every layer or a list with one per layer.
        projection_rank (`int` or `list[int]`, defaults to 64): rows r of the dynamic projection (Eq. 3) per head;
            0 turns the long-range branch off. Int or per-layer list.
        causal_segment_length (`int`, defaults to 16): causal models only: the projection compresses each segment
            of l tokens on its own (Eq. 5), ``1 <= l <= w``. Causal models want a small r (the official enwik8
            models use l=16, r=1).
        use_dual_ln (`bool`, defaults to True): DualLN (Eq. 7); False is the paper's ablation and what a RoBERTa
            conversion reproduces exactly.
        qk_head_dim (`int`, *optional*): LMSA: a query/key head dim smaller than the value head dim
            ``hidden_size / num_attention_heads``.
        global_projections (`bool`, defaults to False): separate query/key/value projections for the global tokens'
            own attention (``global_attention_mask``), as Longformer's ``query_global``/``key_global``/
            ``value_global``; a Longformer conversion sets it. Bidirectional models only.
        recompute_window_tiles (`bool`, defaults to False): in training on CPU, keep for the backward pass about what
            fused dense attention keeps: the window tiles are built chunk by chunk and again in the backward pass,
            ``LN_L`` keeps its output only, and the projection's scores and P are built a head at a time and again in
            the backward pass (attention peak 1.03-1.07x fused SDPA's in tensors instead of 2.1x; slower with several
            threads on a busy CPU; see ``bench/RESULTS.md``). On CUDA, where the attention layer is compiled, its
            backward pass computes P again instead of keeping it (the keys' and values' Linear outputs are not kept
            there by default: ``LN_L`` recovers its input from its output); on an H200 that left the peak unchanged.
        compile_attention (`bool`, defaults to True): on CUDA, where attention runs one FlexAttention kernel per layer,
            compile the rest of each attention layer around it (projections, DualLN, the dynamic projection), once per
            process for all layers; False compiles the kernel alone.
        sep_token_id (`int`, *optional*, defaults to 2): the separator token; question answering makes the tokens
            before the first one (the question) global, as Longformer does.
        max_global_tokens (`int`, defaults to 64): the most global tokens of a sample that a traced graph
            (``torch.export``, ONNX, ``torch.compile``) serves, which cannot read their count from the device; later
            ones attend as ordinary tokens there. Eager calls count them and serve any number.

    The model is causal when ``is_decoder=True`` (RoBERTa's convention); ``LongShortForCausalLM`` requires it.
    Invalid values raise a ``ValueError`` naming the field, at construction and when a model is built.
    """

    model_type = "long_short"

    vocab_size: int = 50265
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float | int = 0.1
    attention_probs_dropout_prob: float | int = 0.1
    max_position_embeddings: int = 4098
    type_vocab_size: int = 1
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-5
    pad_token_id: int | None = 1
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 2
    use_cache: bool = True
    classifier_dropout: float | int | None = None
    is_decoder: bool = False
    tie_word_embeddings: bool = True
    window_size: int | list[int] = 256
    projection_rank: int | list[int] = 64
    causal_segment_length: int = 16
    use_dual_ln: bool = True
    qk_head_dim: int | None = None
    global_projections: bool = False
    recompute_window_tiles: bool = False
    compile_attention: bool = True
    sep_token_id: int | None = 2
    max_global_tokens: int = 64

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.check_long_short()

    @classmethod
    def from_roberta(cls, roberta_config, **long_short_fields) -> "LongShortConfig":
        """A LongShort config with ``roberta_config``'s values for every RoBERTa field and its labels
        (``id2label``, ``label2id``, ``problem_type``), overridden by ``long_short_fields``."""
        names = {f.name for f in fields(cls)} - {f.name for f in fields(PreTrainedConfig)}
        names |= {"id2label", "label2id", "problem_type"}
        shared = {name: getattr(roberta_config, name) for name in names if hasattr(roberta_config, name)}
        return cls(**{**shared, **long_short_fields})

    def layer_value(self, name: str, layer_idx: int) -> int:
        """``window_size`` or ``projection_rank`` of layer ``layer_idx`` (the field may be an int or a list)."""
        value = getattr(self, name)
        return value[layer_idx] if isinstance(value, list) else value

    def attention_kwargs(self, layer_idx: int) -> dict:
        """Keyword arguments of ``LongShortSelfAttention`` for layer ``layer_idx``."""
        return {
            "hidden_size": self.hidden_size,
            "num_heads": self.num_attention_heads,
            "window_size": self.layer_value("window_size", layer_idx),
            "projection_rank": self.layer_value("projection_rank", layer_idx),
            "causal": self.is_decoder,
            "segment_length": self.causal_segment_length if self.is_decoder else None,
            "use_dual_ln": self.use_dual_ln,
            "qk_head_dim": self.qk_head_dim,
            "attention_dropout": self.attention_probs_dropout_prob,
            "layer_norm_eps": self.layer_norm_eps,
            "global_projections": self.global_projections,
            "recompute_window_tiles": self.recompute_window_tiles,
            "compile_attention": self.compile_attention,
            "attn_implementation": self._attn_implementation or "sdpa",
        }

    def check_long_short(self) -> None:
        """Raise ``ValueError`` naming the field if the Long-Short settings cannot build a model."""
        for name in ("window_size", "projection_rank"):
            value = getattr(self, name)
            if isinstance(value, list) and len(value) != self.num_hidden_layers:
                raise ValueError(
                    f"{name} has {len(value)} entries but num_hidden_layers={self.num_hidden_layers}; give one value "
                    f"per layer or a single int."
                )
        if self.pad_token_id is None or self.pad_token_id < 0:
            raise ValueError(
                f"pad_token_id must be a token id >= 0 (RoBERTa-style positions start at pad_token_id + 1), "
                f"got {self.pad_token_id!r}."
            )
        if self.max_position_embeddings <= self.pad_token_id + 1:
            raise ValueError(
                f"max_position_embeddings ({self.max_position_embeddings}) must exceed pad_token_id + 1 "
                f"({self.pad_token_id + 1}): positions start after the padding index. Use tokens + pad_token_id + 1."
            )
        if (
            isinstance(self.max_global_tokens, bool)
            or not isinstance(self.max_global_tokens, int)
            or (self.max_global_tokens < 1)
        ):
            raise ValueError(
                f"max_global_tokens must be an integer >= 1 (the global tokens a traced graph serves per sample), "
                f"got {self.max_global_tokens!r}."
            )
        if self.global_projections and self.is_decoder:
            raise ValueError(
                "global_projections=True serves global tokens, which causal models (is_decoder=True) do not have; "
                "set global_projections=False or is_decoder=False."
            )
        for layer_idx in range(self.num_hidden_layers):
            per_layer = {
                key: f"{key}[{layer_idx}]"
                for key in ("window_size", "projection_rank")
                if isinstance(getattr(self, key), list)
            }
            kwargs = self.attention_kwargs(layer_idx)
            validate_long_short_args(
                **{key: kwargs[key] for key in ("hidden_size", "num_heads", "window_size", "projection_rank")},
                causal=kwargs["causal"],
                segment_length=kwargs["segment_length"],
                qk_head_dim=kwargs["qk_head_dim"],
                attention_dropout=kwargs["attention_dropout"],
                names={
                    "num_heads": "num_attention_heads",
                    "segment_length": "causal_segment_length",
                    "attention_dropout": "attention_probs_dropout_prob",
                    "window_size": per_layer.get("window_size", "window_size"),
                    "projection_rank": per_layer.get("projection_rank", "projection_rank"),
                },
            )

    @property
    def max_input_length(self) -> int:
        """Longest input the position table allows: ``max_position_embeddings - pad_token_id - 1`` tokens."""
        return self.max_position_embeddings - self.pad_token_id - 1

# Copyright 2026 The transformer-ls authors. Licensed under the MIT License.
"""LongShort models for Transformers: a RoBERTa encoder whose self-attention is Long-Short attention.

Zhu et al., "Long-Short Transformer", NeurIPS 2021. The attention math lives in ``long_short_attention.py``;
this file is the Transformers glue: embeddings, layers, heads, the decoding cache, generation.

Module names mirror RoBERTa's, so a RoBERTa checkpoint loads with the short rename table
``ROBERTA_KEY_MAPPING`` (``from_pretrained(..., key_mapping=ROBERTA_KEY_MAPPING)``). The one structural
difference: the attention core owns its query/key/value/output projections, so RoBERTa's
``attention.self.{query,key,value}`` land on it unchanged and ``attention.output.dense`` becomes
``attention.self.output``. A converted RoBERTa with ``use_dual_ln=False``, ``projection_rank=0`` and a window
covering the input computes RoBERTa's function.

Causal models (``config.is_decoder=True``) decode with ``LongShortCache`` (``cache_long_short``). This file only uses single-dot relative imports: it is copied as-is into saved folders as Hub remote code.
"""

import math
from typing import ClassVar

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN, gelu
from transformers.loss.loss_utils import fixed_cross_entropy
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPoolingAndCrossAttentions,
    CausalLMOutputWithPast,
    MaskedLMOutput,
    MultipleChoiceModelOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.utils.generic import can_return_tuple, merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .cache_long_short import CACHE_NAME, LongShortCache, decoding_cache, prepare_own_cache
from .configuration_long_short import LongShortConfig
from .long_short_attention import CausalState, LongShortSelfAttention
from .long_short_plan import AttentionPlan, first_token_global, plan_attention, question_global_mask

# RoBERTa checkpoint key -> LongShort key (regex -> replacement, for `from_pretrained(key_mapping=...)`). Every other
# RoBERTa key keeps its name; the LongShort-only parameters (dynamic_projection, dual_ln_*) are new.
ROBERTA_KEY_MAPPING = {
    r"^roberta\.": "long_short.",
    r"\.attention\.output\.dense\.": ".attention.self.output.",
}


def roberta_position_ids(
    padding_idx: int, *, input_ids=None, inputs_embeds=None, attention_mask=None, past_length: int = 0
) -> torch.Tensor:
    """RoBERTa positions of the n new tokens (B, n), the one rule of the plain forward, the cached step and generate.

    The k-th real token (k >= 1, counting earlier ones) gets ``padding_idx + k``, padding gets ``padding_idx``. Real
    tokens are those ``attention_mask`` marks ((B, n), or (B, past + n) covering the cached tokens too); without a
    mask, those of ``input_ids`` that are not ``padding_idx``; for ``inputs_embeds`` without a mask, all. The
    ``past_length`` cached tokens that the mask does not cover count as real."""
    new = input_ids if input_ids is not None else inputs_embeds[..., 0]
    n = new.shape[1]
    if attention_mask is not None:
        real = attention_mask.to(device=new.device) > 0
    elif input_ids is not None:
        real = input_ids.ne(padding_idx)
    else:
        real = torch.ones(new.shape[:2], dtype=torch.bool, device=new.device)
    earlier = past_length - (real.shape[1] - n)  # cached tokens before the first column of `real`
    real = real.long()
    return ((real.cumsum(1) + earlier) * real + padding_idx)[:, -n:]


def require_bidirectional(model_class: type, config: LongShortConfig, reason: str) -> None:
    """Raise ``ValueError`` if ``config`` is causal; ``reason`` says why ``model_class`` needs bidirectional
    attention."""
    if config.is_decoder:
        raise ValueError(
            f"{model_class.__name__} {reason}, so it needs bidirectional attention, but the config has "
            f"is_decoder=True. Load it with is_decoder=False (e.g. from_pretrained(path, is_decoder=False)); the "
            f"weights are the same."
        )


class LongShortEmbeddings(nn.Module):
    """Word + RoBERTa-style position + token type embeddings, then LayerNorm and dropout."""

    def __init__(self, config: LongShortConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(
            config.max_position_embeddings, config.hidden_size, padding_idx=config.pad_token_id
        )
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(
        self,
        position_ids: torch.LongTensor,
        input_ids: torch.LongTensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
    ) -> torch.Tensor:
        """position_ids / input_ids / token_type_ids (B, n), or inputs_embeds (B, n, d) -> (B, n, d)."""
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros(inputs_embeds.shape[:2], dtype=torch.long, device=inputs_embeds.device)
        embeddings = inputs_embeds + self.token_type_embeddings(token_type_ids) + self.position_embeddings(position_ids)
        return self.dropout(self.LayerNorm(embeddings))


class LongShortSelfOutput(nn.Module):
    """RoBERTa's ``attention.output`` without its dense layer (that is the core's ``output`` projection)."""

    def __init__(self, config: LongShortConfig):
        super().__init__()
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(hidden_states) + input_tensor)


class LongShortAttention(nn.Module):
    """Long-Short self-attention (``self``, paper Eq. 3-7) followed by dropout, residual and LayerNorm."""

    def __init__(self, config: LongShortConfig, layer_idx: int):
        super().__init__()
        self.self = LongShortSelfAttention(**config.attention_kwargs(layer_idx))
        self.output = LongShortSelfOutput(config)

    def forward(
        self, hidden_states: torch.Tensor, *, plan: AttentionPlan, state: CausalState | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``plan``: the model's attention plan of this forward pass (``plan_attention``)."""
        context, attentions = self.self(hidden_states, plan=plan, state=state)
        return self.output(hidden_states=context, input_tensor=hidden_states), attentions


class LongShortIntermediate(nn.Module):
    def __init__(self, config: LongShortConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.intermediate_act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.intermediate_act_fn(self.dense(hidden_states))


class LongShortOutput(nn.Module):
    def __init__(self, config: LongShortConfig):
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + input_tensor)


class LongShortLayer(GradientCheckpointingLayer):
    """A post-LN RoBERTa layer with Long-Short attention: (B, n, d) -> (B, n, d)."""

    def __init__(self, config: LongShortConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.attention = LongShortAttention(config, layer_idx)
        self.intermediate = LongShortIntermediate(config)
        self.output = LongShortOutput(config)

    def forward(self, hidden_states: torch.Tensor, *, plan: AttentionPlan, **kwargs) -> torch.Tensor:
        cache = kwargs.get(CACHE_NAME)  # by that name, so that gradient checkpointing can drop it
        state = cache.layers[self.layer_idx].state if cache is not None else None
        attention_output, _ = self.attention(hidden_states, plan=plan, state=state)
        return self.output(hidden_states=self.intermediate(attention_output), input_tensor=attention_output)


class LongShortEncoder(nn.Module):
    def __init__(self, config: LongShortConfig):
        super().__init__()
        self.config = config
        self.layer = nn.ModuleList([LongShortLayer(config, i) for i in range(config.num_hidden_layers)])

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: "LongShortCache | None" = None,
        output_attentions: bool = False,
        global_attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Makes the attention plan of the forward pass once (the masks' validity, the global tokens, the backend, the
        fused path's block masks) and hands it to every layer, as Transformers' models build their masks once."""
        plan = plan_attention(
            [layer.attention.self for layer in self.layer],
            hidden_states,
            attention_mask=attention_mask,
            global_attention_mask=global_attention_mask,
            max_global_tokens=self.config.max_global_tokens,
            cached_tokens=None if cache is None else cache.get_seq_length(),
            output_attentions=output_attentions,
            attn_implementation=self.config._attn_implementation or "sdpa",
        )
        for layer in self.layer:
            # hidden_states positionally, for reentrant gradient checkpointing
            hidden_states = layer(hidden_states, plan=plan, **{CACHE_NAME: cache})
        return hidden_states


class LongShortPooler(nn.Module):
    """RoBERTa's pooler: dense + tanh on the first token."""

    def __init__(self, config: LongShortConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden_states[:, 0]))


class LongShortLMHead(nn.Module):
    """RoBERTa's LM head: dense, gelu, LayerNorm, then the decoder tied to the word embeddings."""

    def __init__(self, config: LongShortConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.layer_norm(gelu(self.dense(features))))


class LongShortClassificationHead(nn.Module):
    """RoBERTa's sequence classification head on the ``<s>`` token: dropout, dense, tanh, dropout, out_proj."""

    def __init__(self, config: LongShortConfig):
        super().__init__()
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(dropout)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.dropout(features[:, 0])
        x = self.dropout(torch.tanh(self.dense(x)))
        return self.out_proj(x)


class LongShortPreTrainedModel(PreTrainedModel):
    config_class = LongShortConfig
    base_model_prefix = "long_short"
    supports_gradient_checkpointing = True
    _no_split_modules: ClassVar[list] = ["LongShortEmbeddings", "LongShortLayer"]
    _can_record_outputs: ClassVar[dict] = {"hidden_states": LongShortLayer, "attentions": LongShortSelfAttention}
    # "sdpa", "eager" and "flex_attention" as ``LongShortSelfAttention`` documents them; output_attentions=True works
    # in a call under any (Transformers allows config.output_attentions only with eager).
    _supports_sdpa = True
    _supports_flex_attn = True

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        """The attention reads ``config._attn_implementation`` at each call (``LongShortEncoder.forward``), so
        ``set_attn_implementation`` may switch it (Transformers' own test of the source looks for its attention
        interface, which Long-Short attention does not use)."""
        return True

    @torch.no_grad()
    def _init_weights(self, module):
        """RoBERTa's init: N(0, initializer_range) linears and embeddings, unit LayerNorms (DualLN included), zero
        biases; W^P (Eq. 3) as nn.Linear's default, U(-1/sqrt(d), 1/sqrt(d)), as the official LRA code leaves it.

        W^P scores LayerNorm-ed inputs of norm ~sqrt(d), so N(0, 0.02) gives scores of std 0.02 sqrt(d): 0.16 at
        d = 64, where ``softmax_n`` starts so close to uniform that a single informative token keeps a share ~1/n of
        every projected row and its gradient vanishes with n (a 2-layer, 64-wide model then does not learn to carry
        one token across n = 1024). U(+-1/sqrt(d)) gives std 1/sqrt(3) ~ 0.58 at any width (0.55 under N(0, 0.02)
        at d = 768, so wide models start as before)."""
        super()._init_weights(module)
        if isinstance(module, LongShortLMHead):
            init.zeros_(module.bias)
        if isinstance(module, nn.Linear) and any(
            module is m.dynamic_projection for m in self.modules() if isinstance(m, LongShortSelfAttention)
        ):  # (Transformers calls this on the modules that hold parameters, so W^P is found as a Linear)
            bound = 1 / math.sqrt(module.in_features)
            init.uniform_(module.weight, -bound, bound)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``PreTrainedModel.save_pretrained``, plus this package's modeling files and an ``auto_map`` naming every
        head, so that the folder also loads with ``trust_remote_code=True`` where ``ls_hf`` is not installed."""
        self.config.auto_map = hub_auto_map()
        return super().save_pretrained(save_directory, *args, **kwargs)


class LongShortModel(LongShortPreTrainedModel):
    """The bare LongShort encoder (or decoder, with ``config.is_decoder=True``) with an optional RoBERTa pooler.

    ``attentions`` (``output_attentions=True``) are, per layer, (B, H, n, R + S): each query's weights over the R
    projected rows (r per head; causal: r per finished segment of l tokens) followed by its S window keys
    (bidirectional S = w + 2 * max(w // 2, 1), i.e. 2w for even w; causal S = 2w, or all n keys when fewer than w
    tokens are fed; in a cached decoding step the cached window). Padded queries output the attention output bias.
    With ``global_attention_mask`` (bidirectional models; Longformer's meaning, 1 = global) every token also sees the
    global tokens, which attend to every token; the attentions then are (B, H, n, K + R + S + K) for K the most global
    tokens of a sample: [global keys | projected rows | window keys | the weights the global tokens' queries give this
    token] (``LongShortSelfAttention.forward`` spells it out). Inputs of any length up to
    ``config.max_input_length`` work (the attention pads internally). Bidirectional models count window segments
    from the first column, so pad them on the right; causal models count each row's windows and projection segments
    from its first real token, so left padding changes no row's output.
    """

    def __init__(self, config: LongShortConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        config.check_long_short()  # the config may have been edited since construction (e.g. is_decoder=True)
        self.embeddings = LongShortEmbeddings(config)
        self.encoder = LongShortEncoder(config)
        self.pooler = LongShortPooler(config) if add_pooling_layer else None
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        cache: LongShortCache | None = None,
        use_cache: bool | None = None,
        global_attention_mask: torch.Tensor | None = None,
        past_key_values: LongShortCache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPoolingAndCrossAttentions:
        """input_ids / attention_mask (1 = real token) / token_type_ids / position_ids: (B, n); or inputs_embeds
        (B, n, d). With ``cache`` (a ``LongShortCache``; ``past_key_values`` before Transformers 5.24) the inputs
        continue the cached tokens and ``attention_mask`` may cover the cached tokens too, (B, past + n); its last n
        columns mask the keys.
        Without ``position_ids``, positions follow ``roberta_position_ids``: counted over the real tokens that the
        mask marks (else the ids that are not ``pad_token_id``), the same in a full forward, a cached step and
        ``generate``. global_attention_mask (B, n): 1 for global tokens (bidirectional models only; none by default
        here, the heads set Longformer's defaults)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Specify exactly one of input_ids or inputs_embeds.")
        cache = decoding_cache(cache, past_key_values)
        if cache is not None and not isinstance(cache, LongShortCache):
            raise ValueError(
                f"{CACHE_NAME} must be a LongShortCache (causal LongShort attention keeps windows and projected "
                f"rows, not full K/V), got {type(cache).__name__}."
            )
        use_cache = bool(use_cache) and self.config.is_decoder
        if use_cache and cache is None:
            cache = LongShortCache(self.config)
        past_length = cache.get_seq_length() if cache is not None else 0
        batch, n = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
        length = past_length + n
        if attention_mask is not None and tuple(attention_mask.shape) not in ((batch, n), (batch, length)):
            with_cache = f" or (batch, cached + new tokens) = {(batch, length)}" if past_length else ""
            raise ValueError(
                f"attention_mask must have shape (batch, new tokens) = {(batch, n)}{with_cache}, with 1 for real "
                f"tokens; got {tuple(attention_mask.shape)}."
            )
        if global_attention_mask is not None:
            if self.config.is_decoder:
                raise ValueError(
                    "global_attention_mask needs bidirectional attention, but this model is causal (is_decoder=True): "
                    "a causal token cannot attend to every token. Drop global_attention_mask, or load the model with "
                    "is_decoder=False."
                )
            if tuple(global_attention_mask.shape) != (batch, n):
                raise ValueError(
                    f"global_attention_mask must have shape (batch, tokens) = {(batch, n)}, with 1 for global tokens; "
                    f"got {tuple(global_attention_mask.shape)}."
                )
        if length > self.config.max_input_length:
            raise ValueError(
                f"Input length {length} exceeds the {self.config.max_input_length} tokens this model's position table "
                f"holds (max_position_embeddings={self.config.max_position_embeddings}, positions start at "
                f"pad_token_id + 1). Truncate the input (e.g. tokenizer(..., truncation=True, "
                f"max_length={self.config.max_input_length})) or extend the position embeddings."
            )
        if position_ids is None:
            position_ids = roberta_position_ids(
                self.config.pad_token_id,
                input_ids=input_ids,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                past_length=past_length,
            )
        output_attentions = kwargs.get("output_attentions")
        if output_attentions is None:
            output_attentions = self.config.output_attentions

        hidden_states = self.embeddings(
            position_ids=position_ids, input_ids=input_ids, token_type_ids=token_type_ids, inputs_embeds=inputs_embeds
        )
        hidden_states = self.encoder(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            cache=cache,
            output_attentions=output_attentions,
            global_attention_mask=global_attention_mask,
        )
        return BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=hidden_states,
            pooler_output=self.pooler(hidden_states) if self.pooler is not None else None,
            **{CACHE_NAME: cache if use_cache else None},
        )


class LongShortLanguageModel(LongShortPreTrainedModel):
    """The backbone with RoBERTa's LM head tied to the word embeddings: the base of the masked and causal LMs."""

    _tied_weights_keys: ClassVar[dict] = {
        "lm_head.decoder.weight": "long_short.embeddings.word_embeddings.weight",
        "lm_head.decoder.bias": "lm_head.bias",
    }

    def __init__(self, config: LongShortConfig):
        super().__init__(config)
        self.long_short = LongShortModel(config, add_pooling_layer=False)
        self.lm_head = LongShortLMHead(config)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings):
        self.lm_head.decoder = new_embeddings


class LongShortForMaskedLM(LongShortLanguageModel):
    def __init__(self, config: LongShortConfig):
        require_bidirectional(type(self), config, "predicts masked tokens from both sides")
        super().__init__(config)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        global_attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> MaskedLMOutput:
        """labels (B, n): token ids to predict, -100 where no loss is taken. global_attention_mask (B, n): 1 for global
        tokens (none by default)."""
        outputs = self.long_short(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            global_attention_mask=global_attention_mask,
            return_dict=True,
            **kwargs,
        )
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return MaskedLMOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class LongShortForCausalLM(LongShortLanguageModel, GenerationMixin):
    """Causal LongShort language model (Eq. 5, Appendix D). Needs ``config.is_decoder=True``.

    ``generate`` decodes with a ``LongShortCache``; positions are RoBERTa's (``pad_token_id + 1`` onwards), by the
    one rule of ``roberta_position_ids`` (real tokens from the attention mask) in ``forward``, a cached step and
    ``generate`` alike. The cache cannot be cropped (``_is_stateful``, ``is_croppable``), so ``generate`` refuses
    assisted and prompt-lookup decoding before any token. Left-padded batches, the way Transformers batches prompts,
    generate for each row what the row generates alone: each row counts its windows and projection segments from its
    first real token, in the prompt's forward and in every cached step.
    """

    _is_stateful = True  # the cache cannot be cropped, told to Transformers < 5.25 (later: the layers' is_croppable)

    def __init__(self, config: LongShortConfig):
        if not config.is_decoder:
            raise ValueError(
                "LongShortForCausalLM needs causal attention: build it from a config with is_decoder=True "
                "(e.g. AutoConfig.for_model('long_short', is_decoder=True, ...))."
            )
        super().__init__(config)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        cache: LongShortCache | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: LongShortCache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """labels (B, n): the input ids (shifted inside the loss), -100 where no loss is taken. logits_to_keep: an
        int k keeps the last k positions' logits (0 = all), a tensor selects positions."""
        if labels is not None:
            use_cache = False
        outputs = self.long_short(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            cache=cache,
            past_key_values=past_key_values,
            use_cache=use_cache,
            return_dict=True,
            **kwargs,
        )
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(outputs.last_hidden_state[:, keep])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **{CACHE_NAME: getattr(outputs, CACHE_NAME)},
        )

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """Decode with a ``LongShortCache`` unless the caller passed a cache or turned caching off; refuse any
        ``cache_implementation`` (the other cache types hold full K/V)."""
        prepare_own_cache(
            generation_config,
            model_kwargs,
            lambda: LongShortCache(self.config),
            "LongShort decodes only with LongShortCache (per layer a window and the projected rows)",
        )
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)

    def _validate_generated_length(self, generation_config, input_ids_length, has_default_max_length):
        """The prompt must leave room in the position table for a new token (else it must be cut), Transformers'
        checks, then the prompt and the new tokens must fit the table: checked before the first step rather than
        failing after some tokens."""
        limit = self.config.max_input_length
        if input_ids_length >= limit:
            raise ValueError(
                f"The prompt has {input_ids_length} tokens, and this model's position table holds {limit}: no new "
                f"token fits after it. Cut the prompt to fit, at most {limit - 1} tokens (e.g. keep its last "
                f"{limit - 1}), so that prompt + max_new_tokens <= {limit}."
            )
        super()._validate_generated_length(generation_config, input_ids_length, has_default_max_length)
        if generation_config.max_length > limit:
            raise ValueError(
                f"The prompt ({input_ids_length} tokens) plus the new tokens would reach {generation_config.max_length} "
                f"tokens, beyond the {limit} this model's position table holds: keep prompt + max_new_tokens <= {limit} "
                f"(e.g. max_new_tokens={limit - input_ids_length}) or shorten the prompt."
            )

    def _prepare_position_ids_for_generation(self, inputs_tensor, model_kwargs):
        """The positions ``forward`` would give the prompt (``roberta_position_ids``); ``generate`` extends them."""
        ids = inputs_tensor if inputs_tensor.dim() == 2 else None
        return roberta_position_ids(
            self.config.pad_token_id,
            input_ids=ids,
            inputs_embeds=None if ids is not None else inputs_tensor,
            attention_mask=model_kwargs.get("attention_mask"),
        )


class LongShortForSequenceClassification(LongShortPreTrainedModel):
    def __init__(self, config: LongShortConfig):
        require_bidirectional(type(self), config, "classifies the first token (<s>), which causally sees only itself")
        super().__init__(config)
        self.num_labels = config.num_labels
        self.long_short = LongShortModel(config, add_pooling_layer=False)
        self.classifier = LongShortClassificationHead(config)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        global_attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> SequenceClassifierOutput:
        """labels (B,): class ids (float targets for regression or multi-label, as in RoBERTa). global_attention_mask
        (B, n): 1 for global tokens; by default the first token (Longformer's)."""
        if global_attention_mask is None:
            global_attention_mask = first_token_global(input_ids if input_ids is not None else inputs_embeds)
        outputs = self.long_short(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            global_attention_mask=global_attention_mask,
            return_dict=True,
            **kwargs,
        )
        logits = self.classifier(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = self.loss_function(labels, logits, self.config, **kwargs)
            num_items = kwargs.get("num_items_in_batch")
            if num_items is not None and self.config.problem_type != "single_label_classification":
                # Transformers' MSE and BCE losses average the micro-batch and ignore num_items_in_batch, while the
                # Trainer, which passes it, no longer divides by the accumulation steps: rescale to the whole batch.
                loss = loss * labels.numel() / num_items
        return SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class LongShortForTokenClassification(LongShortPreTrainedModel):
    def __init__(self, config: LongShortConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.long_short = LongShortModel(config, add_pooling_layer=False)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        global_attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> TokenClassifierOutput:
        """labels (B, n): class ids, -100 where no loss is taken. global_attention_mask (B, n): 1 for global tokens
        (none by default)."""
        outputs = self.long_short(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            global_attention_mask=global_attention_mask,
            return_dict=True,
            **kwargs,
        )
        logits = self.classifier(self.dropout(outputs.last_hidden_state))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config, **kwargs)
        return TokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class LongShortForQuestionAnswering(LongShortPreTrainedModel):
    def __init__(self, config: LongShortConfig):
        super().__init__(config)
        self.long_short = LongShortModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        start_positions: torch.LongTensor | None = None,
        end_positions: torch.LongTensor | None = None,
        global_attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> QuestionAnsweringModelOutput:
        """start_positions / end_positions (B,): the answer span's token indices. global_attention_mask (B, n): 1 for
        global tokens; by default, from input_ids, the question (every token before the first ``sep_token_id``, as
        Longformer); with inputs_embeds and no mask, none."""
        if global_attention_mask is None and input_ids is not None and not self.config.is_decoder:
            global_attention_mask = question_global_mask(input_ids, self.config.sep_token_id)
        outputs = self.long_short(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            global_attention_mask=global_attention_mask,
            return_dict=True,
            **kwargs,
        )
        start_logits, end_logits = self.qa_outputs(outputs.last_hidden_state).unbind(-1)
        loss = None
        if start_positions is not None and end_positions is not None:
            loss = self.loss_function(start_logits, end_logits, start_positions, end_positions, **kwargs)
        return QuestionAnsweringModelOutput(
            loss=loss,
            start_logits=start_logits.contiguous(),
            end_logits=end_logits.contiguous(),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


class LongShortForMultipleChoice(LongShortPreTrainedModel):
    def __init__(self, config: LongShortConfig):
        require_bidirectional(type(self), config, "scores from the first token (<s>), which causally sees only itself")
        super().__init__(config)
        self.long_short = LongShortModel(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        global_attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> MultipleChoiceModelOutput:
        """Inputs (B, C, n) (inputs_embeds (B, C, n, d)) for C choices; labels (B,): the right choice.
        global_attention_mask (B, C, n): 1 for global tokens; by default each choice's first token."""
        first = input_ids if input_ids is not None else inputs_embeds
        num_choices = first.shape[1]
        if global_attention_mask is None:
            global_attention_mask = first_token_global(first.flatten(0, 1)).view(first.shape[:3])

        def flat(x):
            return x.flatten(0, 1) if x is not None else None

        outputs = self.long_short(
            input_ids=flat(input_ids),
            attention_mask=flat(attention_mask),
            token_type_ids=flat(token_type_ids),
            position_ids=flat(position_ids),
            inputs_embeds=flat(inputs_embeds),
            global_attention_mask=flat(global_attention_mask),
            return_dict=True,
            **kwargs,
        )
        logits = self.classifier(self.dropout(outputs.pooler_output)).view(-1, num_choices)
        loss = None
        if labels is not None:
            loss = fixed_cross_entropy(logits, labels.to(logits.device), kwargs.get("num_items_in_batch"))
        return MultipleChoiceModelOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


# The one list of heads: each with its Auto class (registered with Transformers on `import ls_hf`, written into
# `auto_map`) and its Hub pipeline tag (model cards). The package exports every head named here.
HEADS = {
    LongShortModel: ("AutoModel", "feature-extraction"),
    LongShortForMaskedLM: ("AutoModelForMaskedLM", "fill-mask"),
    LongShortForCausalLM: ("AutoModelForCausalLM", "text-generation"),
    LongShortForSequenceClassification: ("AutoModelForSequenceClassification", "text-classification"),
    LongShortForTokenClassification: ("AutoModelForTokenClassification", "token-classification"),
    LongShortForQuestionAnswering: ("AutoModelForQuestionAnswering", "question-answering"),
    LongShortForMultipleChoice: ("AutoModelForMultipleChoice", "multiple-choice"),
}
AUTO_CLASSES = {auto_name: model_class for model_class, (auto_name, _) in HEADS.items()}
__all__ = ["AUTO_CLASSES", "HEADS", "ROBERTA_KEY_MAPPING", "LongShortCache", "LongShortPreTrainedModel"]
__all__ += [model_class.__name__ for model_class in HEADS]


def hub_auto_map(config_class=LongShortConfig, auto_classes: dict = AUTO_CLASSES) -> dict:
    """``config.auto_map`` naming the config and every head (Auto class name -> model class) by
    ``<module file>.<class>`` (Hub remote code)."""
    classes = {"AutoConfig": config_class, **auto_classes}
    return {name: f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}" for name, cls in classes.items()}


# Saving copies this file and its relative imports next to the weights (Hub remote code).
LongShortConfig.register_for_auto_class()
for _auto_name, _model_class in AUTO_CLASSES.items():
    _model_class.register_for_auto_class(_auto_name)

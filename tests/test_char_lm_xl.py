"""LongShortXLForCausalLM: the official character-level model (autoregressive/model_lib) with its memory."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from ls_hf import LongShortXLCache, LongShortXLConfig, LongShortXLForCausalLM

FIXTURES = Path(__file__).parent / "fixtures"

# official state-dict name -> ours (per layer "layers.<i>." prefixes are kept)
OFFICIAL_NAMES = {
    "in_emb.weight": "long_short.embeddings.weight",
    "out_emb.bias": "lm_head.bias",
    "attn.proj_query.": "attention.query.",
    "attn.proj_key.": "attention.key.",
    "attn.proj_val.": "attention.value.",
    "attn.proj_out.": "attention.output.",
    "attn.dconv_1.": "attention.dynamic_projection.",
    "attn.r_net.": "attention.window_position.",
    "attn.r_net_chunk.": "attention.row_position.",
    "attn.r_w_bias": "attention.content_bias",
    "attn.r_r_bias": "attention.position_bias",
    "attn.dual_ln_win.": "attention.dual_ln_local.",
    "attn.dual_ln_dproj.": "attention.dual_ln_global.",
    "ff.": "feed_forward.",
}


def official_model(case: str):
    """Our model with the fixture's official weights (float64, eval), and the fixture's tensors of ``case``."""
    meta = json.loads((FIXTURES / "char_lm_official.json").read_text())["cases"][case]
    tensors = {k[len(case) + 1 :]: v for k, v in load_file(FIXTURES / "char_lm_official.safetensors").items()
               if k.startswith(case + ".")}
    kw = meta["model_kwargs"]
    config = LongShortXLConfig(
        vocab_size=kw["vocab_size"], hidden_size=kw["d_model"], intermediate_size=kw["d_inner"],
        num_attention_heads=kw["n_head"], num_hidden_layers=kw["n_layer"], memory_length=kw["mem_len"],
        projection_rank=kw["chunk_rank"], causal_segment_length=kw["chunk_size"], window_size=kw["window_len"],
        hidden_dropout_prob=0.0,
    )
    model = LongShortXLForCausalLM(config).double().eval()
    state = {}
    for name, value in tensors.items():
        if not name.startswith("param.") or name.endswith("pos_emb.inv_freq"):  # our sinusoids compute inv_freq
            continue
        name = name[len("param."):]
        for old, new in OFFICIAL_NAMES.items():
            name = name.replace(old, new)
        if not name.startswith(("long_short.", "lm_head.")):
            name = "long_short." + name
        state[name] = value.reshape(model.state_dict()[name].shape)
    missing = set(model.state_dict()) - set(state) - {"lm_head.weight"}
    assert not missing, missing
    model.load_state_dict(state, strict=False)
    return model, tensors, meta


@pytest.mark.parametrize("case", ["tiled", "short_block"])
def test_official_model_outputs_with_memory(case):
    """Consecutive blocks with the official memory (random, then carried): log-probabilities and the next memory."""
    model, tensors, meta = official_model(case)
    memory = [tensors[f"memory_in.{i}"] for i in range(model.config.num_hidden_layers)]
    start = 0
    with torch.no_grad():
        for j, length in enumerate(meta["blocks"]):
            out = model(tensors["input_ids"][:, start : start + length], memory=memory, use_cache=False)
            torch.testing.assert_close(out.logits.log_softmax(-1), tensors[f"log_probs.{j}"], rtol=0, atol=1e-5)
            memory, start = out.memory, start + length
    for i, layer_memory in enumerate(memory):
        torch.testing.assert_close(layer_memory, tensors[f"memory_out.{i}"], rtol=0, atol=1e-5)

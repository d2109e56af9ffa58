"""LongShortXLForCausalLM: the official character-level model (autoregressive/model_lib) with its memory."""

import json
import math
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
    tensors = {
        k[len(case) + 1 :]: v
        for k, v in load_file(FIXTURES / "char_lm_official.safetensors").items()
        if k.startswith(case + ".")
    }
    kw = meta["model_kwargs"]
    config = LongShortXLConfig(
        vocab_size=kw["vocab_size"],
        hidden_size=kw["d_model"],
        intermediate_size=kw["d_inner"],
        num_attention_heads=kw["n_head"],
        num_hidden_layers=kw["n_layer"],
        memory_length=kw["mem_len"],
        projection_rank=kw["chunk_rank"],
        causal_segment_length=kw["chunk_size"],
        window_size=kw["window_len"],
        hidden_dropout_prob=0.0,
    )
    model = LongShortXLForCausalLM(config).double().eval()
    state = {}
    for name, value in tensors.items():
        if not name.startswith("param.") or name.endswith("pos_emb.inv_freq"):  # our sinusoids compute inv_freq
            continue
        name = name[len("param.") :]
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


def tiny_xl(**overrides) -> LongShortXLForCausalLM:
    torch.manual_seed(0)
    fields = {
        "vocab_size": 20,
        "hidden_size": 16,
        "num_attention_heads": 2,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "window_size": 4,
        "projection_rank": 2,
        "causal_segment_length": 2,
        "memory_length": 8,
        "hidden_dropout_prob": 0.0,
    }
    model = LongShortXLForCausalLM(LongShortXLConfig(**{**fields, **overrides})).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


RULES = [
    {"window_rule": rule, "projection_input": source, "use_dual_ln": dual}
    for rule in ("token", "segment")
    for source in ("raw", "normalized")
    for dual in (True, False)
]


@pytest.mark.parametrize("rules", RULES, ids=lambda r: "-".join(str(v) for v in r.values()))
@pytest.mark.parametrize("lengths", [(0, 11), (8, 5), (6, 3)], ids=["no-memory", "memory", "short"])
def test_attention_matches_the_reference(rules, lengths):
    """The grouped attention against the one-query-at-a-time definition, with and without memory."""
    from .reference import reference_xl_attention

    attention = tiny_xl(**rules).long_short.layers[0].attention
    L, n = lengths
    torch.manual_seed(1)
    h, memory = torch.randn(2, n, 16, dtype=torch.float64), torch.randn(2, L, 16, dtype=torch.float64)
    state = attention.read_memory(memory) if L else None
    with torch.no_grad():
        from ls_hf.modeling_long_short_xl import XLState, sinusoids

        span = 4 if rules["window_rule"] == "token" else 8
        out = attention(h, state or XLState(), sinusoids(torch.arange(span), 16).double())
        expected = reference_xl_attention(attention, h, memory if L else None)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("rules", [RULES[0], RULES[6]], ids=["official", "paper"])
def test_cached_decoding_equals_the_full_forward_with_memory(rules):
    model = tiny_xl(**rules)
    ids = torch.randint(0, 20, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        memory = model(ids[:, :8], use_cache=False).memory
        full = model(ids[:, 8:], memory=memory, use_cache=False).logits
        out = model(ids[:, 8:11], memory=memory, use_cache=True)
        steps = [out.logits]
        for t in range(11, 21):
            steps.append(model(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True).logits)
    assert isinstance(out.past_key_values, LongShortXLCache)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-10)
    # the base model takes the cache by either name, as the causal LM does
    by_new_name, by_old_name = LongShortXLCache(model.config), LongShortXLCache(model.config)
    with torch.no_grad():
        new = model.long_short(ids[:, 8:11], memory, cache=by_new_name)[0]
        old = model.long_short(ids[:, 8:11], memory, past_key_values=by_old_name)[0]
    assert torch.equal(new, old) and by_new_name.get_seq_length() == by_old_name.get_seq_length() == 8 + 3  # memory too


def test_generate_cached_equals_uncached_and_greedy_loop():
    model = tiny_xl(window_size=4, projection_rank=1, causal_segment_length=3, memory_length=6)
    model.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=0)
    prompt = torch.randint(0, 20, (2, 7), generator=torch.Generator().manual_seed(2))
    ones = torch.ones_like(prompt)  # unpadded streams (the prompt may hold the pad id)
    cached = model.generate(prompt, attention_mask=ones, max_new_tokens=15, do_sample=False, use_cache=True)
    uncached = model.generate(prompt, attention_mask=ones, max_new_tokens=15, do_sample=False, use_cache=False)
    ids = prompt
    with torch.no_grad():
        for _ in range(15):
            ids = torch.cat([ids, model(ids, use_cache=False).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(cached, uncached) and torch.equal(cached, ids)
    with torch.no_grad():
        memory = model(torch.randint(0, 20, (2, 6), generator=torch.Generator().manual_seed(5))).memory
    with_memory = model.generate(prompt, attention_mask=ones, memory=memory, max_new_tokens=9, do_sample=False)
    assert torch.equal(
        with_memory,
        model.generate(prompt, attention_mask=ones, memory=memory, max_new_tokens=9, do_sample=False, use_cache=False),
    )
    with torch.no_grad():  # the memory is read
        assert not torch.allclose(model(prompt, memory=memory).logits, model(prompt).logits)
    beams = model.generate(prompt, attention_mask=ones, max_new_tokens=6, num_beams=3, do_sample=False)
    assert torch.equal(
        beams,
        model.generate(prompt, attention_mask=ones, max_new_tokens=6, num_beams=3, do_sample=False, use_cache=False),
    )


def test_no_future_leakage_and_memory_is_detached():
    model = tiny_xl()
    model.train()
    ids = torch.randint(0, 20, (1, 12), generator=torch.Generator().manual_seed(3))
    memory = model(ids[:, :8], use_cache=False).memory
    assert all(not m.requires_grad for m in memory)
    model.eval()
    with torch.no_grad():
        base = model(ids, memory=memory, use_cache=False).logits
        changed = ids.clone()
        changed[0, 7] = (changed[0, 7] + 1) % 20
        other = model(changed, memory=memory, use_cache=False).logits
    assert torch.equal(base[:, :7], other[:, :7]) and not torch.equal(base[:, 7:], other[:, 7:])


def test_streaming_blocks_with_memory_equal_one_long_forward_when_the_memory_holds_everything():
    """With memory_length >= the stream, block-by-block scoring sees what one forward of the whole stream sees."""
    model = tiny_xl(memory_length=24)
    ids = torch.randint(0, 20, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        whole = model(ids, use_cache=False).logits
        memory, parts = None, []
        for start in range(0, 24, 8):
            out = model(ids[:, start : start + 8], memory=memory, use_cache=False)
            memory = out.memory
            parts.append(out.logits)
    # the official memory is compressed before W_K (raw rule), the block after it: equal only with the paper's rule
    paper = tiny_xl(memory_length=24, projection_input="normalized")
    with torch.no_grad():
        whole_paper, memory, parts_paper = paper(ids, use_cache=False).logits, None, []
        for start in range(0, 24, 8):
            out = paper(ids[:, start : start + 8], memory=memory, use_cache=False)
            memory = out.memory
            parts_paper.append(out.logits)
    torch.testing.assert_close(torch.cat(parts_paper, 1), whole_paper, rtol=0, atol=1e-10)
    assert not torch.allclose(torch.cat(parts, 1), whole)


def reference_log_probs(model: LongShortXLForCausalLM, ids: torch.Tensor, memory_length: int) -> torch.Tensor:
    """The official model's log-probabilities of the first block of streams, one query at a time: every layer's memory
    is ``memory_length`` zeros (the official ``init_hid_cache``, unmasked), normalised by the layer's LN_1 as the
    official layer normalises its cache; Pre-LN layers ``h = LN_1(h); h = LN_2(h + Attn(h)); h = h + FFN(h)``."""
    from .reference import reference_xl_attention

    core = model.long_short
    h = core.embeddings(ids) * math.sqrt(model.config.hidden_size)
    zeros = h.new_zeros(h.shape[0], memory_length, h.shape[-1])
    for layer in core.layers:
        h = layer.norm1(h)
        h = layer.norm2(h + reference_xl_attention(layer.attention, h, layer.norm1(zeros)))
        h = h + layer.feed_forward(h)
    return model.lm_head(h).log_softmax(-1)


@pytest.mark.parametrize("rules", [RULES[0], RULES[6]], ids=["official", "paper"])
def test_initial_memory_is_the_official_start_of_a_stream(rules):
    """``initial_memory``: a full memory of zeros, which the first block's window and projected rows see (LN_1 of
    zero: the LayerNorm bias); its log-probabilities against the float64 one-query-at-a-time reference, and far
    from a start with no memory."""
    model = tiny_xl(**rules)
    ids = torch.randint(0, 20, (2, 6), generator=torch.Generator().manual_seed(7))
    memory = model.initial_memory(2)
    assert len(memory) == 2 and all(m.shape == (2, 8, 16) and m.dtype == torch.float64 and not m.any() for m in memory)
    with torch.no_grad():
        out = model(ids, memory=memory, use_cache=False)
        expected = reference_log_probs(model, ids, memory_length=8)
        empty = model(ids, use_cache=False).logits.log_softmax(-1)
    torch.testing.assert_close(out.logits.log_softmax(-1), expected, rtol=0, atol=1e-10)
    assert (empty - expected).abs().max() > 1e-2
    # the next memory: the last 8 of [8 zeros; the block's 6 inputs]
    assert all(not m[:, :2].any() and m.shape == (2, 8, 16) for m in out.memory)
    assert [m.shape[1] for m in model.initial_memory(1, memory_length=4)] == [4, 4]
    with pytest.raises(ValueError, match="memory_length"):
        model.initial_memory(1, memory_length=3)


FOLDER_SAVED_BEFORE = FIXTURES / "char_lm_xl_folder"  # saved when LongShortXLConfig extended LongShortConfig


def test_folder_saved_with_the_inherited_config_loads(tmp_path):
    """A folder saved when the config extended ``LongShortConfig`` (its config.json carries RoBERTa fields this model
    never read) loads, gives the logits it gave then, and saves again with this config's fields only."""
    from ls_hf.modeling_long_short_xl import INHERITED_FIELDS

    saved = json.loads((FOLDER_SAVED_BEFORE / "config.json").read_text())
    assert set(INHERITED_FIELDS) <= set(saved)
    model = AutoModelForCausalLM.from_pretrained(FOLDER_SAVED_BEFORE).eval()
    assert type(model) is LongShortXLForCausalLM and model.config.memory_length == 8
    outputs = load_file(FOLDER_SAVED_BEFORE / "outputs.safetensors")
    with torch.no_grad():
        torch.testing.assert_close(model(outputs["input_ids"]).logits, outputs["logits"])
    model.save_pretrained(tmp_path)
    resaved = json.loads((tmp_path / "config.json").read_text())
    assert not set(INHERITED_FIELDS) & set(resaved)
    assert {k: v for k, v in resaved.items() if k in saved and k != "transformers_version"} == {
        k: v for k, v in saved.items() if k in resaved and k != "transformers_version"
    }


def test_config_has_its_own_fields():
    """The config holds the fields the model reads, not LongShortConfig's (no positions table, no token types, no
    LMSA, no global tokens); LongShortConfig's fixed values are refused where the model has no other."""
    from ls_hf import LongShortConfig

    config = LongShortXLConfig()
    assert not isinstance(config, LongShortConfig) and config.is_decoder
    assert not {
        "max_position_embeddings",
        "type_vocab_size",
        "qk_head_dim",
        "global_projections",
        "recompute_window_tiles",
        "hidden_act",
    } & set(config.to_dict())
    for name, value in (("qk_head_dim", 8), ("global_projections", True)):
        with pytest.raises(ValueError, match=name):
            LongShortXLConfig(**{name: value})
    assert not hasattr(LongShortXLConfig(type_vocab_size=2, max_position_embeddings=10), "type_vocab_size")


CLEAN_PROCESS = """
import sys
sys.modules["ls_hf"] = None  # installed in this venv: make it unimportable
import torch
from transformers import AutoModelForCausalLM
from transformers import AutoModel
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
base = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True)
for m in (model, base):
    assert type(m).__module__.startswith("transformers_modules"), type(m).__module__
assert type(base).__name__ == "LongShortXLModel"
with torch.no_grad():
    torch.save(model(torch.load(sys.argv[2])).logits, sys.argv[3])
"""


def test_hub_folder_loads_without_the_package(tmp_path):
    import os
    import subprocess
    import sys

    from ls_hf.hub import REMOTE_CODE_FILES_XL, save_for_hub

    model = tiny_xl().float()
    save_for_hub(model, tmp_path / "xl")
    assert all((tmp_path / "xl" / name).is_file() for name in REMOTE_CODE_FILES_XL)
    ids = torch.randint(0, 20, (2, 9))
    torch.save(ids, tmp_path / "ids.pt")
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    subprocess.run(
        [sys.executable, "-c", CLEAN_PROCESS, str(tmp_path / "xl"), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")],
        check=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    with torch.no_grad():
        torch.testing.assert_close(torch.load(tmp_path / "out.pt"), model(ids).logits)


def test_auto_classes_save_load_and_tied_output(tmp_path):
    config = AutoConfig.for_model(
        "long_short_xl",
        vocab_size=20,
        hidden_size=16,
        num_attention_heads=2,
        intermediate_size=32,
        num_hidden_layers=1,
        window_size=4,
        projection_rank=1,
        causal_segment_length=2,
        memory_length=4,
    )
    model = AutoModelForCausalLM.from_config(config)
    assert type(model) is LongShortXLForCausalLM
    assert model.lm_head.weight is model.long_short.embeddings.weight
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is LongShortXLForCausalLM and (tmp_path / "modeling_long_short_xl.py").is_file()
    ids = torch.randint(0, 20, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model.eval()(ids).logits)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"window_rule": "tokens"}, "window_rule"),
        ({"projection_input": "ln"}, "projection_input"),
        ({"memory_length": 5}, "memory_length"),
        ({"is_decoder": False}, "is_decoder"),
    ],
)
def test_bad_config_is_a_clear_error(overrides, match):
    with pytest.raises(ValueError, match=match):
        LongShortXLConfig(causal_segment_length=4, **overrides)


def test_padding_and_odd_memory_are_refused():
    """Padding, a mask of another length than the input (longer or shorter: it was not checked) and a memory that is
    not whole segments are refused."""
    model = tiny_xl()
    with pytest.raises(ValueError, match="attention_mask"):
        model(torch.ones(1, 4, dtype=torch.long), attention_mask=torch.tensor([[0, 1, 1, 1]]))
    for length in (3, 6):
        with pytest.raises(ValueError, match=rf"= \(1, 4\), all ones; got \(1, {length}\)"):
            model(torch.ones(1, 4, dtype=torch.long), attention_mask=torch.ones(1, length, dtype=torch.long))
    with pytest.raises(ValueError, match="memory_length"):
        model(torch.ones(1, 4, dtype=torch.long), memory_length=3)


# ---------------------------------------------------------------------------------------------- recipes.char_lm


def test_stream_blocks_continue_the_streams_batch_to_batch():
    from recipes.char_lm import stream_blocks

    data = bytes(range(50))
    rows = stream_blocks(data, length=4, streams=3, offset=3, name="train")
    ids, labels = torch.tensor(rows["input_ids"]) - 3, torch.tensor(rows["shift_labels"]) - 3
    per_stream = 16  # (50 - 1) // 3 bytes, whole blocks: 4 per stream
    assert ids.shape == (4 * 3, 4)
    for k in range(4):
        for s in range(3):
            start = s * per_stream + 4 * k
            assert ids[k * 3 + s].tolist() == list(range(start, start + 4))
            assert labels[k * 3 + s].tolist() == list(range(start + 1, start + 5))


def test_stream_loss_with_a_memory_holding_everything_equals_one_forward():
    """Under the paper's projection rule a stream started with no memory and scored block by block with a memory
    holding all earlier bytes equals one forward over the text; without memory every block is scored on its own. The
    official start (the default) is a memory of zeros: the first block as the model scores it after
    ``initial_memory``."""
    from recipes.char_lm import stream_loss

    model = tiny_xl(projection_input="normalized", memory_length=64, vocab_size=259)
    data = bytes(torch.randint(0, 200, (41,), generator=torch.Generator().manual_seed(6)).tolist())
    ids = torch.tensor(list(data)) + 3
    with torch.no_grad():
        logp = model(ids[None, :-1], use_cache=False).logits.log_softmax(-1)[0]
        whole = -logp.gather(-1, ids[1:, None]).mean().item()
        blocks = [
            model(ids[None, s : min(s + 8, 40)], use_cache=False)
            .logits.log_softmax(-1)[0]
            .gather(-1, ids[s + 1 : min(s + 9, 41), None])
            for s in range(0, 40, 8)
        ]
    assert stream_loss(model, data, offset=3, block_length=8, memory_length=64, stream_start="empty") == pytest.approx(
        whole, abs=1e-9
    )
    for start in ("empty", "zeros"):
        assert stream_loss(model, data, offset=3, block_length=8, memory_length=0, stream_start=start) == pytest.approx(
            -torch.cat(blocks).mean().item(), abs=1e-9
        )
    with torch.no_grad():
        zero_start = model(ids[None, :40], memory=model.initial_memory(1, 64), use_cache=False).logits
    expected = -zero_start.log_softmax(-1)[0].gather(-1, ids[1:, None]).mean().item()
    assert stream_loss(model, data, offset=3, block_length=40, memory_length=64) == pytest.approx(expected, abs=1e-9)
    assert abs(expected - whole) > 1e-3


def test_char_lm_trains_the_official_model_with_memory_and_scores_streaming(tmp_path):
    """A tiny official model trains on streams with memory, reports streaming and block-by-block BPC, saves a folder
    that loads and generates through the Auto classes, and a second phase continues from it."""

    from recipes import char_lm

    text = tmp_path / "text.txt"
    words = ["the", "movie", "was", "great", "bad", "plot", "and", "but", "very", "not"]
    generator = torch.Generator().manual_seed(0)
    text.write_text(" ".join(words[i] for i in torch.randint(0, len(words), (3000,), generator=generator).tolist()))
    out = tmp_path / "xl"
    args = [
        "--train_file",
        str(text),
        "--output_dir",
        str(out),
        "--model_type",
        "long_short_xl",
        "--num_hidden_layers",
        "2",
        "--hidden_size",
        "64",
        "--num_attention_heads",
        "4",
        "--window_size",
        "32",
        "--causal_segment_length",
        "16",
        "--dropout",
        "0",
        "--max_seq_length",
        "64",
        "--per_device_train_batch_size",
        "4",
        "--learning_rate",
        "3e-3",
        "--warmup_steps",
        "5",
        "--logging_steps",
        "1",
        "--save_strategy",
        "no",
        "--disable_tqdm",
        "True",
        "--seed",
        "0",
        "--eval_memory_length",
        "256",
        "--eval_block_length",
        "32",
        "--do_train",
        "--do_eval",
        "--do_predict",
    ]
    metrics = char_lm.main([*args, "--max_steps", "50"])
    state = json.loads((out / "trainer_state.json").read_text())
    losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    assert len(losses) == 50 and sum(losses[-10:]) < 0.6 * sum(losses[:10])
    for split in ("eval", "test"):
        assert metrics[f"{split}_bpc"] == pytest.approx(metrics[f"{split}_loss"] / math.log(2))
        assert metrics[f"{split}_bpc"] < 4 and metrics[f"{split}_block_bpc"] < 4
        assert metrics[f"{split}_memory_length"] == 256
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "long_short_xl" and config.memory_length == 64
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model) is LongShortXLForCausalLM
    generated = model.generate(
        torch.tensor([[3 + ord(c) for c in "the "]]), attention_mask=torch.ones(1, 4), max_new_tokens=8, do_sample=False
    )
    assert generated.shape == (1, 12)

    phase2 = char_lm.main(
        [
            *args[: args.index("--output_dir")],
            "--output_dir",
            str(tmp_path / "phase2"),
            *args[args.index("--output_dir") + 2 :],
            "--model_name_or_path",
            str(out),
            "--max_seq_length",
            "128",
            "--memory_length",
            "128",
            "--max_steps",
            "2",
        ]
    )
    assert phase2["eval_bpc"] < 4
    assert AutoConfig.from_pretrained(tmp_path / "phase2").memory_length == 128


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--eval_memory_length", "100"], "--eval_memory_length"),
        (["--memory_length", "30"], "memory_length"),
        (["--window_rule", "tokens"], "window_rule"),
    ],
)
def test_char_lm_official_model_clear_errors(tmp_path, extra, match, capsys):
    from recipes import char_lm

    text = tmp_path / "text.txt"
    text.write_text("abc " * 400)
    with pytest.raises(SystemExit) as err:
        char_lm.main(
            [
                "--train_file",
                str(text),
                "--output_dir",
                str(tmp_path / "o"),
                "--model_type",
                "long_short_xl",
                "--num_hidden_layers",
                "1",
                "--hidden_size",
                "32",
                "--num_attention_heads",
                "2",
                "--window_size",
                "32",
                "--causal_segment_length",
                "16",
                "--max_seq_length",
                "32",
                "--max_steps",
                "1",
                "--do_train",
                *extra,
            ]
        )
    assert err.value.code == 2 and match in capsys.readouterr().err


def test_char_lm_official_model_takes_blocks_beyond_the_absolute_position_limit(tmp_path):
    """Relative positions have no table: a block longer than LongShortConfig's 4,097 absolute positions (phase 3
    trains on 8,192) is not refused."""
    from recipes import char_lm

    text = tmp_path / "text.txt"
    text.write_bytes(bytes(range(32, 127)) * 100)
    metrics = char_lm.main(
        [
            "--train_file",
            str(text),
            "--output_dir",
            str(tmp_path / "o"),
            "--model_type",
            "long_short_xl",
            "--num_hidden_layers",
            "1",
            "--hidden_size",
            "16",
            "--num_attention_heads",
            "2",
            "--window_size",
            "16",
            "--causal_segment_length",
            "16",
            "--max_seq_length",
            "4112",
            "--per_device_train_batch_size",
            "1",
            "--max_steps",
            "1",
            "--save_strategy",
            "no",
            "--disable_tqdm",
            "True",
            "--do_train",
        ]
    )
    assert math.isfinite(metrics["train_loss"])
    assert AutoConfig.from_pretrained(tmp_path / "o").memory_length == 4112


def test_official_initialisation():
    """N(0, 0.02) linears, embedding and u, v; zero biases (the output bias included); LayerNorm weights N(1, 0.02)."""
    torch.manual_seed(0)
    model = LongShortXLForCausalLM(
        LongShortXLConfig(
            vocab_size=300, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256
        )
    )
    attention = model.long_short.layers[0].attention
    for weight in (
        model.long_short.embeddings.weight,
        attention.query.weight,
        attention.row_position.weight,
        model.long_short.layers[1].feed_forward.fc1.weight,
    ):
        assert abs(weight.std().item() - 0.02) < 0.002 and abs(weight.mean().item()) < 0.002
    for bias in (attention.content_bias, attention.position_bias):
        assert 0.01 < bias.std().item() < 0.03
    norm = model.long_short.layers[0].norm1
    assert abs(norm.weight.mean().item() - 1) < 0.01 and 0.01 < norm.weight.std().item() < 0.03
    for bias in (model.lm_head.bias, attention.row_position.bias, norm.bias, attention.dual_ln_local.bias):
        assert not bias.any()


def test_stream_trainer_feeds_the_streams_in_order_and_carries_the_memory(tmp_path):
    from transformers import ByT5Tokenizer

    from recipes.char_lm import CharLmArguments, CharLmTrainingArguments, stream_trainer

    model = tiny_xl(vocab_size=259, memory_length=8).float().train()
    args = CharLmArguments(train_file="unused", max_seq_length=8, eval_memory_length=16)
    training_args = CharLmTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=3, report_to="none", use_cpu=True
    )
    trainer = stream_trainer(model, args, training_args, ByT5Tokenizer(), {"train": bytes(range(100))}, offset=3)
    batches = iter(trainer.get_train_dataloader())
    first, second = next(batches), next(batches)
    assert torch.equal(second["input_ids"][:, 0] - first["input_ids"][:, -1], torch.ones(3, dtype=torch.long))
    assert torch.equal(first["shift_labels"][:, -1], second["input_ids"][:, 0])
    loss = trainer.compute_loss(model, first)
    torch.testing.assert_close(loss, model(**first, memory=model.initial_memory(3)).loss, rtol=0, atol=0)
    assert [tuple(m.shape) for m in trainer.memory] == [(3, 8, 16)] * 2
    assert torch.equal(trainer.memory[0], model.long_short.embeddings(first["input_ids"]) * 4)  # dropout 0: sqrt(16)

"""timm-style checks of every ``cvt_ls_*`` / ``vil_ls_*`` entry: registry, parameter counts, pretrained cfgs, and on
reduced variants (one block per stage, small images) forward, backward, features, intermediates, classifier reset,
grad checkpointing, save/load and the Hub-format round trip through a local folder."""

import socket
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file
from timm.models import group_parameters, save_for_hf
from timm.optim import create_optimizer_v2

import ls_timm  # noqa: F401  (registers the entries)
from ls_timm.cvt_ls import PAPER_SETTINGS
from ls_timm.hierarchical import to_map
from tests.devices import device_sample

FIXTURES = Path(__file__).resolve().parent / "fixtures"
CVT = ["cvt_ls_13", "cvt_ls_17", "cvt_ls_21", "cvt_ls_21s"]
VIL = ["vil_ls_small", "vil_ls_medium", "vil_ls_medium_384", "vil_ls_base"]
# on a GPU, the smallest entry of each family: the others run the same kernels at other widths and depths
ON_TEST_DEVICE = device_sample(CVT + VIL, ["cvt_ls_13", "vil_ls_small"])

# entry -> (paper count in M, relative tolerance); ViL-LS also against NVIDIA's code (exact, counted in M)
PAPER_PARAMS = {
    "cvt_ls_13": (20.3, 0.01),
    "cvt_ls_17": (23.7, 0.01),
    "cvt_ls_21": (32.1, 0.01),
    "cvt_ls_21s": (30.1, 0.03),
    "vil_ls_medium": (39.8, 0.005),
    "vil_ls_medium_384": (39.9, 0.005),
    "vil_ls_base": (55.8, 0.005),
}
OFFICIAL_CODE_PARAMS = {
    "vil_ls_small": 24_666_529,
    "vil_ls_medium": 39_799_423,
    "vil_ls_medium_384": 39_947_653,
    "vil_ls_base": 55_834_363,
}


def _count(model):
    return sum(p.numel() for p in model.parameters())


def _reduced(name, **kwargs):
    """The entry with one block per stage on small images (widths, heads, attention kinds unchanged)."""
    if name in CVT:
        return timm.create_model(name, depths=(1, 1, 1), **kwargs), 64
    return timm.create_model(name, depths=(1, 1, 1, 1), img_size=64, **kwargs), 64


def test_registry():
    assert sorted(timm.list_models("*_ls_*")) == sorted(CVT + VIL)
    assert set(timm.list_models(module=["cvt_ls", "vil_ls"])) == set(CVT + VIL)
    assert timm.list_models("vil_ls*", pretrained=True) == [
        "vil_ls_base.nv_in1k",
        "vil_ls_medium.nv_in1k",
        "vil_ls_medium_384.nv_in1k",
    ]


@pytest.mark.parametrize("name", CVT + VIL)
def test_parameter_counts(name):
    with torch.device("meta"):
        model = timm.create_model(name)
    n = _count(model)
    if name in PAPER_PARAMS:
        paper, tol = PAPER_PARAMS[name]
        assert abs(n / 1e6 - paper) / paper <= tol, (name, n)
    if name in OFFICIAL_CODE_PARAMS:
        assert n == OFFICIAL_CODE_PARAMS[name]


@pytest.mark.parametrize("name", CVT + VIL)
def test_pretrained_cfg(name):
    with torch.device("meta"):
        model = timm.create_model(name)
    cfg = model.pretrained_cfg
    for key in ("input_size", "crop_pct", "interpolation", "mean", "std", "first_conv", "classifier", "license"):
        assert cfg.get(key) is not None, key
    keys = model.state_dict().keys()
    assert cfg["first_conv"] + ".weight" in keys and cfg["classifier"] + ".weight" in keys
    if name in VIL and name != "vil_ls_small":
        url, file_name = cfg["url"]
        assert url.startswith("https://www.dropbox.com/s/") and file_name.startswith(name) and cfg["fixed_input_size"]


@pytest.mark.parametrize("name", ON_TEST_DEVICE)
def test_forward_backward_and_grad_checkpointing(name, device):
    torch.manual_seed(0)
    model, size = _reduced(name, num_classes=7)
    model.to(device)
    x = torch.randn(2, 3, size, size, device=device)
    model.train()
    out = model(x)
    assert out.shape == (2, 7) and torch.isfinite(out).all()
    out.square().mean().backward()
    missing = {n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0}
    # As in the official ViL-LS: the global-query bias of a stage's last full-attention block only feeds the global
    # token, which is dropped before the next stage, so it cannot receive a gradient.
    dropped = {
        f"stages.{i}.blocks.{len(s.blocks) - 1}.attn.g2g_relative_position_bias" for i, s in enumerate(model.stages)
    }
    assert not missing - dropped
    model.eval()
    with torch.no_grad():
        ref = model(x)
        model.set_grad_checkpointing()
        torch.testing.assert_close(model(x), ref)

    def grads(checkpointing):  # training mode, where checkpointing recomputes the blocks in the backward
        model.set_grad_checkpointing(checkpointing)
        model.zero_grad()
        model.train()
        model(x.double()).square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.double()  # float64: some true gradients are 0 (biases that cancel in a softmax or a norm)
    plain, checkpointed = grads(False), grads(True)
    assert plain.keys() == checkpointed.keys()
    for n in plain:
        torch.testing.assert_close(checkpointed[n], plain[n], atol=1e-12, rtol=1e-9, msg=n)


@pytest.mark.parametrize("name", ON_TEST_DEVICE)
def test_features_and_intermediates(name, device, dtype):
    torch.manual_seed(0)
    model, size = _reduced(name)
    model.to(device, dtype).eval()
    x = torch.randn(1, 3, size, size).to(device, dtype)
    with torch.no_grad():
        final, inter = model.forward_intermediates(x)
        torch.testing.assert_close(final, model.forward_features(x))
        assert len(inter) == len(model.feature_info)
        for fmap, info in zip(inter, model.feature_info):
            assert fmap.shape[1] == info["num_chs"] and fmap.shape[-1] == -(-size // info["reduction"])
        last = model.forward_intermediates(x, indices=[-1], norm=True, intermediates_only=True)[0]
        if name in VIL:  # std layout: normed last map == forward_features
            torch.testing.assert_close(last, final)
    torch.manual_seed(0)  # the same initial weights
    features, _ = _reduced(name, features_only=True)
    with torch.no_grad():
        maps = features.to(device, dtype).eval()(x)
    assert [m.shape[1] for m in maps] == features.feature_info.channels()
    assert [-(-size // r) for r in features.feature_info.reduction()] == [m.shape[-1] for m in maps]
    for got, want in zip(maps, inter):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", ["cvt_ls_13", "vil_ls_small"])
def test_classifier_reset_and_pooling(name):
    model, size = _reduced(name)
    model.eval()
    x = torch.randn(2, 3, size, size)
    width = model.num_features
    with torch.no_grad():
        assert model.forward_head(model.forward_features(x), pre_logits=True).shape == (2, model.head_hidden_size)
        model.reset_classifier(0)
        assert model(x).shape == (2, width)
        model.reset_classifier(0, "")
        unpooled = model.forward_features(x)
        assert model.forward_head(unpooled, pre_logits=True).shape == unpooled.shape
        if name in CVT:  # unpooled tokens: a logit row per token, as timm's ViT
            model.reset_classifier(5)
            assert model(x).shape == (2, unpooled.shape[1], 5)
        model.reset_classifier(3, "avg")
        assert model(x).shape == (2, 3)
    assert model.get_classifier().out_features == 3
    if name in CVT:
        assert unpooled.shape == (2, 1 + (size // 16) ** 2, width)  # cls token + stage-3 patches
    else:
        assert unpooled.shape == (2, width, size // 32, size // 32)
        with pytest.raises(ValueError, match="global_pool"):
            model.reset_classifier(3, "token")
        with pytest.raises(ValueError, match="global_pool='avg'"):  # a classifier cannot take the unpooled map
            model.reset_classifier(3, "")
        with pytest.raises(ValueError, match="global_pool='avg'"):
            timm.create_model(name, depths=(1, 1, 1, 1), img_size=64, global_pool="")


@pytest.mark.parametrize("name", ["cvt_ls_13", "vil_ls_small"])
def test_pooled_features_values(name, device, dtype):
    """What the head pools: CvT-LS 'token' takes the cls token, its 'avg' the mean of the patch tokens only (the
    normed last map of forward_intermediates); ViL-LS 'avg' the mean over its map. The same through reset_classifier
    and create_model(global_pool=...), and the logits are the head on the pooled features."""
    torch.manual_seed(0)
    model, size = _reduced(name, num_classes=0)
    model.to(device, dtype).eval()
    x = torch.randn(2, 3, size, size).to(device, dtype)
    with torch.no_grad():
        features = model.forward_features(x)
        patches = model.forward_intermediates(x, indices=[-1], norm=True, intermediates_only=True)[0]  # (B, C, H, W)
        assert patches.shape[-2:] == (size // (16 if name in CVT else 32),) * 2
        want = {"avg": patches.mean((2, 3))}
        if name in CVT:
            assert features.shape[1] == 1 + patches.shape[-2] * patches.shape[-1]
            want["token"] = features[:, 0]
        else:
            torch.testing.assert_close(features, patches)
        for pool, pooled in want.items():
            model.reset_classifier(0, pool)
            torch.testing.assert_close(model.forward_head(features, pre_logits=True), pooled, msg=pool)
            torch.testing.assert_close(model(x), pooled, msg=pool)
            classifier, _ = _reduced(name, num_classes=3, global_pool=pool)
            classifier.to(device, dtype)
            missing, _ = classifier.load_state_dict(model.state_dict(), strict=False)  # the same backbone
            assert sorted(missing) == ["head.bias", "head.weight"]
            torch.testing.assert_close(classifier.eval()(x), classifier.head(pooled), msg=pool)


@pytest.mark.parametrize("name", ["cvt_ls_21s", "vil_ls_medium"])
def test_optimizer_helpers(name):
    model, _ = _reduced(name)
    no_decay = model.no_weight_decay()
    assert any("cls_token" in n for n in no_decay)
    assert any("relative_position" in n for n in no_decay) == (name in VIL)

    groups = group_parameters(model, model.group_matcher())
    assert sum(len(v) for v in groups.values()) == len(list(model.parameters()))
    ordered = [groups[k] for k in sorted(groups)]
    assert "stages.0.embed.proj.weight" in ordered[0] and "head.weight" in ordered[-1]
    assert len(ordered) > len(model.stages)  # stem, a group per block, head
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05, layer_decay=0.9)
    assert len(optimizer.param_groups) > 2


@pytest.mark.parametrize("prune_norm, prune_head", [(True, True), (False, False)], ids=["asked_pruned", "asked_kept"])
@pytest.mark.parametrize("name", ["cvt_ls_17", "vil_ls_base"])
def test_prune_intermediate_layers(name, prune_norm, prune_head):
    """Cutting later stages drops the final norm and the head (sized for the last stage) whatever prune_norm and
    prune_head say, as in timm's models; a new classifier then fits the kept stages, in the model's dtype."""
    model, size = _reduced(name)
    model.eval()
    x = torch.randn(1, 3, size, size)
    with torch.no_grad():
        want = model.forward_intermediates(x, indices=[0, 1], intermediates_only=True)
        assert model.prune_intermediate_layers(indices=[0, 1], prune_norm=prune_norm, prune_head=prune_head) == [0, 1]
        got = model.forward_intermediates(x, indices=[0, 1], intermediates_only=True)
        out = model(x)  # the pruned model's output: its last stage, unnormed (tokens if that stage has a global one)
    assert len(model.stages) == 2 and model.num_classes == 0 and model.num_features == want[-1].shape[1]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(
        to_map(out, model.num_prefix_tokens, want[-1].shape[-2:]) if out.ndim == 3 else out, want[-1]
    )
    model.to(torch.float64).reset_classifier(5, "avg")
    assert model.head.weight.dtype == torch.float64 and not model.head.training
    assert model(x.double()).shape == (1, 5)


@pytest.mark.parametrize("name", ["cvt_ls_13", "vil_ls_medium"])
def test_save_load_and_hub_round_trip(name, tmp_path):
    model, size = _reduced(name, num_classes=4)
    model.eval()
    x = torch.randn(1, 3, size, size)
    with torch.no_grad():
        ref = model(x)
    save_file(model.state_dict(), tmp_path / "weights.safetensors")
    reloaded, _ = _reduced(
        name,
        num_classes=4,
        pretrained=True,
        pretrained_cfg_overlay={"file": str(tmp_path / "weights.safetensors"), "num_classes": 4},
    )
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(x), ref)
    assert set(load_file(tmp_path / "weights.safetensors")) == set(model.state_dict())

    # timm's Hub format (config.json with the recorded model_args + weights), loaded back offline
    save_for_hf(model, tmp_path / "hub", safe_serialization=True)
    assert (tmp_path / "hub" / "config.json").exists() and (tmp_path / "hub" / "model.safetensors").exists()
    hub = timm.create_model(f"local-dir:{tmp_path / 'hub'}", pretrained=True)
    with torch.no_grad():
        torch.testing.assert_close(hub.eval()(x), ref)


def test_released_weights_load_from_their_own_cache_files(tmp_path, monkeypatch):
    """The official URLs all end in model_best.pth: each variant downloads to, and loads from, its own cache file
    (a checkpoint in the official ``{'net': ...}`` form placed there loads without a download)."""
    names = [timm.models.get_pretrained_cfg(n).url[1] for n in timm.list_models("vil_ls*", pretrained=True)]
    assert len(set(names)) == len(names) == 3
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    for seed, name in enumerate(["vil_ls_medium", "vil_ls_base"]):
        torch.manual_seed(seed)
        source, _ = _reduced(name)
        (tmp_path / "hub" / "checkpoints").mkdir(parents=True, exist_ok=True)
        torch.save(
            {"net": {"module." + k: v for k, v in source.state_dict().items()}},
            tmp_path / "hub" / "checkpoints" / timm.models.get_pretrained_cfg(name).url[1],
        )
        for num_classes in (1000, 7):  # the released head, or a new one for fine-tuning (timm drops the head)
            loaded, _ = _reduced(name, pretrained=True, num_classes=num_classes)
            kept = {k: v for k, v in source.state_dict().items() if num_classes == 1000 or not k.startswith("head.")}
            for key, value in kept.items():
                torch.testing.assert_close(loaded.state_dict()[key], value, msg=key)


def test_pretrained_without_a_download_names_the_local_file_fix(tmp_path, monkeypatch):
    """pretrained=True where the weights cannot be downloaded (here: their URL points at a closed local port, as
    offline) is an OSError that says how to load a downloaded copy, and leaves no weights file behind; the fix it
    names loads a checkpoint in the official form."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    with socket.socket() as sock:  # a port that was free a moment ago: the connection is refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = (f"http://127.0.0.1:{port}/model_best.pth", "vil_ls_medium_unreachable.pth")
    with pytest.raises(OSError, match="could not be downloaded") as err:
        _reduced("vil_ls_medium", pretrained=True, pretrained_cfg_overlay={"url": url, "custom_load": True})
    message = str(err.value)
    assert message.startswith("vil_ls_medium: ")
    assert "pretrained_cfg_overlay=dict(file='model_best.pth')" in message and "--pretrained-file" in message
    assert not [path for path in tmp_path.rglob("*") if path.is_file()]

    torch.manual_seed(0)
    source, _ = _reduced("vil_ls_medium")
    torch.save({"net": {"module." + k: v for k, v in source.state_dict().items()}}, tmp_path / "model_best.pth")
    loaded, _ = _reduced(
        "vil_ls_medium", pretrained=True, pretrained_cfg_overlay={"file": str(tmp_path / "model_best.pth")}
    )
    for key, value in source.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, msg=key)


def test_meta_device_creation_then_load():
    """timm's meta-device path: create on meta, materialise, load weights, rebuild the non-persistent buffers."""
    reinit = pytest.importorskip("timm.models._manipulate").reinit_non_persistent_buffers
    torch.manual_seed(0)
    ref, size = _reduced("vil_ls_small")
    with torch.device("meta"):
        model, _ = _reduced("vil_ls_small")
    model = model.to_empty(device="cpu")
    model.load_state_dict(ref.state_dict())
    assert reinit(model)  # the full-attention stages' relative position index
    x = torch.randn(1, 3, size, size)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), ref.eval()(x))


def test_paper_resolution_settings():
    """Appendix E: r and w per input size for CvT*-LS (or one value for every stage); ViL-LS-Medium at 384 uses
    w = 8."""

    def settings(**kwargs):
        with torch.device("meta"):
            model = timm.create_model("cvt_ls_21", **kwargs)
        attn = [stage.blocks[0].attn for stage in model.stages]
        return [a.projection_rank for a in attn], [a.window_size for a in attn]

    for size, (ranks, windows) in PAPER_SETTINGS.items():
        assert settings(img_size=size) == (list(ranks), list(windows))
    assert settings(img_size=448, projection_rank=0, window_size=4) == ([0, 0, 0], [4, 4, 4])
    with torch.device("meta"):
        vil = timm.create_model("vil_ls_medium_384")
    assert vil.stages[0].blocks[0].attn.window_size == 8 and vil.pretrained_cfg["input_size"] == (3, 384, 384)


def test_any_input_size_pads_to_the_window():
    model, _ = _reduced("cvt_ls_13", num_classes=3)
    with torch.no_grad():  # maps 25x19, 13x10, 7x5: none a multiple of w = 8, 4, 2
        assert model.eval()(torch.randn(1, 3, 100, 76)).shape == (1, 3)


def test_bad_inputs_raise_clear_errors():
    vil, _ = _reduced("vil_ls_small")
    with pytest.raises(ValueError, match="img_size"):
        vil(torch.randn(1, 3, 96, 96))
    with pytest.raises(ValueError, match="img_size"):
        timm.create_model("vil_ls_small", img_size=16)
    with pytest.raises(ValueError, match="embed_dims"):
        timm.create_model("cvt_ls_13", depths=(1, 1))
    with pytest.raises(ValueError, match="window_size"):
        timm.create_model("cvt_ls_13", window_size=(8, 0, 2))
    with pytest.raises(ValueError, match="window_size needs one entry per stage"):
        timm.create_model("cvt_ls_13", window_size=(8, 4))
    with pytest.raises(ValueError, match="global_pool"):
        timm.create_model("cvt_ls_13", global_pool="max")
    with pytest.raises(ValueError, match="feature_cls='fx' is not supported"):
        timm.create_model("cvt_ls_13", features_only=True, feature_cls="fx")
    with pytest.raises(ValueError, match=r"qk_head_dims\[2\]"):  # stage 3 of ViL-LS has full attention, no LMSA
        timm.create_model("vil_ls_small", qk_head_dims=(None, None, 32, None))


@pytest.mark.parametrize("name", ["cvt_ls_13", "vil_ls_small"])
def test_compiles_without_graph_breaks(name):
    model, size = _reduced(name)
    model.eval()
    x = torch.randn(1, 3, size, size)
    try:
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        with torch.no_grad():
            out = compiled(x)
    except RuntimeError as err:
        if "Dynamo is not supported" in str(err):
            pytest.skip(str(err))
        raise
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))


@pytest.mark.parametrize("name", ["cvt_ls_13", "vil_ls_small"])
def test_fx_trace_and_torch_export_match_forward(name):
    """timm's FX tracing (each stage a leaf) and ``torch.export`` both reproduce the eager forward. (TorchScript is
    not supported: ``torch.compile`` and ``torch.export`` are its successors.)"""
    model, size = _reduced(name)
    model.eval()
    x = torch.randn(2, 3, size, size)
    traced = timm.models.create_feature_extractor(model, return_nodes={"head": "logits"})
    exported = torch.export.export(model, (x,)).module()
    with torch.no_grad():
        want = model(x)
        torch.testing.assert_close(traced(x)["logits"], want)
        torch.testing.assert_close(exported(x), want)


def test_state_dicts_under_the_earlier_parameter_names_load(tmp_path):
    """A CvT*-LS with LMSA saved when the 2-D attention named its parameters ``dynamic_proj``, ``dual_ln_local_k`` and
    ``dual_ln_global_k`` (fixture: ``tests/fixtures/cvt_ls_earlier_names.safetensors``, its logits then) loads under
    today's names (``dynamic_projection``, ``dual_ln_*_key``), directly and through timm's pretrained-file loader, and
    gives the same logits."""
    saved = load_file(FIXTURES / "cvt_ls_earlier_names.safetensors")
    state = {k.removeprefix("param."): v for k, v in saved.items() if k.startswith("param.")}
    assert any(".dynamic_proj." in k for k in state) and any(".dual_ln_global_k." in k for k in state)
    kwargs = {
        "img_size": 32,
        "num_classes": 3,
        "embed_dims": (4, 8, 8),
        "depths": (1, 1, 1),
        "num_heads": (2, 2, 2),
        "qk_head_dims": (1, 2, None),
    }  # saved with qk_dims=(2, 4, None): query/key widths in all
    model = timm.create_model("cvt_ls_13", **kwargs)
    model.load_state_dict(state)
    assert not any(".dynamic_proj." in k or k.endswith(("_k.weight", "_k.bias")) for k in model.state_dict())
    save_file(state, tmp_path / "earlier.safetensors")
    loaded = timm.create_model(
        "cvt_ls_13",
        pretrained=True,
        pretrained_cfg_overlay={"file": str(tmp_path / "earlier.safetensors"), "num_classes": 3},
        **kwargs,
    )
    with torch.no_grad():
        for m in (model, loaded):
            torch.testing.assert_close(m.eval()(saved["fixture.input"]), saved["fixture.logits"])

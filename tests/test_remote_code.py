"""Hub remote code: a saved folder loads with trust_remote_code=True in a process where ls_hf cannot be imported."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ls_hf import LongShortForCausalLM, LongShortForMaskedLM
from ls_hf.hub import REMOTE_CODE_FILES, save_for_hub
from ls_hf.modeling_long_short import AUTO_CLASSES

from .test_modeling import tiny_config, tokens

# Runs in a fresh interpreter: `import ls_hf` is made to fail, so only the folder's own code can build the models.
CLEAN_PROCESS = textwrap.dedent(
    """
    import sys
    sys.modules["ls_hf"] = None  # the package is installed in this venv; make it unimportable
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM
    mlm_dir, clm_dir, ids_path, out_path = sys.argv[1:]
    ids = torch.load(ids_path)
    config = AutoConfig.from_pretrained(mlm_dir, trust_remote_code=True)
    mlm = AutoModelForMaskedLM.from_pretrained(mlm_dir, trust_remote_code=True)
    base = AutoModel.from_pretrained(mlm_dir, trust_remote_code=True)
    clm = AutoModelForCausalLM.from_pretrained(clm_dir, trust_remote_code=True)
    assert "ls_hf" not in {m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}
    with torch.no_grad():
        result = {
            "modules": sorted({type(m).__module__.split(".")[0] for m in (config, mlm, base, clm)}),
            "classes": [type(m).__name__ for m in (config, mlm, base, clm)],
            "mlm_logits": mlm(ids).logits,
            "base_hidden": base(ids).last_hidden_state,
            "generated": clm.generate(ids, max_new_tokens=6, do_sample=False),
        }
    torch.save(result, out_path)
    """
)


def test_saved_folder_loads_without_the_package(tmp_path):
    torch.manual_seed(0)
    mlm = LongShortForMaskedLM(tiny_config()).eval()
    clm = LongShortForCausalLM(tiny_config(is_decoder=True)).eval()
    clm.generation_config.eos_token_id = None
    save_for_hub(mlm, tmp_path / "mlm")
    clm.save_pretrained(tmp_path / "clm")  # plain save_pretrained writes the same remote code and auto_map

    for folder in (tmp_path / "mlm", tmp_path / "clm"):
        assert all((folder / name).is_file() for name in REMOTE_CODE_FILES)
        auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
        assert set(auto_map) == {"AutoConfig", *AUTO_CLASSES}
    ids = tokens(2, 13)
    torch.save(ids, tmp_path / "ids.pt")
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    subprocess.run(
        [
            sys.executable,
            "-c",
            CLEAN_PROCESS,
            str(tmp_path / "mlm"),
            str(tmp_path / "clm"),
            str(tmp_path / "ids.pt"),
            str(tmp_path / "out.pt"),
        ],
        check=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    result = torch.load(tmp_path / "out.pt")
    assert result["modules"] == ["transformers_modules"]
    assert result["classes"] == ["LongShortConfig", "LongShortForMaskedLM", "LongShortModel", "LongShortForCausalLM"]
    with torch.no_grad():
        torch.testing.assert_close(result["mlm_logits"], mlm(ids).logits)
        torch.testing.assert_close(result["base_hidden"], mlm.long_short(ids).last_hidden_state)
        assert torch.equal(result["generated"], clm.generate(ids, max_new_tokens=6, do_sample=False))


def test_save_for_hub_refuses_bad_targets_and_leaves_nothing_behind(tmp_path):
    model = LongShortForMaskedLM(tiny_config())
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    with pytest.raises(ValueError, match="not an empty directory"):
        save_for_hub(model, tmp_path / "taken")
    with pytest.raises(TypeError, match="LongShort model"):
        save_for_hub(torch.nn.Linear(2, 2), tmp_path / "linear")
    with pytest.raises(AttributeError):  # fails after the weights were written: the staging folder is removed
        save_for_hub(model, tmp_path / "bad", tokenizer=object())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]

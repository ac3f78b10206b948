"""Saving writes safetensors, the model code and a complete auto_map; a fresh process without the package loads it."""

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import delta_attention  # noqa: F401  (registers the Auto classes)
from conftest import HYBRID_LAYERS, tiny_delta_model
from isolated import load_isolated

MODELING = Path(delta_attention.modeling.__file__).parent


def relative_imports(path: Path) -> set[str]:
    """Files a module imports in the one form the Hub copies (`from .name import X`); refuses the other forms."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            assert node.level == 1 and node.module, f"{path.name}: only `from .module import X` ships with checkpoints"
            names.add(node.module + ".py")
    return names


def reachable_code(start: str) -> set[str]:
    """`start` and every file reachable from it through relative imports, in the modeling folder."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(relative_imports(MODELING / name))
    return seen


def test_the_model_code_imports_only_its_own_folder_in_the_shipped_form():
    shipped = reachable_code("modeling_delta.py")
    assert {"configuration_delta.py", "delta_rule.py", "delta_reference.py", "delta_cache.py"} <= shipped
    # every file of the folder except the package's own `__init__.py` ships (nothing there is dead code)
    assert shipped == {path.name for path in MODELING.glob("*.py")} - {"__init__.py"}


@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_save_then_load_in_a_fresh_process_without_the_package(tmp_path, gate):
    model = tiny_delta_model(num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6, linear_gate=gate)
    folder = tmp_path / "model"
    model.save_pretrained(folder)

    files = set(os.listdir(folder))
    assert {"config.json", "model.safetensors", "modeling_delta.py", "configuration_delta.py", "delta_rule.py"} <= files
    # exactly the code the model imports
    assert {name for name in files if name.endswith(".py")} == reachable_code("modeling_delta.py")
    assert not any(name.endswith((".bin", ".pt", ".pth")) for name in files)
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert auto_map == {
        "AutoConfig": "configuration_delta.DeltaConfig",
        "AutoModel": "modeling_delta.DeltaModel",
        "AutoModelForCausalLM": "modeling_delta.DeltaForCausalLM",
    }

    input_ids = [[5, 9, 17, 33, 2, 41, 8, 8, 60]]
    out = load_isolated(folder, input_ids, tmp_path)
    assert out["classes"] == ["DeltaForCausalLM", "DeltaModel"]
    with torch.no_grad():
        logits = model(torch.tensor(input_ids)).logits
        hidden = model.model(torch.tensor(input_ids)).last_hidden_state
    assert torch.equal(out["logits"], logits)
    assert torch.equal(out["hidden"], hidden)
    assert torch.equal(out["generated"], model.generate(torch.tensor(input_ids)[:1, :6], max_new_tokens=8,
                                                        do_sample=False))


def test_reload_with_the_package_uses_the_registered_classes(tmp_path):
    model = tiny_delta_model(linear_gate="none")
    model.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    assert type(config) is delta_attention.DeltaConfig
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    base = AutoModel.from_pretrained(tmp_path)
    assert type(again) is delta_attention.DeltaForCausalLM and type(base) is delta_attention.DeltaModel
    input_ids = torch.tensor([[4, 5, 6, 7]])
    with torch.no_grad():  # to float32 rounding: the loaded weights sit elsewhere in memory (test_few_rows_linear.py)
        expected = model(input_ids).logits
        assert (again(input_ids).logits - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_without_trust_remote_code_the_error_says_what_to_do(tmp_path):
    tiny_delta_model().save_pretrained(tmp_path)
    script = textwrap.dedent(
        """
        import sys
        from transformers import AutoModelForCausalLM
        try:
            AutoModelForCausalLM.from_pretrained(sys.argv[1])
        except Exception as error:
            print(type(error).__name__, error)
        """
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True)
    assert "trust_remote_code=True" in result.stdout, result.stdout + result.stderr

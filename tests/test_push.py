"""`push` against a local stand-in of the Hub reached through HF_ENDPOINT: what is committed, and refusals."""

import json

import pytest
import yaml
from huggingface_hub import ModelCard

from conftest import HYBRID_LAYERS, tiny_delta_model, tiny_tokenizer
from delta_attention.conversion.hub import PushOptions, push
from hub_server import TOKEN, FakeHub

CARD = """---
tags:
- delta-attention
model-index:
- name: tiny
  results:
  - task:
      type: text-generation
    dataset:
      name: held-out text
      type: text
    metrics:
    - type: perplexity
      value: 12.5
---

# tiny

```python
model = AutoModelForCausalLM.from_pretrained("some/local/folder")
```
"""


@pytest.fixture
def hub(monkeypatch):
    with FakeHub() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        yield server


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    tiny_delta_model(num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    (folder / "README.md").write_text(CARD)
    config = json.loads((folder / "config.json").read_text())
    config["conversion_source"] = str(tmp_path_factory.getbasetemp() / "models" / "source.gguf")
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "conversion.json").write_text(json.dumps({"source": {"spec": config["conversion_source"], "kind": "gguf"}}))
    return folder


def snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_push_commits_weights_code_config_tokenizer_and_our_card(hub, model_folder):
    before = snapshot(model_folder)
    url = push(PushOptions(folder=str(model_folder), repo_id="me/tiny-delta", base_model="HuggingFaceTB/SmolLM2-135M",
                           license="apache-2.0", datasets="stdlib/sotu", private=True))
    assert snapshot(model_folder) == before  # the local folder is untouched
    assert hub.unknown == [] and len(hub.commits) == 1 and url.startswith(f"{hub.endpoint}/me/tiny-delta/commit/")
    commit = hub.commits[0]
    assert hub.repos["me/tiny-delta"]["private"] is True
    files = commit["files"]
    assert {"model.safetensors", "modeling_delta.py", "configuration_delta.py", "delta_rule.py", "config.json",
            "tokenizer.json", "tokenizer_config.json", "README.md"} <= set(files)
    assert not any(name.endswith((".bin", ".pt")) for name in files)
    assert set(json.loads(files["config.json"])["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}

    card_text = files["README.md"].decode()
    metadata = yaml.safe_load(card_text.split("---")[1])
    assert metadata["base_model"] == "HuggingFaceTB/SmolLM2-135M" and metadata["license"] == "apache-2.0"
    assert metadata["library_name"] == "transformers" and metadata["pipeline_tag"] == "text-generation"
    assert {"delta-attention", "linear-attention", "gated-deltanet"} <= set(metadata["tags"])
    assert metadata["datasets"] == ["stdlib/sotu"]
    assert metadata["model-index"][0]["results"][0]["metrics"][0]["value"] == 12.5
    assert 'from_pretrained("me/tiny-delta")' in card_text and "some/local/folder" not in card_text
    assert TOKEN not in card_text and all(TOKEN.encode() not in content for content in files.values())
    # no path of the pushing machine leaves it: the recorded source becomes the base model's Hub id
    assert all(str(model_folder.parent).encode() not in content for content in files.values())
    assert json.loads(files["config.json"])["conversion_source"] == "HuggingFaceTB/SmolLM2-135M"
    assert json.loads(files["conversion.json"])["source"]["spec"] == "HuggingFaceTB/SmolLM2-135M"
    assert ModelCard(card_text).data.base_model == "HuggingFaceTB/SmolLM2-135M"


def test_push_to_a_branch_or_as_a_pull_request(hub, model_folder):
    push(PushOptions(folder=str(model_folder), repo_id="me/tiny-delta", revision="v1"))
    url = push(PushOptions(folder=str(model_folder), repo_id="me/tiny-delta", create_pr=True))
    assert hub.commits[0]["revision"] == "v1" and "v1" in hub.repos["me/tiny-delta"]["branches"]
    assert hub.commits[1]["create_pr"] and url.endswith("/discussions/1")


def test_adapter_push_carries_the_hub_id_not_a_local_path(hub, tmp_path, model_folder):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_folder),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(model_folder)

    with pytest.raises(ValueError, match="base model is a local folder; pass --base_model OWNER/NAME"):
        push(PushOptions(folder=str(tmp_path / "adapter"), repo_id="me/tiny-lora"))
    assert hub.commits == []
    push(PushOptions(folder=str(tmp_path / "adapter"), repo_id="me/tiny-lora", base_model="me/tiny-delta"))
    files = hub.commits[0]["files"]
    assert json.loads(files["adapter_config.json"])["base_model_name_or_path"] == "me/tiny-delta"
    assert str(model_folder) not in files["README.md"].decode()
    metadata = yaml.safe_load(files["README.md"].decode().split("---")[1])
    assert metadata["base_model"] == "me/tiny-delta" and metadata["library_name"] == "peft"
    # the local adapter still points at the local base
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(model_folder)


def test_no_token_fails_clearly_and_pushes_nothing(hub, monkeypatch, model_folder, tmp_path):
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-home"))
    with pytest.raises(ValueError, match=r"no Hugging Face token found: run `hf auth login` or set HF_TOKEN"):
        push(PushOptions(folder=str(model_folder), repo_id="me/tiny-delta"))
    assert hub.repos == {} and hub.commits == []


def test_a_refused_repo_fails_clearly_and_leaves_the_folder_untouched(hub, model_folder):
    before = snapshot(model_folder)
    with pytest.raises(ValueError, match=r"the Hub refused the push to someone/forbidden-model \(HTTP 403: "
                                         r"You don't have the rights"):
        push(PushOptions(folder=str(model_folder), repo_id="someone/forbidden-model"))
    assert snapshot(model_folder) == before and hub.commits == []


def test_folders_that_are_not_models_are_refused(hub, tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"pickle")
    with pytest.raises(ValueError, match=r"pickle weight files \['weights.bin'\]"):
        push(PushOptions(folder=str(tmp_path), repo_id="me/x"))
    (tmp_path / "weights.bin").unlink()
    with pytest.raises(ValueError, match="neither a model folder"):
        push(PushOptions(folder=str(tmp_path), repo_id="me/x"))

"""`push` against a local stand-in of the Hub reached through HF_ENDPOINT: what is committed, and refusals."""

import importlib
import json
import os
import socket

import pytest
import requests
import yaml
from huggingface_hub import HfApi, ModelCard
from huggingface_hub.errors import OfflineModeIsEnabled

from conftest import HYBRID_LAYERS, tiny_delta_model, tiny_tokenizer
from delta_attention.conversion.publishing import hub as hub_module
from delta_attention.conversion.publishing.hub import PushOptions, is_pickle_name, push
from delta_attention.scripts.cli import main
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


def small_model_folder(path):
    """The least `push` takes for a model: config.json and a .safetensors file (content not checked)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"weights")
    return path


def tree(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", ["extra/optimizer.pt", "model.PT", "state.pickle", "scaler.joblib",
                                  "model.pth.tar", "deep/er/opt.pt.tar", "Weights.Bin", "rng.pkl.gz"])
def test_pickles_anywhere_in_any_case_or_wrapping_are_refused(hub, tmp_path, name):
    folder = small_model_folder(tmp_path / "model")
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(b"pickle")
    with pytest.raises(ValueError, match=rf"pickle weight files \['{name}'\]; re-save them as safetensors"):
        push(PushOptions(folder=str(folder), repo_id="me/x"))
    assert hub.repos == {} and hub.commits == []


def test_pickle_names_are_matched_on_the_last_real_suffix():
    assert is_pickle_name("a.PTH") and is_pickle_name("a.ckpt.tar.gz") and is_pickle_name("a.joblib.zip")
    assert not is_pickle_name("README.pt.md") and not is_pickle_name("data.tar") and not is_pickle_name("bin")


def test_skipped_and_hidden_entries_stay_home_at_every_depth(hub, tmp_path):
    folder = small_model_folder(tmp_path / "model")
    for name in ["extra/notes.txt", "extra/checkpoints/step-1/optimizer.pt", "extra/.cache/blob",
                 "extra/.git/config", "extra/.secret", "checkpoints/last/model.bin", ".hidden/state.pkl"]:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"x")
    push(PushOptions(folder=str(folder), repo_id="me/x"))
    assert set(hub.commits[0]["files"]) == {"config.json", "model.safetensors", "extra/notes.txt", "README.md"}


@pytest.mark.parametrize("link", ["leak.txt", "extra/leak.txt", "shared"])
def test_a_link_leaving_the_folder_is_refused_and_nothing_is_pushed(hub, tmp_path, link):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "id_rsa").write_text("secret")
    folder = small_model_folder(tmp_path / "model")
    (folder / link).parent.mkdir(parents=True, exist_ok=True)
    target = outside if link == "shared" else outside / "id_rsa"
    os.symlink(target, folder / link)
    with pytest.raises(ValueError) as refused:
        push(PushOptions(folder=str(folder), repo_id="me/x"))
    message = str(refused.value)
    assert f"{link} is a symbolic link to {target}, outside the folder" in message and "remove the link" in message
    assert hub.repos == {} and hub.commits == []


def test_a_link_that_stays_inside_goes_up_as_its_targets_content(hub, tmp_path):
    folder = small_model_folder(tmp_path / "model")
    (folder / "sub").mkdir()
    (folder / "sub" / "vocab.txt").write_text("a b c")
    os.symlink("sub/vocab.txt", folder / "vocab.txt")
    os.symlink("sub", folder / "same")
    push(PushOptions(folder=str(folder), repo_id="me/x"))
    files = hub.commits[0]["files"]
    assert files["vocab.txt"] == files["same/vocab.txt"] == files["sub/vocab.txt"] == b"a b c"


@pytest.mark.parametrize("link, target, problem", [
    ("loop", ".", "a folder that contains it"),
    ("gone.json", "missing.json", "which does not exist"),
    ("weights.safetensors", "checkpoints/optimizer.pt", "the pickle weight file"),
])
def test_links_that_loop_dangle_or_hide_a_pickle_are_refused(hub, tmp_path, link, target, problem):
    folder = small_model_folder(tmp_path / "model")
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "optimizer.pt").write_bytes(b"pickle")
    os.symlink(target, folder / link)
    with pytest.raises(ValueError, match=f"{link} is a symbolic link to (.* )?{problem}"):
        push(PushOptions(folder=str(folder), repo_id="me/x"))
    assert hub.repos == {} and hub.commits == []


@pytest.mark.parametrize("repo_id", ["me/bad name", "me/tiny/extra", "me/x..y", "me/-x", "me/x.git", "ü/x"])
def test_a_bad_repo_id_is_refused_before_anything_is_staged(hub, tmp_path, monkeypatch, repo_id):
    folder = small_model_folder(tmp_path / "model")
    monkeypatch.setattr(hub_module, "_stage", lambda *args: pytest.fail("the folder was staged"))
    with pytest.raises(ValueError, match=r"is not a Hub repo id: write OWNER/NAME or NAME.*nothing was pushed"):
        push(PushOptions(folder=str(folder), repo_id=repo_id))
    assert hub.repos == {} and hub.commits == []


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_an_unreachable_hub_gives_one_clear_line_without_the_token(tmp_path, monkeypatch, capsys):
    port = closed_port()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    folder = small_model_folder(tmp_path / "model")
    before = tree(folder)
    with pytest.raises(ValueError) as failed:
        push(PushOptions(folder=str(folder), repo_id="me/x"))
    message = str(failed.value)
    assert f"could not reach the Hub at 127.0.0.1:{port}" in message
    assert "Nothing was pushed; the local folder is unchanged." in message
    assert TOKEN not in message and "\n" not in message and tree(folder) == before

    assert main(["push", str(folder), "--repo_id", "me/x"]) == 1
    out, err = capsys.readouterr()
    assert err.startswith(f"delta-attention push: error: could not reach the Hub at 127.0.0.1:{port}")
    assert err.count("\n") == 1 and TOKEN not in out + err


def _http_client():
    for name in ("httpx", "httpx2"):  # whichever huggingface_hub uses
        try:
            return importlib.import_module(name)
        except ImportError:
            pass
    pytest.skip("no httpx")


@pytest.mark.parametrize("error", [
    lambda: requests.exceptions.ConnectionError(f"refused; Authorization: Bearer {TOKEN}"),
    lambda: requests.exceptions.Timeout("read timed out"),
    lambda: _http_client().ReadTimeout(f"timed out with {TOKEN}"),
    lambda: _http_client().ConnectError("[Errno -2] Name or service not known"),
    lambda: socket.gaierror(-2, "Name or service not known"),
    lambda: OfflineModeIsEnabled("HF_HUB_OFFLINE is set"),
    lambda: TimeoutError(),
])
def test_network_errors_become_one_line_that_never_shows_the_token(hub, tmp_path, monkeypatch, error):
    def unreachable(*args, **kwargs):
        raise error()

    monkeypatch.setattr(HfApi, "create_repo", unreachable)
    folder = small_model_folder(tmp_path / "model")
    with pytest.raises(ValueError, match=r"could not reach the Hub at 127\.0\.0\.1:\d+ \(\w+") as failed:
        push(PushOptions(folder=str(folder), repo_id="me/x"))
    assert TOKEN not in str(failed.value) and "\n" not in str(failed.value)
    assert "Nothing was pushed; the local folder is unchanged." in str(failed.value)

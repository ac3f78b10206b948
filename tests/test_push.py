"""`push` against a local stand-in of the Hub reached through HF_ENDPOINT: what is committed, and refusals."""

import hashlib
import importlib
import json
import os
import re
import socket
import subprocess
import sys

import huggingface_hub.constants
import pytest
import requests
import torch
import yaml
from huggingface_hub import HfApi, ModelCard
from huggingface_hub.errors import OfflineModeIsEnabled

from conftest import HYBRID_LAYERS, tiny_delta_model, tiny_tokenizer
from isolated import LOADER
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
    """The stand-in Hub; the client uploads large files through LFS (the stand-in does not speak Xet)."""
    with FakeHub() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
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


# --------------------------------------------------------------------------------------------------- LFS

def test_safetensors_go_up_through_lfs_with_their_sha256_and_size(hub, model_folder):
    push(PushOptions(folder=str(model_folder), repo_id="me/tiny-delta"))
    weights = (model_folder / "model.safetensors").read_bytes()
    oid = hashlib.sha256(weights).hexdigest()
    commit = hub.commits[0]
    assert commit["lfs_files"]["model.safetensors"] == {"path": "model.safetensors", "algo": "sha256", "oid": oid,
                                                        "size": len(weights)}
    assert hub.lfs_objects[oid] == weights and commit["files"]["model.safetensors"] == weights
    assert {"oid": oid, "size": len(weights)} in hub.lfs_verified
    assert [o["oid"] for batch in hub.lfs_batches for o in batch["objects"]] == [oid]  # only the weights
    assert "config.json" not in commit["lfs_files"] and "README.md" not in commit["lfs_files"]
    assert hub.xet_requests == []


def test_a_client_that_speaks_xet_is_refused_in_one_clear_line(hub, model_folder, monkeypatch):
    pytest.importorskip("hf_xet")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", False)
    with pytest.raises(ValueError, match="501 Not Implemented") as failed:
        push(PushOptions(folder=str(model_folder), repo_id="me/tiny-delta"))
    assert hub.xet_requests and hub.commits == [] and "\n" not in str(failed.value)


# ----------------------------------------------------------------------- real cards: no local path, usage runs

LLAMA = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAST = ["--calibration-seq-len", "32", "--calibration-tokens", "64", "--init", "copy", "--quiet"]
TRAIN = ["--seq_len", "16", "--batch_size", "2", "--mixed_precision", "no"]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """What the commands write from a tiny Llama source: `convert`, `distill` and `finetune --merge` folders."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("written")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(root / "source")
    tiny_tokenizer().save_pretrained(root / "source")
    (root / "train.txt").write_text(" ".join(f"w{i % 50}" for i in range(2000)))
    assert main(["convert", str(root / "source"), "--out", str(root / "converted"), "--keep-attention", "0",
                 *FAST]) == 0
    assert main(["distill", str(root / "converted"), "--teacher", str(root / "source"), "--output_dir",
                 str(root / "distill"), "--dataset", str(root / "train.txt"), "--eval_dataset",
                 str(root / "train.txt"), "--stage1_tokens", "64", "--stage2_tokens", "64", "--eval_tokens", "64",
                 "--lora_r", "2", *TRAIN]) == 0
    assert main(["finetune", str(root / "converted"), "--dataset", str(root / "train.txt"), "--output_dir",
                 str(root / "finetune"), "--max_tokens", "64", "--lora_r", "2", "--merge", *TRAIN]) == 0
    return {"root": root, "converted": root / "converted", "distilled": root / "distill" / "model",
            "finetuned": root / "finetune" / "merged"}


KINDS = ["converted", "distilled", "finetuned"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("base_model", [None, "HuggingFaceTB/SmolLM2-135M"])
def test_no_path_of_this_machine_leaves_it_in_any_pushed_file(hub, written, kind, base_model):
    folder, root = written[kind], str(written["root"])
    (folder / "notes.txt").write_text(f"trained from {root}/source on {root}/train.txt; home {os.path.expanduser('~')}\n")
    if kind == "converted":
        assert f"source: `{root}/source`" in (folder / "README.md").read_text()  # the card names its source
    push(PushOptions(folder=str(folder), repo_id=f"me/tiny-{kind}", base_model=base_model))
    files = hub.commits[0]["files"]
    assert {"README.md", "config.json", "notes.txt", "model.safetensors"} <= set(files)
    home = os.path.expanduser("~").encode()
    leaks = [name for name, content in files.items() if root.encode() in content or home in content]
    assert leaks == []
    assert "train.txt" in files["notes.txt"].decode()  # a path becomes its file name
    if base_model and kind == "converted":
        assert f"`{base_model}`" in files["README.md"].decode()  # the card's source line: the base model's id
        assert json.loads(files["conversion.json"])["source"]["spec"] == base_model
    (folder / "notes.txt").unlink()


def python_block(card_text: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", card_text, flags=re.S)
    assert len(blocks) == 1, card_text
    return blocks[0]


@pytest.mark.parametrize("kind", KINDS)
def test_the_usage_snippet_of_every_written_card_runs_as_written_without_the_package(written, kind, tmp_path):
    folder = written[kind]
    code = python_block((folder / "README.md").read_text())
    code = hub_module._point_usage_at(code, str(folder))  # the snippet as it reads once the folder is on the Hub
    block = LOADER.split("import torch")[0]  # the meta-path finder that blocks delta_attention
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", block + code + "\nprint(type(model).__name__, len(tokenizer))"],
                          env=env, capture_output=True, text=True, cwd=str(tmp_path), stdin=subprocess.DEVNULL,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["DeltaForCausalLM", "97"]


def test_a_merged_fine_tune_has_a_card_with_its_recipe(written):
    card = ModelCard.load(written["finetuned"] / "README.md")
    assert "fine-tuned" in card.data.tags and card.data.library_name == "transformers"
    assert "`converted`" in card.text and "`train.txt`" in card.text  # base and data, by name
    assert "LoRA: rank 2, alpha 32, dropout 0.05, target modules `all-linear`, merged" in card.text
    assert re.search(r"64 tokens in \d+ steps, learning rate 0.0002; final training loss \d", card.text)
    assert str(written["root"]) not in card.text


def test_the_adapter_card_snippet_trusts_the_remote_code(hub, written, tmp_path):
    push(PushOptions(folder=str(written["root"] / "finetune" / "adapter"), repo_id="me/tiny-lora",
                     base_model="me/tiny-converted"))
    code = python_block(hub.commits[0]["files"]["README.md"].decode())
    assert code.count("trust_remote_code=True") == 2 and "import delta_attention" not in code


def test_a_recorded_source_that_is_gone_still_becomes_the_base_model_id(hub, tmp_path):
    folder = small_model_folder(tmp_path / "model")
    gone = str(tmp_path / "moved-away" / "source")
    (folder / "config.json").write_text(json.dumps({"conversion_source": gone}))
    (folder / "README.md").write_text(f"source: `{gone}`, data {tmp_path}/train.jsonl\n")
    push(PushOptions(folder=str(folder), repo_id="me/x", base_model="me/base"))
    files = hub.commits[0]["files"]
    assert json.loads(files["config.json"])["conversion_source"] == "me/base"
    assert "source: `me/base`, data train.jsonl" in files["README.md"].decode()
    assert not any(str(tmp_path).encode() in content for content in files.values())

"""`finetune`: LoRA SFT of a tiny delta model on chat data; the adapter reloads both ways and merges exactly."""

import json

import pytest
import torch
from peft import AutoPeftModelForCausalLM, PeftModel
from transformers import AutoModelForCausalLM

from conftest import HYBRID_LAYERS, tiny_delta_model, tiny_tokenizer
from delta_attention.conversion.data.chat import IGNORE_INDEX, conversation_tokens
from delta_attention.conversion.training.finetune import FinetuneOptions, run_finetune
from delta_attention.conversion.training.metrics import read_metrics
from delta_attention.conversion.data.text import DataOptions
from delta_attention.conversion.training.lora import LoraOptions
from delta_attention.conversion.training.loop import TrainingOptions


def conversation(seed):
    g = torch.Generator().manual_seed(seed)
    words = lambda n: " ".join(f"w{i}" for i in torch.randint(0, 30, (n,), generator=g).tolist())  # noqa: E731
    # the answer is a fixed function of the question, so there is something to learn
    question = words(6)
    answer = " ".join(f"w{int(w[1:]) + 40}" for w in question.split())
    return [{"role": "system", "content": "w89"}, {"role": "user", "content": question},
            {"role": "assistant", "content": answer}]


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("base")
    tiny_delta_model(seed=2, num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_completion_only_labels_cover_the_assistant_turn():
    tokenizer = tiny_tokenizer()
    messages = conversation(0)
    ids, labels = conversation_tokens(tokenizer, messages)
    text = tokenizer.decode([i for i, l in zip(ids, labels) if l != IGNORE_INDEX])
    assert text.split() == messages[2]["content"].split() + ["<eos>"]
    _, all_labels = conversation_tokens(tokenizer, messages, completion_only=False)
    assert all_labels == ids


def test_lora_finetune_lowers_the_loss_and_the_adapter_reloads_both_ways(tmp_path, base_folder):
    data_file = tmp_path / "chat.jsonl"
    data_file.write_text("".join(json.dumps({"messages": conversation(i)}) + "\n" for i in range(40)))
    options = FinetuneOptions(model=str(base_folder), output_dir=str(tmp_path / "run"), max_tokens=60 * 8 * 24,
                              learning_rate=3e-3, merge=True)
    data = DataOptions(dataset=str(data_file), seq_len=24)
    summary = run_finetune(options, data, TrainingOptions(batch_size=8, mixed_precision="no"),
                           LoraOptions(lora_r=8, lora_dropout=0.0))
    losses = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert summary["steps"] == 60 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5

    adapter = tmp_path / "run" / "adapter"
    assert (adapter / "adapter_model.safetensors").exists() and (tmp_path / "run" / "metrics.png").exists()
    probe = torch.tensor([conversation_tokens(tiny_tokenizer(), conversation(99))[0]])
    via_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_folder), adapter).eval()
    via_auto = AutoPeftModelForCausalLM.from_pretrained(adapter, trust_remote_code=True).eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "merged").eval()
    with torch.no_grad():
        reference = via_peft(input_ids=probe).logits
        assert (via_auto(input_ids=probe).logits - reference).abs().max() <= 1e-5
        assert (merged(input_ids=probe).logits - reference).abs().max() <= 1e-5
        base = AutoModelForCausalLM.from_pretrained(base_folder).eval()(input_ids=probe).logits
    assert (base - reference).abs().max() > 1e-2  # the adapter changed something


def test_existing_output_is_kept_without_overwrite(tmp_path, base_folder):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "keep.txt").write_text("precious")
    options = FinetuneOptions(model=str(base_folder), output_dir=str(tmp_path / "run"))
    with pytest.raises(FileExistsError, match="already exists; pass --resume .* or --overwrite"):
        run_finetune(options, DataOptions(dataset=str(tmp_path)), TrainingOptions())
    assert (tmp_path / "run" / "keep.txt").read_text() == "precious"

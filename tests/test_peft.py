"""PEFT LoRA on a delta model: trains, saves and reloads the adapter, merges to the same logits."""

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from conftest import HYBRID_LAYERS, tiny_delta_model

TARGETS = {
    "named": ["q_proj", "k_proj", "v_proj", "o_proj", "g_proj"],
    "all-linear": "all-linear",
}


def build():
    return tiny_delta_model(seed=3, num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6,
                            linear_gate="channel")


@pytest.mark.parametrize("targets", list(TARGETS))
def test_lora_trains_saves_reloads_and_merges(tmp_path, targets):
    base = build()
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS[targets], lora_dropout=0.0)
    model = get_peft_model(base, lora)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    # both delta and softmax layers were adapted
    assert any("layers.0.self_attn.q_proj.lora_A" in n for n in trainable)
    assert any("layers.1.self_attn.q_proj.lora_A" in n for n in trainable)
    if targets == "all-linear":
        assert any("mlp.down_proj.lora_A" in n for n in trainable) and not any("lm_head" in n for n in trainable)

    data = torch.randint(3, 97, (4, 32), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model.train()
    losses = []
    for _ in range(20):
        loss = model(input_ids=data, labels=data).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses

    model.eval()
    probe = data[:2, :20]
    with torch.no_grad():
        adapted = model(input_ids=probe).logits
    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()

    reloaded = PeftModel.from_pretrained(build(), tmp_path / "adapter").eval()
    with torch.no_grad():
        assert (reloaded(input_ids=probe).logits - adapted).abs().max() <= 1e-5
        merged = reloaded.merge_and_unload()
        assert not any("lora_" in name for name, _ in merged.named_parameters())
        assert (merged(input_ids=probe).logits - adapted).abs().max() <= 1e-5


def test_add_lora_all_linear_keeps_lora_weights_out_of_the_new_parameters():
    """all-linear LoRA also wraps the delta layers' new projections: each parameter lands in one AdamW group."""
    from delta_attention.conversion.training.objectives import add_lora

    base = build()
    layer = base.model.layers[0].self_attn  # a delta layer
    before = {id(p) for p in layer.new_parameters()}
    model, new_params = add_lora(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    lora_params = [p for name, p in model.named_parameters() if "lora_" in name]
    wrapped = [name for name, _ in layer.named_parameters() if "lora_A" in name
               and name.split(".")[0] not in layer.COPIED_FROM_ATTENTION]
    assert wrapped, "all-linear should adapt a new projection of the delta layer"
    # the new parameters are what the layer had before PEFT, trained in full; the LoRA weights are apart
    assert before <= {id(p) for p in new_params} and all(p.requires_grad for p in new_params)
    assert not {id(p) for p in new_params} & {id(p) for p in lora_params}
    torch.optim.AdamW([{"params": lora_params, "lr": 1e-3}, {"params": new_params, "lr": 1e-2}])

"""Shared fixtures: tiny model configs and the real SmolLM2 teacher (fetched by `delta-attention assets`)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F

import delta_attention
from delta_attention import DeltaConfig, DeltaForCausalLM

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


def tiny_delta_config(**overrides) -> DeltaConfig:
    """A few-thousand-parameter delta model config; override any field."""
    fields = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        linear_chunk_size=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    fields.update(overrides)
    return DeltaConfig(**fields)


def tiny_delta_model(seed: int = 0, **overrides) -> DeltaForCausalLM:
    """A randomly initialised tiny `DeltaForCausalLM` in eval mode (fp32, eager-free sdpa)."""
    torch.manual_seed(seed)
    return DeltaForCausalLM(tiny_delta_config(**overrides)).eval()



def tiny_llama_teacher(num_hidden_layers: int = 2):
    """A randomly initialised tiny `LlamaForCausalLM` (seed 0) of the tiny delta configs' shape: a teacher."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                        num_hidden_layers=num_hidden_layers, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=2))


@torch.no_grad()
def prefill_then_decode(model, input_ids: torch.Tensor, prefill: int):
    """`(full, stepped, cache)`: the logits of one forward over `input_ids`, and those of a prefill of the first
    `prefill` tokens followed by one cached decode step per remaining token (with the cache at the end)."""
    full = model(input_ids, use_cache=False).logits
    out = model(input_ids[:, :prefill], use_cache=True)
    logits = [out.logits]
    for t in range(prefill, input_ids.shape[1]):
        out = model(input_ids[:, t : t + 1], cache=out.cache)
        logits.append(out.logits)
    return full, torch.cat(logits, 1), out.cache

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


def tiny_tokenizer():
    """A whitespace word-level tokenizer over `w0`..`w89` with a chat template; its 97 ids fit the tiny models."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "<eos>", "<unk>", "<user>", "<assistant>", "<system>"]
    vocab = {token: i for i, token in enumerate(specials + [f"w{i}" for i in range(90)])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def delta_rule_inputs(gate, batch=2, seq_len=65, heads=3, key_dim=16, value_dim=8, decay=1.0, seed=0,
                      dtype=torch.float32):
    """Random kernel inputs [B, T, H, D]: L2-normalised q and k, v, beta in (0, 1) and, for the "scalar" and
    "channel" gates, a log-decay in (-decay, 0] per head or per key channel (None for "none")."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    q = F.normalize(randn(batch, seq_len, heads, key_dim), dim=-1)
    k = F.normalize(randn(batch, seq_len, heads, key_dim), dim=-1)
    v = randn(batch, seq_len, heads, value_dim)
    beta = torch.rand(batch, seq_len, heads, generator=generator)
    g = None
    if gate == "scalar":
        g = -decay * torch.rand(batch, seq_len, heads, generator=generator)
    elif gate == "channel":
        g = -decay * torch.rand(batch, seq_len, heads, key_dim, generator=generator)
    return q.to(dtype), k.to(dtype), v.to(dtype), beta, g


HYBRID_LAYERS = ["linear_attention", "full_attention", "sliding_attention", "linear_attention"]


@pytest.fixture
def fresh_compile():
    """The project's compiled functions (the stage-2 KL, the decode step) compiled afresh within the test: dynamo's
    caches and counters reset (it counts recompilations per code object, over every compiled wrapper), and each
    function's remembered compile or failure forgotten, before and after."""
    from delta_attention.conversion.training import softmax_kl
    from delta_attention.modeling import compiled_step

    torch._dynamo.reset()
    for module in (softmax_kl, compiled_step):
        module.reset_compiled()
    yield
    for module in (softmax_kl, compiled_step):
        module.reset_compiled()


@pytest.fixture
def make_config():
    return tiny_delta_config


@pytest.fixture
def make_model():
    return tiny_delta_model


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of the real SmolLM2-135M-Instruct GGUF; fails (never skips) with the fix when it is missing."""
    from delta_attention.conversion.data.assets import smollm2_gguf_path

    return smollm2_gguf_path()


def scalar_gate_by_default(monkeypatch) -> None:
    """`convert`'s default gate set to `scalar` for the rest of the test (the flip to `channel` undone): what a
    benchmark resumed after a change of `convert`'s defaults meets."""
    import delta_attention.conversion.converter.pipeline as pipeline

    @dataclasses.dataclass
    class ScalarGateSettings(pipeline.ConversionSettings):
        gate: str = "scalar"

    monkeypatch.setattr(pipeline, "ConversionSettings", ScalarGateSettings)


class Killed(Exception):
    """What `training_killed_at` raises in place of a kill."""


def training_killed_at(run_training, stage: int, step: int):
    """`run_training` (the distill loop's) that raises `Killed` at `step` of stage `stage`, as a kill would stop it."""
    def run(*args, **kwargs):
        if f"stage {stage}" in kwargs.get("description", ""):
            def stop(n):
                if n == step:
                    raise Killed
            kwargs["step_callback"] = stop
        return run_training(*args, **kwargs)
    return run


def words(n, seed):
    rng = random.Random(seed)
    # a little structure (repeated bigrams) so that there is something to learn
    out = []
    while len(out) < n:
        w = rng.randrange(60)
        out += [f"w{w}", f"w{(w * 7 + 3) % 90}"]
    return " ".join(out[:n])


@pytest.fixture(scope="session")
def folders(tmp_path_factory):
    """A tiny Llama teacher with a tokenizer, its conversion (all-delta) and train/eval text files (tests only read
    them: one set for the session)."""
    from delta_attention.conversion.converter.pipeline import ConversionSettings, convert

    root = tmp_path_factory.mktemp("distill")
    teacher = tiny_llama_teacher(num_hidden_layers=3)
    # a teacher worth distilling: a few hundred steps on the structured text
    tokenizer = tiny_tokenizer()
    ids = torch.tensor(tokenizer(words(20000, 4))["input_ids"][: 600 * 32]).view(600, 32)
    optimizer = torch.optim.AdamW(teacher.parameters(), lr=3e-3)
    for step in range(150):
        batch = ids[torch.randint(0, 600, (16,), generator=torch.Generator().manual_seed(step))]
        teacher(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    teacher.eval().save_pretrained(root / "teacher")
    tokenizer.save_pretrained(root / "teacher")
    settings = ConversionSettings(keep_attention="0", init="copy", calibration_tokens=256, calibration_seq_len=32,
                                  chunk_size=16, bf16=False)
    convert(str(root / "teacher"), out=root / "student", settings=settings, calibration_texts=[words(2000, 1)],
            progress=False, log=lambda *a: None)
    (root / "train.txt").write_text(words(30000, 2))
    (root / "eval.txt").write_text(words(3000, 3))
    return root

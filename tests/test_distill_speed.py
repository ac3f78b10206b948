"""Distillation's fast paths equal their references: stage 2's KL over chunks of positions (its gradient from the
softmaxes) against the whole logits, stage 1's teacher activations without channel statistics, and the on-disk
cache of a tokenized built-in corpus against a fresh tokenization (and its invalidation)."""

from types import SimpleNamespace

import datasets
import pytest
import torch

import delta_attention.conversion.data.text as text
from conftest import tiny_delta_model, tiny_llama_teacher, tiny_tokenizer
from delta_attention.conversion.converter.attention_transfer import collect_teacher_activations
from delta_attention.conversion.data.chat import IGNORE_INDEX
from delta_attention.conversion.data.text import DataOptions, pack_blocks, training_blocks
from delta_attention.conversion.training.distill import run_distill
from delta_attention.conversion.training.objectives import LogitDistillation
from test_distill import options


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
@pytest.mark.parametrize("chat", [False, True])
def test_chunked_kl_equals_the_whole_logits_kl_with_every_gradient(temperature, chat):
    teacher = tiny_llama_teacher().eval()
    student = tiny_delta_model(seed=1, tie_word_embeddings=False).train()
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 97, (3, 40), generator=generator)
    positions = torch.stack([torch.cat([torch.arange(25), torch.arange(15)]), torch.arange(40), torch.arange(40)])
    labels = None
    if chat:  # answers only: the prompt and padding are -100, as data.chat.chat_rows makes them
        labels = ids.clone()
        labels[torch.rand(3, 40, generator=generator) < 0.4] = IGNORE_INDEX

    def loss_and_gradients(chunk_tokens):
        student.zero_grad()
        loss, metrics = LogitDistillation(teacher, student, temperature, 0.3, chunk_tokens)(ids, positions, labels)
        loss.backward()
        return loss, metrics, {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}

    widths = []
    handle = student.lm_head.register_forward_hook(lambda module, args, output: widths.append(output.shape[0]))
    whole_loss, whole_metrics, whole = loss_and_gradients(None)  # the plain reference: distillation_kl of all logits
    widths.clear()
    chunked_loss, chunked_metrics, chunked = loss_and_gradients(7)
    handle.remove()
    scored = 3 * 39 if labels is None else int((labels[:, 1:] != IGNORE_INDEX).sum())
    assert max(widths) == 7 and len(widths) == -(-(3 * 40 if labels is None else scored) // 7)  # each chunk once
    # float32 throughout: the sums run in another order (per row, per chunk), so a few ulps of the total differ
    assert chunked_loss.item() == pytest.approx(whole_loss.item(), rel=1e-5)
    assert chunked_metrics["kl"] == pytest.approx(whole_metrics["kl"], rel=1e-5)
    assert chunked_metrics["ce"] == pytest.approx(whole_metrics["ce"], rel=1e-5)
    assert whole.keys() == chunked.keys() and "lm_head.weight" in whole and len(whole) > 20
    for name in whole:
        assert torch.allclose(chunked[name], whole[name], atol=1e-7, rtol=1e-5), name


def test_under_autocast_a_frozen_head_is_cast_once_with_the_same_loss_and_gradients(monkeypatch):
    # autocast casts a frozen LM head's weight again at every chunk; the objective's `FrozenLinearCasts` casts each
    # model's head once and keeps the copies for the next steps
    import contextlib

    from torch.utils._python_dispatch import TorchDispatchMode

    from delta_attention.conversion.training.frozen_casts import FrozenLinearCasts

    teacher = tiny_llama_teacher().eval().requires_grad_(False)  # frozen, as distill loads it
    student = tiny_delta_model(seed=1).train()
    student.lm_head.weight.requires_grad_(False)  # frozen, as in stage 2 with LoRA
    ids = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(2))
    head_shape = tuple(teacher.lm_head.weight.shape)

    class CountHeadCasts(TorchDispatchMode):
        casts = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) == head_shape:
                CountHeadCasts.casts += 1
            return func(*args, **(kwargs or {}))

    def casts_loss_and_gradients(objective):
        student.zero_grad()
        CountHeadCasts.casts = 0
        with CountHeadCasts(), torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = objective(ids)
        loss.backward()
        return CountHeadCasts.casts, loss, {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}

    objective = LogitDistillation(teacher, student, 1.0, 0.0, chunk_tokens=8)
    casts, loss, grads = casts_loss_and_gradients(objective)
    casts_next_step = casts_loss_and_gradients(objective)[0]
    monkeypatch.setattr(FrozenLinearCasts, "cast_in", lambda self, *models, device_type="cpu": contextlib.nullcontext())
    casts_every_chunk, expected_loss, expected_grads = casts_loss_and_gradients(objective)  # autocast alone
    assert casts == 2  # the teacher's head and the student's, once each
    assert casts_next_step == 0  # kept from the first step
    assert casts_every_chunk == 2 * 10  # 80 positions in chunks of 8, both heads
    assert loss.item() == expected_loss.item()
    assert grads.keys() == expected_grads.keys() and len(grads) > 5
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], atol=0, rtol=0, msg=name)


def test_stage_1_activations_without_channel_statistics_are_the_same():
    teacher = tiny_llama_teacher(num_hidden_layers=3).eval()
    ids = torch.randint(3, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    full = collect_teacher_activations(teacher, ids, [0, 2], batch_size=2, progress=False)
    calls = []
    handle = teacher.model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda *_: calls.append(1))
    lean = collect_teacher_activations(teacher, ids, [0, 2], batch_size=2, progress=False, channel_stats=False)
    handle.remove()
    assert calls == [1]  # o_proj still runs once; only the statistics hook is gone
    for i in (0, 2):
        assert torch.equal(lean[i].inputs, full[i].inputs) and torch.equal(lean[i].outputs, full[i].outputs)
        assert lean[i].channel_rms is None and full[i].channel_rms.shape == (64,)


@pytest.fixture
def builtin_corpus(tmp_path, monkeypatch):
    """`builtin:train` replaced by a few short documents (a list the test may change) and the token cache moved
    under `tmp_path`; returns the list of texts."""
    words = [" ".join(f"w{(7 * i + 3 * d) % 90}" for i in range(30 + 11 * d)) for d in range(8)]
    monkeypatch.setattr(text, "builtin_documents", lambda source: [SimpleNamespace(text=t) for t in words])
    monkeypatch.setattr(text, "token_cache_dir", lambda: tmp_path / "tokenized")
    return words


def fresh_ids(texts, tokenizer, seq_len=16):
    return torch.tensor(pack_blocks(datasets.Dataset.from_dict({"text": list(texts)}), tokenizer, seq_len)
                        ["input_ids"][:], dtype=torch.long)


def test_a_tokenized_builtin_corpus_is_cached_and_made_again_when_corpus_or_tokenizer_change(
        builtin_corpus, tmp_path, monkeypatch):
    tokenizer, options = tiny_tokenizer(), DataOptions(dataset="builtin:train", seq_len=16)
    packed, original = [], text.pack_blocks
    monkeypatch.setattr(text, "pack_blocks", lambda *args: packed.append(1) or original(*args))
    cache = tmp_path / "tokenized"

    first = training_blocks(options, tokenizer)
    again = training_blocks(options, tokenizer)
    assert len(packed) == 1 and len(list(cache.glob("*.safetensors"))) == 1  # the second call read the cache
    assert torch.equal(first["input_ids"], fresh_ids(builtin_corpus, tokenizer))
    assert again["input_ids"].dtype == torch.long and torch.equal(again["input_ids"], first["input_ids"])
    assert torch.equal(again["position_ids"], first["position_ids"])

    builtin_corpus[3] += " w5 w6"  # another corpus: tokenized again, into an entry of its own
    changed = training_blocks(options, tokenizer)["input_ids"]
    assert len(packed) == 2 and len(list(cache.glob("*.safetensors"))) == 2
    assert torch.equal(changed, fresh_ids(builtin_corpus, tokenizer)) and not torch.equal(changed, first["input_ids"])

    other = tiny_tokenizer()
    other.eos_token = "<s>"  # another tokenizer (another EOS between documents)
    assert torch.equal(training_blocks(options, other)["input_ids"], fresh_ids(builtin_corpus, other))
    assert len(packed) == 3 and len(list(cache.glob("*.safetensors"))) == 3

    for entry in cache.glob("*.safetensors"):  # damaged entries are made again, not trusted
        entry.write_bytes(b"cut short")
    assert torch.equal(training_blocks(options, tokenizer)["input_ids"], changed) and len(packed) == 4
    assert torch.equal(training_blocks(options, tokenizer)["input_ids"], changed) and len(packed) == 4
    assert not list(cache.glob(".*partial"))


def test_a_negative_stage_2_logit_chunk_fails_with_one_line(folders, tmp_path):  # noqa: F811
    with pytest.raises(ValueError) as error:
        run_distill(*options(folders, tmp_path / "run", stage2_logit_chunk=-1))
    assert str(error.value) == "--stage2_logit_chunk must be >= 0 (0 = the whole logits at once), got -1"
    assert not (tmp_path / "run").exists()

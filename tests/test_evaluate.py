"""`evaluate`: perplexity equals a direct computation, passkey and speed report per length, lm-eval loads the model."""

import json
import re

import pytest
import torch
import torch.nn.functional as F

from conftest import HYBRID_LAYERS, tiny_delta_model, tiny_tokenizer
from delta_attention.conversion.evaluation.report import EvaluateOptions, run_evaluate
from delta_attention.conversion.evaluation.perplexity import sliding_nll
from delta_attention.conversion.evaluation.tasks import PASSKEY_FILLER, passkey_accuracy, passkey_prompt
from delta_attention.conversion.memory import cache_bytes

TEXT = " ".join(f"w{(i * 13) % 90}" for i in range(60))


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    tiny_delta_model(seed=4, num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_sliding_window_scores_every_token_once_and_matches_one_pass():
    model = tiny_delta_model(layer_types=["full_attention"] * 3)
    ids = torch.randint(3, 97, (100,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        direct = F.cross_entropy(model(ids[None]).logits[0, :-1], ids[1:], reduction="sum").item()
    assert sliding_nll(model, ids, window=128, stride=64) == pytest.approx((direct, 99), rel=1e-6)
    nll, count = sliding_nll(model, ids, window=40, stride=10)
    assert count == 99 and nll == pytest.approx(direct, rel=0.05)  # less context per token, close but not equal
    with pytest.raises(ValueError, match="need 0 < stride <= window"):
        sliding_nll(model, ids, window=10, stride=20)


def test_evaluate_report_matches_direct_perplexity_and_runs_passkey_and_speed(tmp_path, model_folder):
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "doc.txt").write_text(TEXT)
    options = EvaluateOptions(model=str(model_folder), dataset=str(tmp_path / "text"), window=128, stride=64,
                              passkey_lengths="48,96", passkey_depths="0.2,0.8", speed_contexts="32,64",
                              speed_new_tokens=3, output_dir=str(tmp_path / "report"))
    report = run_evaluate(options)

    model = tiny_delta_model(seed=4, num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6)
    ids = torch.tensor(tiny_tokenizer()(TEXT, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        direct = torch.exp(F.cross_entropy(model(ids[None]).logits[0, :-1], ids[1:])).item()
    result = report["models"][model_folder.name]
    assert result["perplexity"]["perplexity"] == pytest.approx(direct, rel=1e-5)
    assert result["perplexity"]["tokens"] == len(ids) - 1
    assert set(result["passkey"]) == {48, 96} and all(a in (0.0, 0.5, 1.0) for a in result["passkey"].values())
    assert [s["context"] for s in result["speed"]] == [32, 64] and all(s["ms_per_token"] > 0 for s in result["speed"])
    saved = json.loads((tmp_path / "report" / "report.json").read_text())
    assert set(saved["models"][model_folder.name]["passkey"]) == {"48", "96"}
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "## Passkey retrieval accuracy" in markdown and "| 96 tokens |" in markdown


class CharTokenizer:
    """One token per character (its code point): every text round-trips, digits included."""

    pad_token_id, eos_token_id = 0, 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(int(i)) for i in ids)


class KeyReader(torch.nn.Module):
    """A stand-in model whose greedy continuation is the pass key read from its prompt (or a wrong one)."""

    def __init__(self, right: bool):
        super().__init__()
        self.right = right
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def generate(self, ids, **kwargs):
        key = int(re.search(r"The pass key is (\d+)\.", CharTokenizer().decode(ids[0])).group(1))
        answer = f" {key if self.right else (key + 1) % 100000}. "
        return torch.cat([ids, torch.tensor([[ord(c) for c in answer]])], dim=1)


def find(haystack: list[int], needle: list[int]) -> int:
    """Index of the first occurrence of `needle` in `haystack` (-1 when absent)."""
    return next((i for i in range(len(haystack) - len(needle) + 1) if haystack[i : i + len(needle)] == needle), -1)


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_passkey_prompt_hides_the_key_at_the_asked_depth(depth):
    tokenizer = CharTokenizer()
    ids = passkey_prompt(tokenizer, length=2000, depth=depth, passkey=12345).tolist()
    needle = tokenizer(" The pass key is 12345. Remember it. 12345 is the pass key. ")["input_ids"]
    question = tokenizer(" What is the pass key? The pass key is")["input_ids"]
    assert len(ids) == 2000 and ids[-len(question):] == question
    start = find(ids, needle)
    filler = len(ids) - len(needle) - len(question)  # filler tokens around the needle
    sentence = max(len(tokenizer(s + ".")["input_ids"]) for s in PASSKEY_FILLER.split("."))
    assert start >= 0 and abs(start - depth * filler) <= sentence


@pytest.mark.parametrize("right, accuracy", [(True, 1.0), (False, 0.0)])
def test_passkey_accuracy_counts_right_and_wrong_answers(right, accuracy):
    result = passkey_accuracy(KeyReader(right), CharTokenizer(), [300, 600], [0.2, 0.8], trials=2, progress=False)
    assert result == {300: accuracy, 600: accuracy}


def test_a_lengths_passkeys_do_not_depend_on_the_other_lengths_asked_for(monkeypatch):
    """The long-context benchmark measures one length at a time and `evaluate` all at once: same prompts."""
    import delta_attention.conversion.evaluation.tasks as tasks

    asked, original = [], tasks.passkey_prompt
    monkeypatch.setattr(tasks, "passkey_prompt", lambda tokenizer, length, depth, passkey: (
        asked.append((length, depth, passkey)) or original(tokenizer, length, depth, passkey)))
    tasks.passkey_grid(KeyReader(True), CharTokenizer(), [300, 600], [0.2, 0.8], trials=2, progress=False)
    together = [a for a in asked if a[0] == 600]
    asked.clear()
    tasks.passkey_grid(KeyReader(True), CharTokenizer(), [600], [0.2, 0.8], trials=2, progress=False)
    assert asked == together and len({passkey for *_, passkey in asked}) == 4
    asked.clear()
    tasks.passkey_grid(KeyReader(True), CharTokenizer(), [600], [0.2, 0.8], trials=2, seed=1, progress=False)
    assert [passkey for *_, passkey in asked] != [passkey for *_, passkey in together]


def test_cache_bytes_counts_kv_and_states():
    model = tiny_delta_model(num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6)
    with torch.no_grad():
        cache = model(torch.randint(3, 97, (1, 10)), use_cache=True).cache
    delta = 2 * (4 * 16 * 16 * 4 + (2 * 64 + 64) * 4 * 4)
    full_kv = 2 * 10 * 2 * 16 * 4
    sliding_kv = 2 * 5 * 2 * 16 * 4  # a sliding layer keeps window - 1 past tokens
    assert cache_bytes(cache) == delta + full_kv + sliding_kv


def test_the_model_answers_loglikelihood_requests_through_lm_eval(model_folder):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(model_folder), trust_remote_code=True, batch_size=1, device="cpu")
    requests = [Instance("loglikelihood", {}, ("w1 w2 w3", " w4 w5"), 0),
                Instance("loglikelihood", {}, ("w1 w2 w3", " w80"), 1)]
    answers = lm.loglikelihood(requests, disable_tqdm=True)
    model = tiny_delta_model(seed=4, num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6)
    tokenizer = tiny_tokenizer()
    for (context, continuation), (logprob, _) in zip([r.args for r in requests], answers):
        ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
        cont = tokenizer(continuation, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logp = model(ids).logits[0, :-1].log_softmax(-1)
        expected = sum(logp[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))
        assert logprob == pytest.approx(expected, abs=1e-4)

"""Agreement with the teacher: each measure against hand-computed values, a model against itself, the reports."""

import copy
import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import HYBRID_LAYERS, tiny_delta_model, tiny_tokenizer
from delta_attention.conversion.evaluation.agreement import (
    AgreementSettings,
    agreement_inputs,
    agreement_markdown,
    answer_prompts,
    chat_prompt_ids,
    compare_outputs,
    continuation_agreement,
    copy_accuracy,
    greedy_continuations,
    matching_prefix_lengths,
    measure_agreement,
    model_outputs,
    repeated_passages,
    repetition_of_answer,
    repetition_rate,
    top1_agreement,
    top1_predictions,
)
from delta_attention.conversion.data.windows import token_windows
from delta_attention.conversion.evaluation.report import EvaluateOptions, run_evaluate

VOCAB = 16


class NextTokenTable(torch.nn.Module):
    """A stand-in causal LM whose logits at each position are one-hot on `table[token there]`."""

    def __init__(self, table: list[int]):
        super().__init__()
        self.table = torch.tensor(table)
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, cache=None, use_cache=False, logits_to_keep=0, **kwargs):
        logits = F.one_hot(self.table[input_ids], VOCAB).float()  # [B, T, V]
        return SimpleNamespace(logits=logits[:, -logits_to_keep:], cache=None)


def successor_table(**changes) -> list[int]:
    """next(t) = t + 1 (mod VOCAB), with `changes` (t=next) overriding single entries."""
    table = [(t + 1) % VOCAB for t in range(VOCAB)]
    for token, following in changes.items():
        table[int(token[1:])] = following
    return table


TEACHER = NextTokenTable(successor_table())
STUDENT = NextTokenTable(successor_table(t5=9))  # disagrees only after token 5


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(90)}" for _ in range(n))


def test_top1_agreement_is_the_share_of_positions_with_the_same_argmax():
    windows = torch.tensor([[0, 5, 3, 5], [5, 1, 2, 3]])  # three of eight positions hold token 5
    teacher, student = top1_predictions(TEACHER, windows, batch_size=1), top1_predictions(STUDENT, windows)
    assert teacher.tolist() == [[1, 6, 4, 6], [6, 2, 3, 4]]
    assert student.tolist() == [[1, 9, 4, 9], [9, 2, 3, 4]]
    assert top1_agreement(student, teacher) == 5 / 8
    with pytest.raises(ValueError, match=r"top-1 predictions of different shapes: \(2, 4\) vs \(1, 4\)"):
        top1_agreement(student, teacher[:1])


def test_copy_accuracy_counts_the_second_readings_predictions_of_the_passages_next_token():
    windows = torch.tensor([[0, 1, 2, 3, 9], [4, 5, 6, 7, 9], [8, 8, 8, 8, 8]])
    repeated = repeated_passages(windows, count=2, tokens=4)
    assert repeated.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3], [4, 5, 6, 7, 4, 5, 6, 7]]
    # the successor table predicts t + 1: right at every second-reading position of the first passage (1 -> 2,
    # 2 -> 3 and 0 -> 1 are all successors) and of the second (5 -> 6, 6 -> 7, 4 -> 5)
    assert copy_accuracy(top1_predictions(TEACHER, repeated), repeated) == 1.0
    # the student predicts 9 after 5: wrong at the second passage's position 5 (one of six counted positions)
    assert copy_accuracy(top1_predictions(STUDENT, repeated), repeated) == 5 / 6
    # the positions counted are T .. 2T - 2: predictions elsewhere (here all wrong) do not count
    predictions = torch.full_like(repeated, 15)
    predictions[:, 4:7] = repeated[:, 5:8]
    assert copy_accuracy(predictions, repeated) == 1.0


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_continuations_and_their_matching_prefix(use_cache):
    prompts = torch.tensor([[3, 0], [2, 5], [1, 6]])
    teacher = greedy_continuations(TEACHER, prompts, 7, batch_size=2, use_cache=use_cache)
    student = greedy_continuations(STUDENT, prompts, 7, batch_size=2, use_cache=use_cache)
    assert teacher.tolist() == [[1, 2, 3, 4, 5, 6, 7], [6, 7, 8, 9, 10, 11, 12], [7, 8, 9, 10, 11, 12, 13]]
    assert student.tolist() == [[1, 2, 3, 4, 5, 9, 10], [9, 10, 11, 12, 13, 14, 15], [7, 8, 9, 10, 11, 12, 13]]
    assert matching_prefix_lengths(student, teacher).tolist() == [5, 0, 7]
    assert continuation_agreement(student, teacher) == {"mean_matching_prefix": 4.0, "full_match": 1 / 3}


def test_a_match_after_the_first_difference_does_not_extend_the_prefix():
    ours, theirs = torch.tensor([[1, 2, 3], [1, 2, 3]]), torch.tensor([[1, 2, 4], [0, 2, 3]])
    assert matching_prefix_lengths(ours, theirs).tolist() == [2, 0]


def test_cached_greedy_decoding_equals_rerunning_the_whole_sequence():
    model = tiny_delta_model(seed=1, num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6)
    prompts = torch.randint(3, 97, (5, 9), generator=torch.Generator().manual_seed(0))
    cached = greedy_continuations(model, prompts, 12, batch_size=2)
    assert torch.equal(cached, greedy_continuations(model, prompts, 12, batch_size=5, use_cache=False))


@pytest.mark.parametrize("text, rate", [
    ("The first item is a lemon, a lemon, a lemon, and a lemon.", 2 / 11),  # 11 word 3-grams, 2 seen before
    ("Apple, banana, cherry.", 0.0),
    ("go go go go go", 2 / 3),  # three 'go go go', two of them repeats
    ("GO go, Go!", 0.0),  # one 3-gram: case and punctuation do not split words
    ("two words", 0.0),  # shorter than one 3-gram
    ("", 0.0),
])
def test_repetition_of_an_answer(text, rate):
    assert repetition_of_answer(text) == pytest.approx(rate)


def test_repetition_rate_is_the_mean_over_answers():
    answers = ["go go go go go", "Apple, banana, cherry.", "a b a b a b"]  # 2/3, 0, 2/4
    assert repetition_rate(answers) == pytest.approx((2 / 3 + 0 + 2 / 4) / 3)
    assert repetition_of_answer("a b a b a b", n=2) == pytest.approx(3 / 5)
    with pytest.raises(ValueError, match="no answers to measure the repetition rate of"):
        repetition_rate([])


def test_chat_prompts_go_through_the_chat_template_when_there_is_one():
    tokenizer = tiny_tokenizer()
    assert chat_prompt_ids(tokenizer, "w1 w2") == tokenizer("<user> w1 w2 <eos> <assistant>")["input_ids"]
    tokenizer.chat_template = None
    assert chat_prompt_ids(tokenizer, "w1 w2") == tokenizer("w1 w2")["input_ids"]


def test_left_padded_batches_answer_as_each_prompt_alone():
    model = tiny_delta_model(seed=2, num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6)
    tokenizer = tiny_tokenizer()
    chat_ids = [chat_prompt_ids(tokenizer, words(n, n)) for n in (1, 5, 3, 8)]  # four prompt lengths
    batched = answer_prompts(model, tokenizer, chat_ids, 6, batch_size=4)
    assert batched == [answer_prompts(model, tokenizer, [ids], 6, batch_size=1)[0] for ids in chat_ids]
    assert all(batched)
    sampled = answer_prompts(model, tokenizer, chat_ids, 6, sample=True, seed=3, batch_size=4)
    state = torch.get_rng_state()
    assert answer_prompts(model, tokenizer, chat_ids, 6, sample=True, seed=3, batch_size=4) == sampled
    assert torch.equal(torch.get_rng_state(), state)  # sampling leaves the caller's generator alone


SMALL = AgreementSettings(seq_len=16, tokens=64, prompts=5, prompt_tokens=8, new_tokens=6, answer_tokens=8,
                          batch_size=3)


def test_a_model_agrees_with_itself_fully_and_less_with_another(tmp_path):
    model = tiny_delta_model(seed=3, num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6)
    tokenizer, texts = tiny_tokenizer(), [words(300, 0), words(300, 1)]
    for name, text in zip("ab", texts):
        (tmp_path / f"{name}.txt").write_text(text)
    inputs = agreement_inputs(tokenizer, str(tmp_path), SMALL)
    assert torch.equal(inputs.windows, token_windows(tokenizer, texts, 16, 4))
    assert torch.equal(inputs.prompts, token_windows(tokenizer, texts, 8, 5))
    same = measure_agreement(model, model, tokenizer, inputs, SMALL, "texts")
    assert same["top1_agreement"] == 1.0 and same["positions"] == 64 and same["dataset"] == "texts"
    assert same["continuation"] == {"prompts": 5, "prompt_tokens": 8, "new_tokens": 6, "mean_matching_prefix": 6.0,
                                    "full_match": 1.0}
    assert len(same["answers"]) == 12
    assert all(a["teacher"] == a["student"] and a["teacher_sampled"] == a["student_sampled"] for a in same["answers"])
    assert same["repetition"]["teacher"] == same["repetition"]["student"]
    assert same["copy"]["passages"] == 4 and same["copy"]["tokens"] == 16  # copy_tokens cut to the windows' 16
    assert same["copy"]["teacher"] == same["copy"]["student"]

    other = copy.deepcopy(model).train()  # the model with noise of a tenth of each weight's spread added
    torch.manual_seed(0)
    with torch.no_grad():
        for weight in other.parameters():
            weight.add_(0.1 * weight.std().nan_to_num() * torch.randn_like(weight))
    record = measure_agreement(other, model, tokenizer, inputs, SMALL, "texts")
    assert other.training  # measured in eval mode, then left as it was
    with torch.no_grad():
        expected = (other.eval()(inputs.windows).logits.argmax(-1) == model(inputs.windows).logits.argmax(-1)).double()
        expected = expected.mean()
    assert record["top1_agreement"] == pytest.approx(expected.item()) and 0 < expected < 1
    assert 0 < record["continuation"]["mean_matching_prefix"] < 6


def test_sampled_repetition_is_the_mean_over_several_samples_of_every_prompt(tmp_path):
    model = tiny_delta_model(seed=3, num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6)
    tokenizer = tiny_tokenizer()
    (tmp_path / "a.txt").write_text(words(300, 0))
    inputs = agreement_inputs(tokenizer, str(tmp_path), SMALL)
    settings = dataclasses.replace(SMALL, samples=3, seed=5)
    outputs = model_outputs(model, tokenizer, inputs, settings, "m")
    prompts = len(inputs.chat_ids)
    # every prompt once, then every prompt again: the same answers as one call over the prompts three times
    assert outputs["sampled"] == answer_prompts(model, tokenizer, inputs.chat_ids * 3, 8, sample=True, seed=5,
                                                batch_size=3)
    assert len(outputs["sampled"]) == 3 * prompts
    assert any(outputs["sampled"][i] != outputs["sampled"][i + prompts] for i in range(prompts))  # new draws
    record = compare_outputs(outputs, outputs, inputs, settings, "texts")
    by_hand = sum(repetition_of_answer(answer) for answer in outputs["sampled"]) / (3 * prompts)
    assert record["repetition"]["student"]["sampled"] == pytest.approx(by_hand)
    assert record["repetition"]["samples_per_prompt"] == 3
    assert [a["student_sampled"] for a in record["answers"]] == outputs["sampled"][:prompts]  # each prompt's first
    assert "; 3 sampled answers per prompt):" in agreement_markdown(record)
    assert AgreementSettings().samples == 4
    with pytest.raises(ValueError, match="agreement samples must be at least 1, got 0"):
        dataclasses.replace(SMALL, samples=0).validate()


RECORD = {
    "dataset": "builtin:heldout", "top1_agreement": 0.625, "positions": 8192,
    "continuation": {"prompts": 16, "prompt_tokens": 48, "new_tokens": 32, "mean_matching_prefix": 1.75,
                     "full_match": 0.0625},
    "repetition": {"ngram": 3, "answer_tokens": 64, "sampling": {"temperature": 0.7, "top_p": 0.9, "top_k": 0},
                   "teacher": {"greedy": 0.05, "sampled": 0.0}, "student": {"greedy": 0.2, "sampled": 0.125}},
    "copy": {"passages": 4, "tokens": 128, "teacher": 0.9375, "student": 0.5},
    "answers": [{"prompt": "Write a short list of three fruits.", "teacher": "1. Apple | 2. Pear\n3. Plum",
                 "student": "", "teacher_sampled": "Apple", "student_sampled": "lemon"}],
}


def test_agreement_report_rendering():
    text = agreement_markdown(RECORD, student="hybrid", teacher="smollm2")
    assert text.startswith("## Agreement with the teacher\n\n`hybrid` against `smollm2` on `builtin:heldout`.\n")
    for line in [
        "| teacher-forced top-1 agreement (8,192 positions) | 62.5% |",
        "| greedy continuation: mean matching prefix (16 prompts of 48 tokens) | 1.75 of 32 tokens |",
        "| greedy continuations identical to the teacher's | 6.2% |",
        "| answers | smollm2 | hybrid |",
        "| greedy | 5.0% | 20.0% |",
        "| sampled | 0.0% | 12.5% |",
        "In-context copying: top-1 accuracy on the second reading of a passage read twice (4 passages of 128 tokens):",
        "| 93.8% | 50.0% |",
        "### Greedy answers to the fixed prompts",
        "| Write a short list of three fruits. | 1. Apple \\| 2. Pear<br>3. Plum | (empty) |",
    ]:
        assert line in text.splitlines()
    assert "mean over 1 fixed chat prompts (at most 64 new tokens; sampled with temperature 0.7, top_p 0.9)" \
        in text
    assert agreement_markdown(RECORD, level=3).startswith("### Agreement with the teacher")
    older = {key: value for key, value in RECORD.items() if key != "copy"}  # a record from before copy accuracy
    assert "In-context copying" not in agreement_markdown(older)


def test_distill_report_and_card_show_agreement(tmp_path):
    from delta_attention.conversion.publishing.cards import distilled_card, results_table
    from delta_attention.conversion.training.distill import _write_results

    results = {"teacher_ppl": 10.0, "converted_ppl": 40.0, "eval_precision": "float32", "agreement": RECORD,
               "stage2": {"tokens": 1024, "heldout_ppl": 12.0, "lr": 3e-4, "new_params_lr": 1e-3, "temperature": 1.0,
                          "ce_weight": 0.0, "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "q_proj"}}}
    _write_results(tmp_path, results)
    report = (tmp_path / "report.md").read_text()
    assert report.startswith("# Distillation results\n\n" + results_table(results) + "\n")
    assert "## Agreement with the teacher" in report and "| greedy | 5.0% | 20.0% |" in report
    conversion = {"source": {"spec": "teacher.gguf", "kind": "gguf", "model_type": "llama"},
                  "plan": {"layer_types": ["full_attention", "linear_attention"], "rule": "explicit"},
                  "settings": {"gate": "scalar", "init": "copy"}}
    card = str(distilled_card(conversion, results, "student-distilled", "builtin:heldout"))
    assert "### Agreement with the teacher" in card and "`student-distilled` against `teacher`" in card
    assert "| teacher-forced top-1 agreement (8,192 positions) | 62.5% |" in card
    local = str(distilled_card(conversion, dict(results, agreement=dict(RECORD, dataset=str(tmp_path / "e.txt"))),
                               "student-distilled", "builtin:heldout"))
    assert "`student-distilled` against `teacher` on `e.txt`." in local and str(tmp_path) not in local
    without = str(distilled_card(conversion, {k: v for k, v in results.items() if k != "agreement"}, "s", "x"))
    assert "Agreement" not in without


@pytest.fixture(scope="module")
def two_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("agreement")
    for name, seed in (("student", 5), ("teacher", 6)):
        tiny_delta_model(seed=seed, num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6).save_pretrained(
            root / name)
        tiny_tokenizer().save_pretrained(root / name)
    (root / "text").mkdir()
    (root / "text" / "a.txt").write_text(words(400, 7))
    return root


def test_evaluate_agreement_task_compares_the_model_with_the_teacher(two_folders, tmp_path):
    options = EvaluateOptions(model=str(two_folders / "student"), teacher=str(two_folders / "teacher"),
                              tasks="agreement", agreement_dataset=str(two_folders / "text"), agreement_tokens=96,
                              agreement_seq_len=32, agreement_prompts=4, agreement_prompt_tokens=8,
                              agreement_new_tokens=5, answer_tokens=6, agreement_samples=2,
                              output_dir=str(tmp_path / "report"))
    report = run_evaluate(options)
    record = report["agreement"]
    assert record["repetition"]["samples_per_prompt"] == 2
    student = tiny_delta_model(seed=5, num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6)
    teacher = tiny_delta_model(seed=6, num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6)
    windows = torch.tensor(tiny_tokenizer()(words(400, 7))["input_ids"][:96]).view(3, 32)
    assert record["top1_agreement"] == top1_agreement(top1_predictions(student, windows),
                                                      top1_predictions(teacher, windows))
    assert record["positions"] == 96 and record["dataset"] == str(two_folders / "text")
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "## Agreement with the teacher" in markdown and "| answers | teacher | student |" in markdown


def test_the_agreement_task_without_a_teacher_is_one_clear_error(two_folders, capsys):
    from delta_attention.scripts.cli import main

    assert main(["evaluate", str(two_folders / "student"), "--tasks", "agreement"]) == 1
    assert capsys.readouterr().err.strip() == (
        "delta-attention evaluate: error: the agreement task compares the model with a teacher; pass --teacher "
        "SOURCE (or leave agreement out of --tasks)")

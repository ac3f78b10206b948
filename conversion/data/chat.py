"""Supervised fine-tuning data: chat conversations through the tokenizer's chat template, loss on completions.

Each conversation (a list of `{"role", "content"}` messages) becomes one row of `seq_len` tokens, truncated
or right-padded. Completion-only labels are found by rendering the conversation up to each assistant turn
with `add_generation_prompt=True` and again with the turn: the tokens in between are the completion. This
works with any chat template whose renderings extend each other (it is checked, with a clear error).
A row that is not a list of `{"role", "content"}` messages, or that the template rejects, gives a `ValueError`
naming the row (counted from 0) and what is wrong with it.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def _render(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _prompt(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def check_conversation(messages, row: int | None = None) -> None:
    """Raise a `ValueError` naming the row and message when `messages` is not a list of role/content dicts."""
    where = f"chat row {row} (counted from 0)" if row is not None else "chat conversation"
    need = "each message needs a string 'role' (system, user or assistant) and a 'content'"
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"{where}: messages must be a list of {{'role', 'content'}} dicts, got "
                         f"{type(messages).__name__}; pass --messages_column with the column of conversations")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{where}, message {index}: expected a {{'role', 'content'}} dict, got "
                             f"{type(message).__name__}; {need}")
        role = message.get("role")
        if role is None:
            raise ValueError(f"{where}, message {index}: no 'role'; {need}")
        if not isinstance(role, str):
            raise ValueError(f"{where}, message {index}: 'role' must be a string, got {type(role).__name__} "
                             f"{role!r}; {need}")
        if message.get("content") is None:
            raise ValueError(f"{where}, message {index} ({role}): no 'content'; {need}")


def conversation_tokens(tokenizer, messages: list[dict], completion_only: bool = True) -> tuple[list[int], list[int]]:
    """Token ids of one conversation and its labels (`-100` outside assistant turns when `completion_only`)."""
    if tokenizer.chat_template is None:
        raise ValueError("the tokenizer has no chat template; fine-tune on plain text (--data_format text) instead")
    input_ids = _render(tokenizer, messages)
    if not completion_only:
        return input_ids, list(input_ids)
    labels = [IGNORE_INDEX] * len(input_ids)
    for turn, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = _prompt(tokenizer, messages[:turn])
        upto = _render(tokenizer, messages[: turn + 1])
        start, end = len(prompt), len(upto)
        if input_ids[:end] != upto or upto[:start] != prompt:
            raise ValueError("the chat template does not render conversations as prefixes of each other; "
                             "use --completion_only_loss false")
        labels[start:end] = input_ids[start:end]
    return input_ids, labels


def _conversation_pieces(tokenizer, conversations, seq_len: int, completion_only: bool):
    """`(ids, labels)` of each conversation, cut to `seq_len`; those with nothing to learn in the kept part are
    left out. A bad conversation raises the `ValueError` of `check_conversation` or of its chat template."""
    from jinja2 import TemplateError

    if seq_len < 2:
        raise ValueError(f"--seq_len must be at least 2, got {seq_len}")
    pieces = []
    for row, messages in enumerate(conversations):
        check_conversation(messages, row)
        try:
            ids, labels = conversation_tokens(tokenizer, messages, completion_only)
        except TemplateError as error:
            message = str(error).strip().splitlines()
            raise ValueError(f"chat row {row} (counted from 0): the tokenizer's chat template rejected it "
                             f"({message[0] if message else type(error).__name__}); fix that conversation") from error
        ids, labels = ids[:seq_len], labels[:seq_len]
        if all(label == IGNORE_INDEX for label in labels[1:]):
            continue  # nothing to learn from in the kept part
        pieces.append((ids, labels))
    if not pieces:
        raise ValueError("no conversation has an assistant turn within seq_len tokens")
    return pieces


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def chat_rows(tokenizer, conversations, seq_len: int, completion_only: bool = True) -> dict[str, torch.Tensor]:
    """`input_ids`, `labels`, `attention_mask` tensors `[N, seq_len]` (right-padded) for the conversations."""
    pad = _pad_id(tokenizer)
    rows = {"input_ids": [], "labels": [], "attention_mask": []}
    for ids, labels in _conversation_pieces(tokenizer, conversations, seq_len, completion_only):
        padding = seq_len - len(ids)
        rows["input_ids"].append(ids + [pad] * padding)
        rows["labels"].append(labels + [IGNORE_INDEX] * padding)
        rows["attention_mask"].append([1] * len(ids) + [0] * padding)
    return {key: torch.tensor(value, dtype=torch.long) for key, value in rows.items()}


def packed_chat_rows(tokenizer, conversations, seq_len: int, completion_only: bool = True) -> dict[str, torch.Tensor]:
    """`input_ids`, `labels`, `position_ids` tensors `[N, seq_len]`: the conversations in their order, as many to a
    row as fit whole (a longer one is cut to `seq_len` and has a row alone), the rest of a row padding.

    The position ids restart at 0 at each conversation and at the padding, the packed-sequence convention that
    transformers' masks and the delta layers' per-document state resets read, so each conversation is seen as if
    it were alone in its row; short answers then fill rows instead of padding them."""
    pad = _pad_id(tokenizer)
    rows = {"input_ids": [], "labels": [], "position_ids": []}
    row = {key: [] for key in rows}

    def close():
        padding = seq_len - len(row["input_ids"])
        row["input_ids"] += [pad] * padding
        row["labels"] += [IGNORE_INDEX] * padding
        row["position_ids"] += list(range(padding))
        for key in rows:
            rows[key].append(row[key])
            row[key] = []

    for ids, labels in _conversation_pieces(tokenizer, conversations, seq_len, completion_only):
        if len(row["input_ids"]) + len(ids) > seq_len:
            close()
        row["input_ids"] += ids
        row["labels"] += labels
        row["position_ids"] += list(range(len(ids)))
    close()
    return {key: torch.tensor(value, dtype=torch.long) for key, value in rows.items()}

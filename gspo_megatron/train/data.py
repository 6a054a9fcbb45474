"""Prompts for the RL loop: JSONL files or a built-in synthetic task, as a resumable, seeded stream.

JSONL records (one per line):
    {"prompt": "What is 2+3?", "answer": "5"}
    {"messages": [{"role": "user", "content": "..."}], "answer": "..."}   (the tokenizer's chat template)
    {"prompt_ids": [1, 2, 3], "answer": "..."}                               (already tokenized)
    {"prompt": "Write add(a, b).", "tests": ["assert add(1, 2) == 3"]}       (data.reward=code_tests)
A malformed line stops loading with its file and line number, or is skipped and counted with
``data.skip_malformed``. A prompt longer than ``rollout.max_prompt_tokens`` likewise stops loading (file and line),
or is dropped and counted with ``data.long_prompts=drop``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """A prompt file is malformed; the message names the file and the line."""


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str
    label: Any


def _record_to_prompt(record: Any, tokenizer, where: str) -> Prompt:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    label = record.get("answer", record.get("label", record.get("tests")))  # tests: data.reward=code_tests
    if "prompt_ids" in record:
        ids = record["prompt_ids"]
        if not (isinstance(ids, list) and ids and all(isinstance(i, int) and i >= 0 for i in ids)):
            raise DataError(f"{where}: prompt_ids must be a non-empty list of token ids")
        text = record.get("prompt", "")
    elif "messages" in record:
        messages = record["messages"]
        if not (isinstance(messages, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)):
            raise DataError(f"{where}: messages must be a list of {{role, content}} objects")
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    elif "prompt" in record:
        text = record["prompt"]
        if not isinstance(text, str) or not text:
            raise DataError(f"{where}: prompt must be a non-empty string")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        raise DataError(f"{where}: needs one of 'prompt', 'messages' or 'prompt_ids' (has {sorted(record)})")
    if not ids:
        raise DataError(f"{where}: the prompt tokenizes to nothing")
    return Prompt(list(ids), text, label)


def load_jsonl(path: str | Path, tokenizer, skip_malformed: bool = False, max_prompt_tokens: int | None = None,
               drop_long: bool = False):
    """-> (prompts, {"malformed": lines skipped, "too_long": prompts dropped})."""
    prompts, skipped = [], {"malformed": 0, "too_long": 0}
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data.prompts={str(path)!r} does not exist")
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            prompt = _record_to_prompt(record, tokenizer, where)
        except DataError:
            if not skip_malformed:
                raise
            skipped["malformed"] += 1
            continue
        if max_prompt_tokens and len(prompt.ids) > max_prompt_tokens:
            if not drop_long:
                raise DataError(f"{where}: prompt has {len(prompt.ids)} tokens > rollout.max_prompt_tokens="
                                f"{max_prompt_tokens} (data.long_prompts=drop drops such prompts)")
            skipped["too_long"] += 1
            continue
        prompts.append(prompt)
    if not prompts:
        raise DataError(f"{path}: no usable prompts ({skipped['malformed']} malformed lines skipped, "
                        f"{skipped['too_long']} prompts longer than rollout.max_prompt_tokens dropped)")
    return prompts, skipped


def check_prompt_lengths(prompts: list[Prompt], max_prompt_tokens: int, where: str) -> None:
    """A built-in task's prompts must fit ``rollout.max_prompt_tokens`` (they are generated, so there is no line
    to drop)."""
    longest = max((len(p.ids) for p in prompts), default=0)
    if longest > max_prompt_tokens:
        raise DataError(f"{where}: a prompt has {longest} tokens > rollout.max_prompt_tokens={max_prompt_tokens}; "
                        "raise rollout.max_prompt_tokens")


def task_prompts(task: str, tokenizer, count: int, seed: int) -> list[Prompt]:
    from gspo_megatron.rollout.synthetic import make_problems

    return [Prompt(tokenizer(p.prompt, add_special_tokens=False)["input_ids"], p.prompt, p.answer)
            for p in make_problems(task, count, seed)]


class PromptStream:
    """Endless, reshuffled-every-epoch stream of prompts; its position is part of a checkpoint."""

    def __init__(self, prompts: list[Prompt], seed: int):
        self.prompts = prompts
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order = self._shuffle(0)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.seed + epoch).shuffle(order)
        return order

    def next(self, count: int) -> list[Prompt]:
        out = []
        while len(out) < count:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffle(self.epoch)
            out.append(self.prompts[self._order[self.index]])
            self.index += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._shuffle(self.epoch)

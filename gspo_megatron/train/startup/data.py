"""Prompts for the RL loop: prompt files or a built-in synthetic task, as a resumable, seeded stream.

Files: JSONL (one record a line), parquet (``*.parquet``: one record a row), or a Hugging Face ``datasets`` directory
(``Dataset.save_to_disk``; a ``DatasetDict``'s ``train`` split). Records:
    {"prompt": "What is 2+3?", "answer": "5"}
    {"messages": [{"role": "user", "content": "..."}], "answer": "..."}   (the tokenizer's chat template)
    {"prompt_ids": [1, 2, 3], "answer": "..."}                               (already tokenized)
    {"prompt": "Write add(a, b).", "tests": ["assert add(1, 2) == 3"]}       (data.reward=code_tests)
    {"prompt": [{"role": "user", ...}], "reward_model": {"ground_truth": "5"}}  (verl's parquet layout)
``data.prompt_key`` / ``data.label_key`` (dotted for nested fields: ``reward_model.ground_truth``) name other
fields (slime's ``--input-key`` / ``--label-key``); the label reaches the reward as it is (``*``: the whole record,
its metadata included). A chat prompt's ``tools`` field (``data.tools_key``: function schemas, as in OpenAI's and
Qwen3's tool calling) goes to the chat template. ``data.system_prompt``
and ``data.chat_template_kwargs`` (Qwen3's ``enable_thinking``) shape chat prompts; ``data.apply_chat_template``
puts plain-text prompts through the template too.
A malformed line stops loading with its file and line number, or is skipped and counted with
``data.skip_malformed``. A prompt longer than ``rollout.max_prompt_tokens`` likewise stops loading (file and line),
or is dropped and counted with ``data.long_prompts=drop``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gspo_megatron.rewards.synthetic import make_problems


class DataError(ValueError):
    """A prompt file is malformed; the message names the file and the line."""


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str
    label: Any


@dataclass(frozen=True)
class PromptFormat:
    """How records become prompts (the ``data`` section's fields of the same names)."""

    prompt_key: str = ""  # "": prompt_ids, messages or prompt, whichever the record has
    label_key: str = ""  # "": answer, label, tests or reward_model.ground_truth; "*": the whole record
    tools_key: str = "tools"  # a chat prompt's tool schemas, given to the chat template
    system_prompt: str = ""
    chat_template_kwargs: dict = field(default_factory=dict)
    apply_chat_template: bool = False


_MISSING = object()
LABEL_KEYS = ("answer", "label", "tests", "reward_model.ground_truth")  # tests: data.reward=code_tests


def _field(record: dict, key: str):
    """``record[key]``, dotted keys reaching into nested objects; ``_MISSING`` when absent."""
    node = record
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _is_messages(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in value)


def _record_to_prompt(record: Any, tokenizer, where: str, fmt: PromptFormat = PromptFormat()) -> Prompt:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if fmt.label_key == "*":
        label = record
    elif fmt.label_key:
        label = _field(record, fmt.label_key)
        if label is _MISSING:
            raise DataError(f"{where}: no {fmt.label_key!r} (data.label_key) in {sorted(record)}")
    else:
        label = next((v for v in (_field(record, k) for k in LABEL_KEYS) if v is not _MISSING), None)
    if fmt.prompt_key:
        key = fmt.prompt_key
        value = _field(record, key)
        if value is _MISSING:
            raise DataError(f"{where}: no {key!r} (data.prompt_key) in {sorted(record)}")
    else:
        key = next((k for k in ("prompt_ids", "messages", "prompt") if k in record), None)
        if key is None:
            raise DataError(f"{where}: needs one of 'prompt', 'messages' or 'prompt_ids' (has {sorted(record)}; "
                            "data.prompt_key names another field)")
        value = record[key]
    tools = _field(record, fmt.tools_key) if fmt.tools_key else _MISSING
    if isinstance(tools, str) and tools.strip():  # parquet sets often keep nested schemas as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: {fmt.tools_key} (data.tools_key) is a string but not JSON ({e})") from None
    if tools is not _MISSING and tools is not None and not (
            isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DataError(f"{where}: {fmt.tools_key} (data.tools_key) must be a list of tool schemas (objects), "
                        f"got {type(tools).__name__}")
    tools = tools if isinstance(tools, list) and tools else None

    def chat(messages: list) -> tuple[list[int], str]:
        if fmt.system_prompt and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": fmt.system_prompt}, *messages]
        # Only a record with tools passes them: a template without tool support is then never asked for them.
        extra = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **extra, **fmt.chat_template_kwargs)
        return tokenizer(text, add_special_tokens=False)["input_ids"], text

    templated = True
    if key == "prompt_ids" or (isinstance(value, list) and value and all(isinstance(i, int) for i in value)):
        if not (isinstance(value, list) and value and all(isinstance(i, int) and i >= 0 for i in value)):
            raise DataError(f"{where}: {key} must be a non-empty list of token ids")
        ids, text, templated = value, record.get("prompt", "") if key != "prompt" else "", False
    elif isinstance(value, list) or key == "messages":
        if not _is_messages(value):
            raise DataError(f"{where}: {key} must be a list of {{role, content}} objects")
        ids, text = chat(list(value))
    else:
        if not isinstance(value, str) or not value:
            raise DataError(f"{where}: {key} must be a non-empty string")
        if fmt.apply_chat_template or fmt.system_prompt:
            ids, text = chat([{"role": "user", "content": value}])
        else:
            ids, text, templated = tokenizer(value, add_special_tokens=False)["input_ids"], value, False
    if tools and not templated:
        # Tools reach the model only through the chat template: dropping them silently would train on other prompts.
        raise DataError(f"{where}: has {fmt.tools_key} (data.tools_key) but its prompt does not go through the chat "
                        "template: give chat messages or set data.apply_chat_template")
    if not ids:
        raise DataError(f"{where}: the prompt tokenizes to nothing")
    return Prompt(list(ids), text, label)


def _records(path: Path):
    """(where, record or a DataError) for each record of a JSONL file, a parquet file or a ``datasets`` dir."""
    if path.is_dir():
        try:
            import datasets
        except ImportError:
            raise DataError(f"{path} is a directory: reading a Hugging Face dataset needs the datasets package") from None
        try:
            data = datasets.load_from_disk(str(path))
        except FileNotFoundError as e:
            raise DataError(f"{path} is not a dataset saved with save_to_disk ({e})") from None
        if isinstance(data, datasets.DatasetDict):
            if "train" not in data:
                raise DataError(f"{path}: a DatasetDict without a train split (splits: {sorted(data)}); give one "
                                "split's directory")
            data = data["train"]
        for i, row in enumerate(data):
            yield f"{path}: row {i}", row
        return
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow's ArrowInvalid and OSError alike: a damaged or non-parquet file
            raise DataError(f"{path}: not a readable parquet file ({e})") from None
        for i, row in enumerate(rows):
            yield f"{path}: row {i}", row
        return
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as e:
            yield where, DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})")


def load_jsonl(path: str | Path, tokenizer, skip_malformed: bool = False, max_prompt_tokens: int | None = None,
               drop_long: bool = False, fmt: PromptFormat = PromptFormat(), field_name: str = "data.prompts"):
    """Any prompt file (JSONL, parquet, a ``datasets`` dir) -> (prompts, {"malformed": lines skipped, "too_long":
    prompts dropped})."""
    prompts, skipped = [], {"malformed": 0, "too_long": 0}
    path = Path(path)
    if not path.exists():
        raise DataError(f"{field_name}={str(path)!r} does not exist")
    for where, record in _records(path):
        try:
            if isinstance(record, DataError):
                raise record
            prompt = _record_to_prompt(record, tokenizer, where, fmt)
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

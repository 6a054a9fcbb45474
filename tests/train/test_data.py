"""Prompt loading: the three record shapes, line-numbered errors or counted skips, a resumable stream."""

from __future__ import annotations

import json

import pytest

from gspo_megatron.rollout.synthetic import char_tokenizer
from gspo_megatron.train.data import DataError, PromptStream, load_jsonl, task_prompts


@pytest.fixture(scope="module")
def tokenizer():
    tok = char_tokenizer(128)
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}<|im_start|>"
    return tok


def write(tmp_path, lines):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_record_shapes(tmp_path, tokenizer):
    path = write(tmp_path, [
        json.dumps({"prompt": "ab", "answer": "1"}),
        "",
        json.dumps({"messages": [{"role": "user", "content": "c"}], "answer": "2"}),
        json.dumps({"prompt_ids": [5, 6], "answer": 3}),
    ])
    prompts, skipped = load_jsonl(path, tokenizer)
    assert skipped == 0 and [p.label for p in prompts] == ["1", "2", 3]
    assert tokenizer.decode(prompts[0].ids) == "ab"
    assert tokenizer.decode(prompts[1].ids) == "<|im_start|>c<|im_end|><|im_start|>"
    assert prompts[2].ids == [5, 6]


@pytest.mark.parametrize("bad, message", [
    ("{not json", r"p.jsonl:2: not valid JSON"),
    (json.dumps({"question": "x"}), r"p.jsonl:2: needs one of 'prompt', 'messages' or 'prompt_ids'"),
    (json.dumps({"prompt_ids": [1, -2]}), r"p.jsonl:2: prompt_ids must be"),
    (json.dumps([1, 2]), r"p.jsonl:2: expected a JSON object"),
])
def test_malformed_line_is_named_or_skipped(tmp_path, tokenizer, bad, message):
    path = write(tmp_path, [json.dumps({"prompt": "ok"}), bad, json.dumps({"prompt": "ok2"})])
    with pytest.raises(DataError, match=message):
        load_jsonl(path, tokenizer)
    prompts, skipped = load_jsonl(path, tokenizer, skip_malformed=True)
    assert skipped == 1 and [p.text for p in prompts] == ["ok", "ok2"]


def test_too_long_prompt_is_named(tmp_path, tokenizer):
    with pytest.raises(DataError, match=r"p.jsonl:1: prompt has 5 tokens > rollout.max_prompt_tokens=4"):
        load_jsonl(write(tmp_path, [json.dumps({"prompt": "abcde"})]), tokenizer, max_prompt_tokens=4)


def test_stream_epochs_and_resume(tokenizer):
    prompts = task_prompts("reverse", tokenizer, 5, seed=0)
    stream = PromptStream(prompts, seed=3)
    first = stream.next(7)  # crosses into epoch 1
    assert sorted(p.text for p in first[:5]) == sorted(p.text for p in prompts)
    state = stream.state_dict()
    assert state == {"epoch": 1, "index": 2}
    rest = stream.next(6)
    resumed = PromptStream(prompts, seed=3)
    resumed.load_state_dict(state)
    assert [p.text for p in resumed.next(6)] == [p.text for p in rest]

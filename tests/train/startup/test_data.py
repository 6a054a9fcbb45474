"""Prompt loading: the three record shapes, line-numbered errors or counted skips (malformed lines, prompts over
rollout.max_prompt_tokens), a resumable stream; degenerate responses (cut at max_new_tokens, empty): counted, kept or
masked."""

from __future__ import annotations

import json

import pytest

from gspo_megatron.rewards.synthetic import char_tokenizer
from gspo_megatron.train.startup.data import (
    DataError, PromptFormat, PromptStream, check_prompt_lengths, load_jsonl, task_prompts,
)


@pytest.fixture(scope="module")
def tokenizer():
    tok = char_tokenizer(128)
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}<|im_start|>"
    return tok


def write(tmp_path, lines, name="p.jsonl"):
    path = tmp_path / name
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
    assert skipped == {"malformed": 0, "too_long": 0} and [p.label for p in prompts] == ["1", "2", 3]
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
    assert skipped == {"malformed": 1, "too_long": 0} and [p.text for p in prompts] == ["ok", "ok2"]


def test_too_long_prompt_is_named_or_dropped(tmp_path, tokenizer):
    path = write(tmp_path, [json.dumps({"prompt": "abcde"}), json.dumps({"prompt": "abcd"}), "{bad"])
    with pytest.raises(DataError, match=r"p.jsonl:1: prompt has 5 tokens > rollout.max_prompt_tokens=4"):
        load_jsonl(path, tokenizer, max_prompt_tokens=4)
    # Too long is not malformed: skip_malformed alone still stops at it.
    with pytest.raises(DataError, match=r"p.jsonl:1: prompt has 5 tokens"):
        load_jsonl(path, tokenizer, skip_malformed=True, max_prompt_tokens=4)
    prompts, skipped = load_jsonl(path, tokenizer, skip_malformed=True, max_prompt_tokens=4, drop_long=True)
    assert [p.text for p in prompts] == ["abcd"] and skipped == {"malformed": 1, "too_long": 1}
    with pytest.raises(DataError, match=r"no usable prompts \(0 malformed lines skipped, 2 prompts longer"):
        load_jsonl(write(tmp_path, [json.dumps({"prompt": "abcde"}), json.dumps({"prompt": "abcd"})]), tokenizer,
                   max_prompt_tokens=3, drop_long=True)
    # A built-in task's prompts are generated: too long is an error naming the task.
    task = task_prompts("reverse", tokenizer, 8, seed=0)
    with pytest.raises(DataError, match=r"data.task='reverse': a prompt has \d+ tokens > rollout.max_prompt_tokens=2"):
        check_prompt_lengths(task, 2, "data.task='reverse'")
    check_prompt_lengths(task, 64, "data.task='reverse'")


def test_truncated_and_empty_responses_are_counted_kept_or_masked():
    from gspo_megatron.rollout import samples_to_batch
    from gspo_megatron.rollout.types import Sample
    from gspo_megatron.train.sampling.rounds import screen_responses

    samples = [Sample([1, 2], [3, 4], [-0.1, -0.2], "stop", "0"),
               Sample([1, 2], [5, 6, 7], [-0.1] * 3, "length", "0", sample_index=1),  # cut at max_new_tokens
               Sample([1, 2], [], [], "stop", "0", sample_index=2)]  # empty
    kept, metrics = screen_responses(samples, "keep")
    assert kept.tolist() == [True, True, True]
    assert metrics == {"responses_truncated": 1.0, "responses_empty": 1.0, "truncated_masked": 0.0}
    kept, metrics = screen_responses(samples, "mask")
    assert kept.tolist() == [True, False, True] and metrics["truncated_masked"] == 1.0
    # The empty response's row has no token in the loss (its reward still counts in its group's statistics).
    batch = samples_to_batch(samples)
    assert batch["loss_mask"].sum(dim=1).tolist() == [2, 3, 0]


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


THINKING = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}<assistant>")


def test_parquet_in_verls_layout_and_a_datasets_dir(tmp_path, tokenizer):
    """verl's parquet (prompt: chat messages, reward_model.ground_truth) and the same rows as a datasets dir; the
    label reaches the reward as it is; a bad row is named."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "gsm", "prompt": [{"role": "user", "content": "ab"}],
             "reward_model": {"style": "rule", "ground_truth": "7"}, "extra_info": {"index": i}} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    prompts, _ = load_jsonl(tmp_path / "train.parquet", tokenizer)
    assert [p.label for p in prompts] == ["7"] * 3
    assert tokenizer.decode(prompts[0].ids) == "<|im_start|>ab<|im_end|><|im_start|>"
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dsd"))
    for directory in ("ds", "dsd"):
        from_disk, _ = load_jsonl(tmp_path / directory, tokenizer)
        assert [(p.ids, p.label) for p in from_disk] == [(p.ids, p.label) for p in prompts]
    with_meta, _ = load_jsonl(tmp_path / "train.parquet", tokenizer, fmt=PromptFormat(label_key="extra_info"))
    assert [p.label for p in with_meta] == [{"index": 0}, {"index": 1}, {"index": 2}]
    pq.write_table(pa.Table.from_pylist([{"prompt": "ab"}, {"prompt": ""}]), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad.parquet: row 1: prompt must be a non-empty string"):
        load_jsonl(tmp_path / "bad.parquet", tokenizer)
    (tmp_path / "garbled.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"garbled.parquet: not a readable parquet file"):
        load_jsonl(tmp_path / "garbled.parquet", tokenizer)


def test_keys_system_prompt_and_chat_template_options(tmp_path, tokenizer):
    """slime's --input-key / --label-key as data.prompt_key / label_key (dotted for nested), a system prompt and
    chat-template keyword arguments (Qwen3's enable_thinking)."""
    tok = char_tokenizer(128)
    tok.chat_template = THINKING
    path = write(tmp_path, [json.dumps({"question": "ab", "meta": {"gold": "ba"}})])
    fmt = PromptFormat(prompt_key="question", label_key="meta.gold", system_prompt="S",
                       chat_template_kwargs={"enable_thinking": False})
    (prompt,), _ = load_jsonl(path, tok, fmt=fmt)
    assert prompt.text == "<system>S<user>ab<nothink><assistant>" and prompt.label == "ba"
    assert tok.decode(prompt.ids) == prompt.text
    (plain,), _ = load_jsonl(path, tok, fmt=PromptFormat(prompt_key="question", label_key="meta.gold"))
    assert plain.text == "ab"  # plain text stays plain unless a template is asked for
    (templated,), _ = load_jsonl(path, tok, fmt=PromptFormat(prompt_key="question", apply_chat_template=True))
    assert templated.text == "<user>ab<assistant>" and templated.label is None
    with pytest.raises(DataError, match=r"p.jsonl:1: no 'meta.answer' \(data.label_key\)"):
        load_jsonl(path, tok, fmt=PromptFormat(prompt_key="question", label_key="meta.answer"))
    with pytest.raises(DataError, match=r"p.jsonl:1: no 'input' \(data.prompt_key\)"):
        load_jsonl(path, tok, fmt=PromptFormat(prompt_key="input"))


TOOLS = ("{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}{% endif %}"
         "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>")


def test_tools_reach_the_chat_template_and_the_whole_record_can_be_the_label(tmp_path):
    """A record's tool schemas (a list, or the list as a JSON string as parquet sets keep them) go to the chat
    template as its ``tools``; data.tools_key renames the field; a plain-text prompt with tools and no template is
    refused (the tools would be dropped); data.label_key="*" hands the reward the whole record."""
    tok = char_tokenizer(128)
    tok.chat_template = TOOLS
    schema = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "ab"}]
    path = write(tmp_path, [json.dumps({"messages": messages, "tools": [schema], "answer": "5"}),
                            json.dumps({"messages": messages, "tools": json.dumps([schema]), "answer": "6"}),
                            json.dumps({"messages": messages, "answer": "7", "extra": {"id": 3}})])
    prompts, _ = load_jsonl(path, tok, fmt=PromptFormat(label_key="*"))
    assert [p.text for p in prompts] == ["<tools>calc;<user>ab<assistant>"] * 2 + ["<user>ab<assistant>"]
    assert prompts[2].label == {"messages": messages, "answer": "7", "extra": {"id": 3}}
    assert tok.decode(prompts[0].ids) == prompts[0].text
    renamed = write(tmp_path, [json.dumps({"messages": messages, "functions": [schema]})], "r.jsonl")
    (no_tools,), _ = load_jsonl(renamed, tok)
    (with_tools,), _ = load_jsonl(renamed, tok, fmt=PromptFormat(tools_key="functions"))
    assert no_tools.text == "<user>ab<assistant>" and with_tools.text == "<tools>calc;<user>ab<assistant>"
    plain = write(tmp_path, [json.dumps({"prompt": "ab", "tools": [schema]})], "plain.jsonl")
    with pytest.raises(DataError, match=r"plain.jsonl:1: has tools \(data.tools_key\) but its prompt does not go "
                                        r"through the chat template"):
        load_jsonl(plain, tok)
    (templated,), _ = load_jsonl(plain, tok, fmt=PromptFormat(apply_chat_template=True))
    assert templated.text == "<tools>calc;<user>ab<assistant>"
    bad = write(tmp_path, [json.dumps({"messages": messages, "tools": {"name": "calc"}})], "bad.jsonl")
    with pytest.raises(DataError, match=r"bad.jsonl:1: tools \(data.tools_key\) must be a list of tool schemas"):
        load_jsonl(bad, tok)

"""``gspo-megatron score`` agrees with a log-likelihood computed directly with ``transformers``.

The reference here is written out independently: transformers logits -> log_softmax -> the response
tokens' log-probs, summed. Scored through Megatron (``train.update.schedules.logprob_pass``) on the converted
checkpoint and on the HF directory, under TP=2(+SP), PP=2, EP=2 and DP=2 layouts in the shared 2-rank
launch, and once from the command line. Tolerance: 1e-4 absolute
on sums of up to 9 fp32 log-probs (measured ~1e-6).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from gspo_megatron.score import Record, ScoreInputError, plan_chunks, read_records
from tests import warm_cli
from tests.model import rank_checks

ROOT = Path(__file__).resolve().parents[2]
ATOL = 1e-4


@torch.no_grad()
def transformers_loglik(hf_dir: Path, records: list[Record]) -> list[tuple[float, int]]:
    from tests.model.hf_tiny import load_hf_model

    model = load_hf_model(hf_dir)
    out = []
    for record in records:
        tokens = torch.tensor([record.prompt_ids + record.response_ids])
        logprobs = torch.log_softmax(model(tokens).logits[0].double(), dim=-1)
        total = sum(logprobs[t - 1, tokens[0, t]].item() for t in range(len(record.prompt_ids), tokens.shape[1]))
        out.append((total, len(record.response_ids)))
    return out


def assert_agrees(results: list[dict], reference: list[tuple[float, int]]) -> None:
    assert len(results) == len(reference)
    for i, (got, (want, count)) in enumerate(zip(results, reference)):
        assert got["num_tokens"] == count, f"record {i}"
        assert abs(got["logprob_sum"] - want) <= ATOL, f"record {i}: {got['logprob_sum']} vs {want}"


@pytest.mark.megatron  # checks the Megatron model's results (a session fixture built it)
@pytest.mark.parametrize("variant", list(rank_checks.SCORE_LAYOUTS))
def test_megatron_score_equals_transformers(variant, hf_models, rank_results):
    from gspo_megatron.model.hf_config import read_hf_config

    records = rank_checks.score_records_for_tests(read_hf_config(hf_models[variant]).vocab_size)
    reference = transformers_loglik(hf_models[variant], records)
    assert reference[3][1] == 0 and reference[3][0] == 0.0  # the empty response
    for source in ("megatron", "hf"):
        per_rank = rank_checks.result(rank_results, ("score", variant, source))
        assert per_rank[0]["megatron_checkpoint"] == (source == "megatron")
        for results in (r["results"] for r in per_rank):  # every rank returns every record
            assert_agrees(results, reference)


def _write_records(path: Path, records: list[Record]) -> None:
    path.write_text("".join(json.dumps({"prompt_ids": list(r.prompt_ids), "response_ids": list(r.response_ids)}) + "\n"
                            for r in records))


@pytest.mark.megatron  # checks the Megatron model's results (a session fixture built it)
def test_score_command_on_a_megatron_checkpoint(hf_models, rank_results, rank_work, tmp_path):
    """One process from a plain shell, on the converted checkpoint; JSON lines in input order."""
    records = rank_checks.score_records_for_tests(128)
    _write_records(tmp_path / "in.jsonl", records)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    command = ["score", "--model", str(rank_work / "megatron" / "qwen3_moe"), "--input", str(tmp_path / "in.jsonl"),
               "--micro-batch-size", "3", "--output", str(tmp_path / "out.jsonl")]
    out = warm_cli.run([sys.executable, "-m", "gspo_megatron.cli", *command], capture_output=True, text=True,
                     cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert all(set(r) == {"logprob_sum", "num_tokens"} for r in results)
    assert_agrees(results, transformers_loglik(hf_models["qwen3_moe"], records))


def test_score_command_starts_ranks_for_a_parallel_layout(hf_models, tmp_path, monkeypatch, capsys):
    """--tp 2 --ep 2 from a plain shell: the ranks the layout needs run ``score_on_this_rank`` (faked here: the
    ranks themselves are tested above), and rank 0's results are printed in input order."""
    from gspo_megatron import cli, score
    from gspo_megatron.parallel import launch

    records = rank_checks.score_records_for_tests(128)
    _write_records(tmp_path / "in.jsonl", records)
    calls = []

    def fake_run_on_ranks(fn, world_size, layout, *args, **kwargs):
        calls.append((fn, world_size, layout, args))
        return [[{"logprob_sum": -float(i), "num_tokens": i} for i in range(len(records))]] * world_size

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(launch, "run_on_ranks", fake_run_on_ranks)
    assert cli.main(["score", "--model", str(hf_models["qwen3_moe"]), "--input", str(tmp_path / "in.jsonl"),
                     "--tp", "2", "--ep", "2"]) == 0
    (fn, world_size, layout, args), = calls
    assert fn is score.score_on_this_rank and world_size == 4 and layout is None
    assert args[0] == str(hf_models["qwen3_moe"]) and args[1] == records
    assert (args[2].tensor, args[2].expert, args[2].sequence_parallel) == (2, 2, True)
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["num_tokens"] for line in lines] == list(range(len(records)))


def test_transformers_backend_gives_the_same_numbers(hf_models, tmp_path, capsys, monkeypatch):
    """``--backend transformers`` (one process, for comparing against the Megatron path), the model given as a
    Hugging Face repo id: its snapshot in huggingface_hub's cache (laid out here, read offline). A repo id not in
    the cache is one sentence saying so."""
    from gspo_megatron import cli
    from tests.model.hub_cache import cached_repo, offline_env

    cached_repo(tmp_path / "hub", "org/qwen3", hf_models["qwen3"])
    for name, value in offline_env(tmp_path / "hub").items():
        monkeypatch.setenv(name, value)
    records = rank_checks.score_records_for_tests(128)
    _write_records(tmp_path / "in.jsonl", records)
    assert cli.main(["score", "--model", "org/qwen3", "--input", str(tmp_path / "in.jsonl"),
                     "--backend", "transformers"]) == 0
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert_agrees(results, transformers_loglik(hf_models["qwen3"], records))
    assert cli.main(["score", "--model", "org/absent", "--input", str(tmp_path / "in.jsonl")]) == 2
    assert ("gspo-megatron score: error: --model org/absent is not a directory, and as a Hugging Face repo id it is "
            "not in the cache and this machine is offline (HF_HUB_OFFLINE=1)") in capsys.readouterr().err


def test_score_command_rejects_bad_records_naming_line_and_field(hf_models, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt_ids": [1, 2], "response_ids": [3]}\n'
                                        '{"prompt_ids": [1], "response_ids": [4, 128]}\n')
    command = ["score", "--model", str(hf_models["qwen3"]), "--input", str(tmp_path / "bad.jsonl")]
    out = warm_cli.run([sys.executable, "-m", "gspo_megatron.cli", *command], capture_output=True, text=True,
                     cwd=ROOT, timeout=120)
    assert out.returncode == 2
    assert "line 2: response_ids[1]=128 is outside the vocabulary [0, 128)" in out.stderr


@pytest.mark.parametrize("line, message", [
    ('{"prompt_ids": [], "response_ids": [1]}', "line 1: prompt_ids is empty"),
    ('{"prompt_ids": [1], "response_id": [1]}', 'line 1: expected {"prompt_ids": [...], "response_ids": [...]} or text'),
    ('{"prompt_ids": [1], "response": [1]}', 'line 1: response must be text (a string); token ids go in "response_ids"'),
    ('{"prompt_ids": [1, "a"], "response_ids": []}', "line 1: prompt_ids must be a list of integer token ids"),
    ("not json", "line 1: not JSON"),
])
def test_malformed_records(line, message, tmp_path):
    (tmp_path / "in.jsonl").write_text(line + "\n")
    with pytest.raises(ScoreInputError, match=re.escape(message)):
        read_records(tmp_path / "in.jsonl", vocab_size=10)


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_text_records_score_as_the_ids_the_model_tokenizer_gives(tmp_path, capsys):
    """A text prompt (tokenized as is, as training does), chat messages (through the model's chat template, with the
    generation prompt) and a text response (tokenized alone) score exactly as those token ids given directly, from
    the command line (transformers backend, one process). A record's text needs a tokenizer: without one, the line
    is named."""
    from transformers import AutoTokenizer

    from gspo_megatron import cli
    from gspo_megatron.rewards.synthetic import save_tiny_model

    model = save_tiny_model(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(model)
    text = [{"prompt": "Reverse abc:", "response": "cba"},
            {"messages": [{"role": "user", "content": "hi"}], "response": "ok!"}]
    ids = [{"prompt_ids": tokenizer("Reverse abc:", add_special_tokens=False)["input_ids"]},
           {"prompt_ids": tokenizer("<user>hi\n<assistant>", add_special_tokens=False)["input_ids"]}]
    for record, response in zip(ids, ("cba", "ok!")):
        record["response_ids"] = tokenizer(response, add_special_tokens=False)["input_ids"]
    assert [len(r["prompt_ids"]) for r in ids] == [12, 20]  # one token per character: prompts and template as said
    scored = []
    for name, records in (("text", text), ("ids", ids)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        assert cli.main(["score", "--model", str(model), "--input", str(tmp_path / f"{name}.jsonl"),
                         "--backend", "transformers"]) == 0
        scored.append([json.loads(line) for line in capsys.readouterr().out.splitlines()])
    assert scored[0] == scored[1] and [r["num_tokens"] for r in scored[0]] == [3, 3], scored
    with pytest.raises(ScoreInputError, match=re.escape("line 1: a text record needs the model's tokenizer, and")):
        read_records(tmp_path / "text.jsonl", tokenizer_dir=tmp_path / "no_tokenizer_here")


def test_chunks_balance_data_parallel_ranks_and_pad_to_the_sequence_multiple():
    records = [Record((1,) * p, (2,) * r) for p, r in [(3, 5), (1, 1), (2, 9), (4, 0), (1, 2)]]
    (groups, seq_len), = plan_chunks(records, micro_batch_size=2, data_parallel=2, seq_multiple=4)
    assert len(groups) % 2 == 0 and all(len(g) == 2 for g in groups)
    assert sorted(i for g in groups for i in g if i is not None) == list(range(5))
    assert seq_len == 12  # longest input: 2 + 9 - 1 = 10 tokens, rounded up to a multiple of 4

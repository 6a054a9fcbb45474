"""``gspo-megatron score``: the log-likelihood of responses under a model, to check rollout-vs-trainer agreement.

Input: JSON lines ``{"prompt_ids": [...], "response_ids": [...]}``, or text: ``{"prompt": "...", "response": "..."}``
(or ``"messages": [...]`` for the prompt), tokenized with the model's tokenizer as the trainer tokenizes prompts
(chat messages through its chat template, with the generation prompt) and the response on its own, as it was
sampled. Output: one JSON line per record, in input order, ``{"logprob_sum": float, "num_tokens": int}``: the sum over response tokens of
log p(token | prompt and the response before it) at temperature 1, and the number of response tokens.

``--model`` is an HF directory (converted in memory through the bridge), a Hugging Face repo id (its snapshot in
huggingface_hub's cache: ``model.hub``) or a Megatron checkpoint written by ``tools/convert_hf_to_megatron.py``.
The Megatron path runs ``train.update.schedules.logprob_pass``, the very log-prob pass the trainer uses, under any
``--tp/--pp/--ep`` layout: under torchrun it uses the launched ranks; from a plain shell it starts the ranks itself.
``--backend transformers`` scores an HF directory with ``transformers`` instead (one process), for comparison.

Records are sorted by length and packed into micro batches of ``--micro-batch-size`` (right-padded; the
model is causal, so padding never changes a real token's log-prob); micro batches are spread over
data-parallel ranks, every rank running the same number (expert-parallel all-to-alls span them).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

# torch and megatron are imported where used: `gspo-megatron --help` builds this parser.

CHUNK_MICRO_BATCHES = 8  # micro batches per data-parallel rank per logprob_pass call (pipeline fill)


class ScoreInputError(ValueError):
    """A record of the input file is malformed; the message names the line and field."""


@dataclass(frozen=True)
class Record:
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]

    @property
    def length(self) -> int:
        """Model input length: the last response token is only a target."""
        return len(self.prompt_ids) + len(self.response_ids) - 1


def _token_list(value, line: int, field: str, vocab_size: int | None, allow_empty: bool) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ScoreInputError(f"line {line}: {field} must be a list of integer token ids")
    if not value and not allow_empty:
        raise ScoreInputError(f"line {line}: {field} is empty: the first response token needs a prompt to condition on")
    for i, token in enumerate(value):
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise ScoreInputError(f"line {line}: {field}[{i}]={token} is outside the vocabulary [0, {vocab_size})")
    return tuple(value)


def _text_record(data: dict, tokenizer, line: int) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) of a text record: the prompt as training reads it (``data.record_to_prompt``),
    the response tokenized alone (a sampled response's ids follow the prompt's)."""
    from gspo_megatron.train.startup.data import DataError, record_to_prompt

    try:
        prompt = record_to_prompt({k: v for k, v in data.items() if k != "response"}, tokenizer, f"line {line}")
    except DataError as e:
        raise ScoreInputError(str(e)) from None
    return list(prompt.ids), tokenizer(data["response"], add_special_tokens=False)["input_ids"]


def read_records(path: str | Path, vocab_size: int | None = None, tokenizer_dir: str | Path | None = None) -> list[Record]:
    """Token-id records, and text records tokenized with ``tokenizer_dir``'s tokenizer (loaded at the first)."""
    records, tokenizer = [], None
    with open(path) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as e:
                raise ScoreInputError(f"line {line_no}: not JSON ({e})") from None
            if isinstance(data, dict) and "response_ids" not in data and "response" in data:
                if not isinstance(data["response"], str):
                    raise ScoreInputError(f'line {line_no}: response must be text (a string); token ids go in '
                                          '"response_ids"')
                if tokenizer is None:
                    tokenizer = _tokenizer(tokenizer_dir, line_no)
                data["prompt_ids"], data["response_ids"] = _text_record(data, tokenizer, line_no)
            if not isinstance(data, dict) or "prompt_ids" not in data or "response_ids" not in data:
                raise ScoreInputError(f'line {line_no}: expected {{"prompt_ids": [...], "response_ids": [...]}} or '
                                      f'text, {{"prompt" (or "messages"): ..., "response": "..."}}')
            records.append(Record(_token_list(data["prompt_ids"], line_no, "prompt_ids", vocab_size, False),
                                  _token_list(data["response_ids"], line_no, "response_ids", vocab_size, True)))
    return records


def _tokenizer(directory: str | Path | None, line: int):
    from transformers import AutoTokenizer

    if directory is None:
        raise ScoreInputError(f"line {line}: a text record needs the model's tokenizer; give token ids instead")
    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as e:
        raise ScoreInputError(f"line {line}: a text record needs the model's tokenizer, and {directory} has none "
                              f"({type(e).__name__}); give prompt_ids / response_ids instead") from None


# ---- micro batches -----------------------------------------------------------------------------------


def _micro_batch(records: list[Record | None], seq_len: int) -> dict:
    """input_ids / labels / loss_mask [b, seq_len]; None rows are padding (nothing scored)."""
    import torch

    b = len(records)
    input_ids = torch.zeros(b, seq_len, dtype=torch.long)
    labels = torch.zeros(b, seq_len, dtype=torch.long)
    loss_mask = torch.zeros(b, seq_len, dtype=torch.bool)
    for row, record in enumerate(records):
        if record is None or not record.response_ids:
            continue
        tokens = torch.tensor(record.prompt_ids + record.response_ids)
        n = len(tokens) - 1
        input_ids[row, :n] = tokens[:-1]
        labels[row, :n] = tokens[1:]
        loss_mask[row, len(record.prompt_ids) - 1 : n] = True  # label t is token t+1: the response tokens
    return {"input_ids": input_ids, "labels": labels, "loss_mask": loss_mask}


def plan_chunks(records: list[Record], micro_batch_size: int, data_parallel: int, seq_multiple: int):
    """[(record indices per micro batch (None = padding row), padded length)] per chunk.

    Each chunk has a multiple of ``data_parallel`` micro batches of one shape (the pipeline schedules need
    equal shapes within a call); micro batch j of a chunk runs on data-parallel rank j % data_parallel.
    """
    order = sorted(range(len(records)), key=lambda i: -records[i].length)
    groups = [order[i : i + micro_batch_size] for i in range(0, len(order), micro_batch_size)]
    per_chunk = CHUNK_MICRO_BATCHES * data_parallel
    chunks = []
    for start in range(0, len(groups), per_chunk):
        chunk = groups[start : start + per_chunk]
        chunk += [[] for _ in range(-len(chunk) % data_parallel)]
        longest = max([records[i].length for group in chunk for i in group] + [1])
        seq_len = -(-longest // seq_multiple) * seq_multiple
        chunks.append(([group + [None] * (micro_batch_size - len(group)) for group in chunk], seq_len))
    return chunks


# ---- the Megatron path ----------------------------------------------------------------------------------


def load_policy(model_dir: str | Path, layout, dtype=None):
    """(model, spec, padded vocab) on this rank, from an HF directory or a Megatron checkpoint (collective)."""
    from gspo_megatron.model import checkpoint
    from gspo_megatron.model.bridge import Bridge
    from gspo_megatron.model.convert import model_dtype
    from gspo_megatron.model.hf_config import read_hf_config
    from gspo_megatron.model.hf_files import open_hf_dir
    from gspo_megatron.model.mapping import is_ignored
    from gspo_megatron.model.provider import build_gpt_model

    model_dir = Path(model_dir)
    if checkpoint.is_megatron_checkpoint(model_dir):
        model_dir = checkpoint.resolve(model_dir)  # a training run's checkpoint.dir or latest: its newest step
        info = checkpoint.read_info(model_dir)
        model = build_gpt_model(info.spec, layout, dtype=dtype or checkpoint.torch_dtype(info.dtype),
                                padded_vocab_size=info.padded_vocab_size)
        checkpoint.load_weights(model, model_dir)
        return model, info.spec, info.padded_vocab_size
    source = open_hf_dir(model_dir)  # FP8 block-scaled weights dequantized on read
    spec = read_hf_config(model_dir).named_as(source.shapes())
    bridge = Bridge(spec)
    dtype = dtype or model_dtype({n: d for n, d in source.dtypes().items() if not is_ignored(n)})
    model = build_gpt_model(spec, layout, dtype=dtype, padded_vocab_size=bridge.padded_vocab_size)
    bridge.load_hf_weights(model, source)
    return model, spec, bridge.padded_vocab_size


def score_records(model, records: list[Record], micro_batch_size: int = 4) -> list[dict]:
    """Score on this rank's share and gather: every rank returns all records' results (collective)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from gspo_megatron.parallel.context import sequence_multiple
    from gspo_megatron.train.update.schedules import logprob_pass

    model.eval()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    seq_multiple = sequence_multiple(ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size(),
                                     model.config.sequence_parallel)
    mine: dict[int, dict] = {}
    for micro_groups, seq_len in plan_chunks(records, micro_batch_size, dp, seq_multiple):
        local = micro_groups[dp_rank::dp]
        batches = [_micro_batch([records[i] if i is not None else None for i in group], seq_len) for group in local]
        out = logprob_pass(model, batches)
        sums, counts = out["seq_logprob"].tolist(), out["num_tokens"].tolist()  # one copy from the device
        rows = [i for group in local for i in group]
        for row, index in enumerate(rows):
            if index is not None:
                mine[index] = {"logprob_sum": sums[row], "num_tokens": int(counts[row])}
    if dp > 1:
        every = [None] * dp
        dist.all_gather_object(every, mine, group=ps.get_data_parallel_group())
        for other in every:
            mine.update(other)
    return [mine[i] for i in range(len(records))]


def score_on_this_rank(model_dir: str, records: list[Record], layout, micro_batch_size: int,
                       dtype: str | None) -> list[dict]:
    """Start Megatron's groups for ``layout`` (or reuse fitting ones), load, score."""
    import torch

    from gspo_megatron.model.process_groups import ensure_model_parallel

    ensure_model_parallel(layout)
    model, _, _ = load_policy(model_dir, layout, getattr(torch, dtype) if dtype else None)
    return score_records(model, records, micro_batch_size)


# ---- the transformers path --------------------------------------------------------------------------------


def score_with_transformers(hf_dir: str | Path, records: list[Record], dtype: str | None = None) -> list[dict]:
    """The same numbers straight from ``transformers`` (one process, one record at a time)."""
    import torch

    with torch.no_grad():  # scoped: a library call must not switch autograd off for its caller
        return _score_with_transformers(hf_dir, records, dtype)


def _score_with_transformers(hf_dir, records, dtype):
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    from gspo_megatron.model.hf_config import load_config_json
    from gspo_megatron.model.hf_files import is_quantized, plain_copy

    torch_dtype = getattr(torch, dtype) if dtype else "auto"
    if is_quantized(load_config_json(Path(hf_dir) / "config.json")):  # the weights load_policy reads, dequantized
        with tempfile.TemporaryDirectory(prefix="gspo_score_") as scratch:
            model = AutoModelForCausalLM.from_pretrained(str(plain_copy(hf_dir, Path(scratch) / "model")),
                                                         dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch_dtype)
    model.eval()
    results = []
    for record in records:
        if not record.response_ids:
            results.append({"logprob_sum": 0.0, "num_tokens": 0})
            continue
        tokens = torch.tensor([record.prompt_ids + record.response_ids])
        logits = model(tokens[:, :-1]).logits.float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None])[0, :, 0]
        response = logprobs[len(record.prompt_ids) - 1 :]
        results.append({"logprob_sum": float(response.sum()), "num_tokens": len(record.response_ids)})
    return results


# ---- the command ---------------------------------------------------------------------------------------------


def _model_spec(model_dir: Path):
    from gspo_megatron.model import checkpoint
    from gspo_megatron.model.hf_config import read_hf_config

    if checkpoint.is_megatron_checkpoint(model_dir):
        info = checkpoint.read_info(model_dir)
        return info.spec, info.padded_vocab_size
    spec = read_hf_config(model_dir)
    return spec, spec.padded_vocab_size()


def _write(results: list[dict], output: str | None) -> None:
    lines = "".join(json.dumps(r) + "\n" for r in results)
    if output:
        Path(output).write_text(lines)
    else:
        sys.stdout.write(lines)
        sys.stdout.flush()


def run(args) -> int:
    """The ``score`` subcommand (args from ``cli.build_parser``)."""
    from gspo_megatron.model.errors import LayoutError
    from gspo_megatron.model.layout_check import check_layout, minimal_world_size
    from gspo_megatron.parallel.groups import layout_from_args
    from gspo_megatron.parallel.launch import run_on_ranks

    layout = layout_from_args(args)
    try:
        from gspo_megatron.model import hub

        model_dir = Path(hub.resolve(args.model, "--model"))  # a Hugging Face repo id: its snapshot in the hub cache
        if not model_dir.exists():
            raise FileNotFoundError(f"--model {model_dir} does not exist")
        from gspo_megatron.model import checkpoint

        if checkpoint.is_megatron_checkpoint(model_dir):
            model_dir = checkpoint.resolve(model_dir)  # a training run's checkpoint.dir or latest: its newest step
        elif not model_dir.is_dir():
            raise FileNotFoundError(f"--model {model_dir} is not a directory")
        spec, padded = _model_spec(model_dir)
        if not checkpoint.is_megatron_checkpoint(model_dir):  # names and shapes of the HF tensors (headers only)
            from gspo_megatron.model.bridge import Bridge
            from gspo_megatron.model.hf_files import open_hf_dir

            Bridge(spec).check_hf_tensors(open_hf_dir(model_dir).shapes())  # as load_policy reads it
        # text records: the tokenizer of the HF directory, or the one a Megatron checkpoint keeps in its hf/
        tokenizer_dir = model_dir / checkpoint.HF_DIR if checkpoint.is_megatron_checkpoint(model_dir) else model_dir
        records = read_records(args.input, spec.vocab_size, tokenizer_dir)
        if args.backend == "transformers":
            if (args.tp, args.pp, args.ep) != (1, 1, 1):
                raise LayoutError("--backend transformers runs in one process: drop --tp/--pp/--ep")
            _write(score_with_transformers(model_dir, records, args.dtype), args.output)
            return 0
        torchrun = "WORLD_SIZE" in os.environ
        world = int(os.environ["WORLD_SIZE"]) if torchrun else minimal_world_size(layout)
        check_layout(spec, layout, world, padded_vocab_size=padded)
    except (FileNotFoundError, ValueError, NotImplementedError) as e:  # ScoreInputError, the model package's errors
        print(f"gspo-megatron score: error: {e}", file=sys.stderr)
        return 2
    if torchrun or world == 1:
        results = score_on_this_rank(str(model_dir), records, layout, args.micro_batch_size, args.dtype)
        if int(os.environ.get("RANK", "0")) == 0:
            _write(results, args.output)
        return 0
    # From a plain shell: start the ranks here (gloo on CPU, NCCL on GPUs).
    results = run_on_ranks(score_on_this_rank, world, None, str(model_dir), records, layout, args.micro_batch_size,
                           args.dtype)
    _write(results[0], args.output)
    return 0


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="HF directory, Hugging Face repo id (org/name: its snapshot "
                        "in huggingface_hub's cache, downloaded there if online) or Megatron checkpoint (a converted "
                        "model, a training run's checkpoint.dir, its step_N dir or latest)")
    parser.add_argument("--input", required=True, help="JSONL with prompt_ids and response_ids, or with prompt "
                        "(or messages) and response as text (tokenized with the model's tokenizer)")
    parser.add_argument("--output", help="where to write the JSONL results (default: stdout)")
    # parallel.groups.add_layout_arguments's options, written out: that module imports torch, and building the
    # command line must not
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    parser.add_argument("--etp", type=int, default=None, help="expert-tensor-parallel size (default: --tp)")
    parser.add_argument("--first-stage-layers", type=int, default=None,
                        help="layers of the first pipeline stage (uneven stages; default: an even split)")
    parser.add_argument("--last-stage-layers", type=int, default=None,
                        help="layers of the last pipeline stage (uneven stages; default: an even split)")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="weights dtype (default: the checkpoint's)")
    parser.add_argument("--backend", choices=("megatron", "transformers"), default="megatron",
                        help="transformers: score an HF directory with transformers instead, for comparison")

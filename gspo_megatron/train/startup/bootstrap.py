"""What the loop needs before its first step: the model directory, tokenizer, prompts, reward, loss config."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from gspo_megatron.model.bridge import Bridge
from gspo_megatron.model.hf_config import load_config_json, read_hf_config, text_config
from gspo_megatron.model import fp8, hub
from gspo_megatron.model.errors import ModelNotFound
from gspo_megatron.model.hf_files import is_quantized, open_hf_dir, plain_copy, quantized_copy
from gspo_megatron.parallel import control
from gspo_megatron.rewards import rewards, sandbox
from gspo_megatron.rewards.code_tests import parse_tests
from gspo_megatron.rewards.reward_pool import RewardPool
from gspo_megatron.rewards.synthetic import demonstration, make_problems, save_tiny_model, tiny_config
from gspo_megatron.rewards.user_code import load_named
from gspo_megatron.train.startup.config import Config, ConfigError, correction
from gspo_megatron.train.startup.run_dirs import ENGINE_MODEL
from gspo_megatron.train.startup.data import (LABEL_KEYS, PromptFormat, PromptStream, check_prompt_lengths,
                                              load_jsonl, task_prompts)
from gspo_megatron.train.update.loss import LossConfig


def loss_config(cfg: Config) -> LossConfig:
    a = cfg.algo  # an unset clip bound is the algorithm's (algo.defaults.CLIP_RANGES)
    return LossConfig(
        name=a.name, eps_low=a.eps_low, eps_high=a.eps_high,
        max_log_ratio=a.max_log_ratio, grpo_aggregation=a.grpo_aggregation, kl_coef=a.kl_coef,
        kl_estimator=a.kl_estimator, entropy_coef=a.entropy_coef, temperature=cfg.rollout.temperature,
        fused_loss=a.fused_loss, correction=correction(cfg),
        reuse_rollout_logprobs=cfg.rollout.reuse_rollout_logprobs,
    )


def reward_function(cfg: Config, segments: bool = False):
    """The reward (``data.reward``, or with ``segments`` ``data.segment_reward``): in ``data.reward_workers`` worker
    processes with a time limit per call (started by rank 0's first scoring; the others never score), or with 0
    workers the function itself."""
    spec, builtin = (cfg.data.segment_reward, "BUILTIN_SEGMENTS") if segments else (cfg.data.reward, "BUILTIN")
    fn = rewards.load_reward_fn(spec, getattr(rewards, builtin))  # a bad spec fails here, before anything starts
    if not cfg.data.reward_workers:
        return fn
    return RewardPool(spec, cfg.data.reward_workers, cfg.data.reward_timeout_s, builtin)


def _accepts(url: str) -> bool:
    import socket
    from urllib.parse import urlparse

    parsed = urlparse(url if "://" in url else f"http://{url}")
    try:
        with socket.create_connection((parsed.hostname, parsed.port or 80), timeout=5):
            return True
    except OSError:
        return False


def wait_for_urls(urls: list[str], wait_s: float, note_every_s: float = 15.0) -> None:
    """Attached servers (rollout.urls) accept connections, waited for up to ``wait_s`` (rollout.attached_wait_s)
    saying what is awaited every ``note_every_s``, else a ConfigError naming them."""
    import time

    start = time.monotonic()
    next_note = start
    while True:
        pending = [url for url in urls if not _accepts(url)]
        if not pending:
            return
        now = time.monotonic()
        if now - start >= wait_s:
            raise ConfigError(f"rollout.urls: {pending} refuse connections (waited {wait_s:g} s: "
                              "rollout.attached_wait_s); start the servers (python -m gspo_megatron.rollout.serve) "
                              "or correct the addresses")
        if now >= next_note:
            print(f"gspo-megatron train: waiting up to {wait_s - (now - start):.0f} s more for {pending} to accept "
                  "connections", flush=True)
            next_note = now + note_every_s
        time.sleep(min(1.0, max(0.0, wait_s - (now - start))))


def preflight(cfg: Config, rank: int = 0) -> None:
    """What can fail from the config and its files, checked before anything is built: the reward functions resolve
    and a user's reward scores the first prompt (``try_reward``), the code sandbox can confine (data.sandbox, with
    code_tests or rollout.env=python), attached servers (rollout.urls, rank 0) accept connections, and with an
    existing model directory its safetensors match its config.json and every prompt line reads and tokenizes within
    rollout.max_prompt_tokens and has the label a built-in reward needs (a DataError names the file and line; a custom
    reward is warned when no record has a label). A model still to be built from model.tiny has no tokenizer yet."""
    for name, builtin in (("reward", rewards.BUILTIN), ("segment_reward", rewards.BUILTIN_SEGMENTS)):
        spec = getattr(cfg.data, name)
        if spec:
            try:
                load_named(spec, builtin, f"data.{name}", "module:function", "callable")
            except ValueError as e:
                raise ConfigError(str(e)) from None
    if cfg.data.reward == "code_tests" or cfg.rollout.env == "python" or cfg.data.sandbox != "confined":
        try:  # the reward workers inherit the mode; a host that cannot confine refuses here, before anything starts
            sandbox.select(cfg.data.sandbox)
        except (sandbox.SandboxUnavailable, ValueError) as e:
            raise ConfigError(str(e)) from None
    if cfg.data.task:  # (a prompt file's first record is tried below, once it is read)
        problem = make_problems(cfg.data.task, 1, seed=cfg.data.seed)[0]
        try_reward(cfg, problem.prompt, problem.answer, f"the first problem of data.task={cfg.data.task!r}")
    if cfg.rollout.engine == "sglang" and cfg.rollout.urls and rank == 0:  # only rank 0 talks to the servers
        wait_for_urls(list(cfg.rollout.urls), cfg.rollout.attached_wait_s)
    hf_dir = Path(cfg.model.hf_dir)
    if not (hf_dir / "config.json").is_file():
        return
    if not cfg.model.megatron_checkpoint:  # the safetensors' names and shapes against the config (headers only)
        try:
            shapes = open_hf_dir(hf_dir).shapes()
            Bridge(read_hf_config(hf_dir).named_as(shapes)).check_hf_tensors(shapes)  # as the load reads it
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(f"model.hf_dir={cfg.model.hf_dir!r}: {e}") from None
    if cfg.data.prompts:
        _, stream, _ = load_prompts(cfg, hf_dir, quiet=True)
        d = cfg.data
        if rank == 0 and not d.label_key and all(p.label is None for p in stream.prompts):
            # a custom reward may need none, but a misspelt label key would train on nothing: say so, once
            print(f"gspo-megatron train: warning: no record of data.prompts={d.prompts!r} has a label (none of "
                  f"{', '.join(LABEL_KEYS)}): data.reward={d.reward!r} gets label=None (data.label_key names the "
                  "field)", file=sys.stderr, flush=True)
        first = stream.prompts[0]
        try_reward(cfg, first.text, first.label, f"the first record of data.prompts={d.prompts!r}")


def try_reward(cfg: Config, prompt: str, label, where: str) -> None:
    """Call a user's ``data.reward`` once, before anything is built, on ``prompt`` with a response equal to its label
    (what a right answer looks like), within data.reward_timeout_s: a wrong signature or a bug is one sentence naming
    the function and the user's failing line, not a traceback after the first rollout. Built-ins are not called."""
    import numbers
    import threading

    spec = cfg.data.reward
    if spec in rewards.BUILTIN or cfg.rollout.env:  # rollout.env: the environment's rewards, not this one
        return
    fn = rewards.load_reward_fn(spec)
    response = "" if label is None else str(label)
    outcome: dict = {}

    def call():
        try:
            outcome["value"] = fn(prompt, response, label)
        except BaseException as e:  # a user function may raise anything: reported below
            outcome["error"] = e

    # a thread, so that a reward that hangs cannot hold the start: the process exits with the error below
    thread = threading.Thread(target=call, name="reward-check", daemon=True)
    thread.start()
    thread.join(cfg.data.reward_timeout_s)
    called = (f"data.reward={spec!r} called on {where} (prompt {prompt[:60]!r}, a response equal to its label "
              f"{response[:60]!r})")
    if thread.is_alive():
        raise ConfigError(f"{called} did not return within {cfg.data.reward_timeout_s:g} s (data.reward_timeout_s)")
    if "error" in outcome:
        e = outcome["error"]
        raise ConfigError(f"{called} raised {type(e).__name__}: {e} ({_user_line(fn, e)})")
    value = outcome["value"]
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value or abs(value) == float("inf"):
        raise ConfigError(f"{called} returned {value!r} ({type(value).__name__}), not a finite number")


def _user_line(fn, error: BaseException) -> str:
    """Where ``error`` came from in the user's file: the traceback's last frame in the file that defines ``fn``, else
    (a call that never entered it, e.g. a wrong signature) the function's own definition."""
    import traceback

    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__call__", None), "__code__", None)
    if code is None:
        return "no source file"
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == code.co_filename]
    if frames:
        return f"{frames[-1].filename}:{frames[-1].lineno}"
    return f"{getattr(fn, '__qualname__', code.co_name)} is defined at {code.co_filename}:{code.co_firstlineno}"


def resolve_hub_model(cfg: Config, files: list[str] = hub.MODEL_FILES) -> None:
    """``model.hf_dir`` given as a Hugging Face repo id (``Qwen/Qwen3-30B-A3B``: nothing at that path, and no
    ``model.tiny`` to build there) becomes its snapshot in huggingface_hub's cache (``model.hub.resolve``, as
    ``score --model`` and the converters' model directories are), downloaded first when the machine is online."""
    if cfg.model.tiny:
        return
    try:
        cfg.model.hf_dir = hub.resolve(cfg.model.hf_dir, "model.hf_dir", files)
    except ModelNotFound as e:
        raise ConfigError(str(e)) from None


def model_hf_config(cfg: Config) -> dict:
    """The model's Hugging Face config without building or loading it: ``model.hf_dir``'s config.json, or the
    config ``model.tiny`` will build there. For checking the layout against the model before anything starts."""
    config = Path(cfg.model.hf_dir) / "config.json" if cfg.model.hf_dir else None
    if config is not None and config.is_file():
        try:
            return load_config_json(config)
        except ValueError as e:
            raise ConfigError(f"model.hf_dir: {e}") from None
    if cfg.model.tiny:
        try:
            return tiny_config(**cfg.model.tiny).to_dict()
        except (TypeError, ValueError) as e:
            raise ConfigError(f"model.tiny: {e}") from None
    if not cfg.model.hf_dir:
        raise ConfigError("model.hf_dir must be set (a Hugging Face model directory, or where to build model.tiny)")
    raise ConfigError(f"model.hf_dir={cfg.model.hf_dir!r} has no config.json and model.tiny is empty")


def prepare_model_dir(cfg: Config) -> Path:
    """``model.hf_dir``, built first (on rank 0) from ``model.tiny`` when it does not exist yet."""
    hf_dir = Path(cfg.model.hf_dir)
    if not cfg.model.hf_dir:
        raise ConfigError("model.hf_dir must be set (a Hugging Face model directory, or where to build model.tiny)")
    if not (hf_dir / "config.json").is_file():
        if not cfg.model.tiny:
            raise ConfigError(f"model.hf_dir={cfg.model.hf_dir!r} has no config.json and model.tiny is empty")
        if dist.get_rank() == 0:
            build_tiny_model(cfg, hf_dir)
        control.barrier()  # the others wait for rank 0's build and warm start where no NCCL watchdog fires
    return hf_dir


def rollout_fp8_scheme(cfg: Config, config: dict) -> fp8.Fp8Scheme | None:
    """``rollout.fp8``'s quantization of the served and synced weights for the model of ``config`` (its
    config.json), None when off."""
    if not cfg.rollout.fp8:
        return None
    text = text_config(config)
    scheme = fp8.Fp8Scheme(int(text["num_hidden_layers"]), keep_layers=cfg.rollout.fp8_keep_layers)
    unservable = scheme.unservable_size(text, int(cfg.rollout.server_args.get("tp_size") or 1))
    if unservable:
        raise ConfigError(f"rollout.fp8=true: model.hf_dir's config.json has {unservable}")
    return scheme


def engine_model_dir(cfg: Config, hf_dir: Path) -> Path:
    """The HF directory the rollout engine loads: ``hf_dir`` itself, or a copy in ``logging.dir`` (written once by
    rank 0; collective) that serves the weights the trainer syncs. With FP8 rollouts (``rollout.fp8``), its
    block-FP8 copy (``hf_files.quantized_copy``: ``quantization_config`` in config.json, so SGLang builds FP8 layers
    for the FP8 tensors every sync sends); else, for a quantized checkpoint (block-scaled FP8, gpt-oss's MXFP4), its
    dequantized copy (the trainer holds the dequantized weights and syncs them in that dtype: an SGLang server given
    the FP8 directory would build FP8 layers, and transformers cannot load one without a GPU)."""
    config = load_config_json(hf_dir / "config.json")
    scheme = rollout_fp8_scheme(cfg, config)
    if scheme is None and not is_quantized(config):
        return hf_dir
    if cfg.rollout.engine == "sglang" and cfg.rollout.urls:  # the user's servers: they loaded what they loaded
        if dist.get_rank() == 0:
            served = ("a block-FP8 copy with rollout.fp8's quantization_config (tools/convert_megatron_to_hf.py "
                      "--fp8)" if scheme else "its dequantized weights (docs/models.md)")
            print(f"gspo-megatron train: the servers of rollout.urls must serve {served}, as the trainer syncs those",
                  flush=True)
        return hf_dir
    out = Path(cfg.logging.dir).absolute() / ENGINE_MODEL
    if dist.get_rank() == 0:
        source = "block-scaled FP8" if fp8.block_size(config) else "MXFP4"
        what = "block-FP8 copy (rollout.fp8)" if scheme else f"dequantized copy (it is {source})"

        def announce(path: Path) -> None:
            print(f"gspo-megatron train: writing model.hf_dir's {what} for the rollout engine to {path}", flush=True)
        if scheme:
            quantized_copy(hf_dir, out, scheme, announce)
        else:
            plain_copy(hf_dir, out, announce)
    control.barrier()  # the others wait where no NCCL watchdog fires
    return out


def build_tiny_model(cfg: Config, hf_dir: Path) -> None:
    """A random Qwen3-MoE of ``model.tiny``'s sizes with the character tokenizer, optionally warm-started."""
    tmp = hf_dir.with_name(hf_dir.name + ".tmp")
    save_tiny_model(tmp, seed=cfg.train.seed, **cfg.model.tiny)
    if cfg.model.warm_start_steps:
        if not cfg.data.task:
            raise ConfigError("model.warm_start_steps needs data.task (it trains on the task's examples)")
        warm_start(tmp, cfg)
    tmp.rename(hf_dir)


def warm_start(hf_dir: Path, cfg: Config) -> None:
    """Supervised steps on the task's demonstrations, 32 per step, with transformers, in place."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.model.warm_start_lr)
    # Examples disjoint from the RL prompts' seed, so the warm start does not see the training prompts.
    problems = make_problems(cfg.data.task, 32 * cfg.model.warm_start_steps, seed=cfg.data.seed + 10_007)
    # One thread: a tiny model's ops are too small to share, and a second thread waiting for a busy core slows every
    # op (20 steps of the tool-use example: 1.6 s on one thread, 15.7 s on two, 2 cores with one kept busy).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model.train()
        for step in range(cfg.model.warm_start_steps):
            ids, labels = demonstration_batch(problems[step * 32:(step + 1) * 32], tokenizer)
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    model.eval()
    model.save_pretrained(str(hf_dir))


def demonstration_batch(problems, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """The problems' demonstrations (``synthetic.demonstration``: the prompt, then the answer and EOS, or a
    multi-turn transcript) as input ids [B, S] (padded with EOS) and labels [B, S]: the model's turns' tokens, -100
    on the prompt, the observations and the padding (learn what the model says, not what it is told)."""
    rows = []
    for problem in problems:
        ids, labels = [], []
        for text, trained in demonstration(problem):
            segment = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += segment
            labels += segment if trained else [-100] * len(segment)
        rows.append((ids, labels))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.eos_token_id)
    labels = torch.full((len(rows), width), -100)
    for i, (row, row_labels) in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        labels[i, :len(row)] = torch.tensor(row_labels)
    return ids, labels


def load_prompts(cfg: Config, hf_dir: Path, quiet: bool = False):
    """(tokenizer, training PromptStream, eval prompts)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    d = cfg.data
    limit, drop_long = cfg.rollout.max_prompt_tokens, d.long_prompts == "drop"
    if d.task:
        train = task_prompts(d.task, tokenizer, 4096, seed=d.seed)
        evals = task_prompts(d.task, tokenizer, 64, seed=d.seed + 1) if cfg.train.eval_every else []
        check_prompt_lengths(train + evals, limit, f"data.task={d.task!r}")
    else:
        fmt = PromptFormat(prompt_key=d.prompt_key, label_key=d.label_key, tools_key=d.tools_key,
                           system_prompt=d.system_prompt, chat_template_kwargs=d.chat_template_kwargs,
                           apply_chat_template=d.apply_chat_template,
                           label_needed_by=d.reward if d.reward in rewards.NEEDS_LABEL else "")
        check = parse_tests if d.reward == "code_tests" else None  # a test the grader cannot grade: its line
        train, skipped = load_jsonl(d.prompts, tokenizer, d.skip_malformed, limit, drop_long, fmt, check_label=check)
        evals, eval_skipped = load_jsonl(d.eval_prompts, tokenizer, d.skip_malformed, limit, drop_long, fmt,
                                         "data.eval_prompts", check) if d.eval_prompts else ([], {})
        for name, counts in (("data.prompts", skipped), ("data.eval_prompts", eval_skipped)):
            if any(counts.values()) and not quiet and dist.get_rank() == 0:
                print(f"{name}: skipped {counts['malformed']} malformed lines (data.skip_malformed=true) and "
                      f"dropped {counts['too_long']} prompts over rollout.max_prompt_tokens (data.long_prompts=drop)")
    return tokenizer, PromptStream(train, seed=d.seed), evals

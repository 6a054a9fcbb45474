"""Every multi-rank check of tests/model and tests/tools, run in ONE launch of 2 gloo ranks per session.

Start-up (spawn, import megatron, process groups) costs 15-30 s per launch on the 2-core machines while a
case costs ~0.3 s, so ``shared_results`` runs all cases once and caches the per-rank results on disk for
every test that asks (both folders' fixtures). Cases run phase by phase, grouped by layout so that Megatron's
process groups are rebuilt only when the group shape changes (``process_groups.ensure_model_parallel``):

- ``bridge``: HF dir -> Megatron model (bridge) -> logits vs transformers; export vs the HF files.
- ``to_megatron`` / ``to_hf``: hf_to_megatron under one layout, megatron_to_hf under another (resharding).
- ``score``: ``score.score_records`` on the converted checkpoint and on the HF directory.
- ``bad_checkpoint``: megatron_to_hf of deliberately mismatched checkpoints must fail, naming the tensors.
- ``extra_tensors``: a checkpoint with optimizer state converts; one with an extra model tensor does not.
"""

from __future__ import annotations

import json
import shutil
import traceback
from pathlib import Path
from unittest import mock

import torch

from gspo_megatron.parallel.groups import Layout
from tests.model import hf_tiny

# ---- bridge ----------------------------------------------------------------------------------------------


def megatron_logits(model, tokens: torch.Tensor):
    """Full-vocabulary logits [b, s, V_padded] on the last pipeline stage (None elsewhere), via the schedule."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    seen = []
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)

    def forward_step(data_iterator, model):
        output = model(next(data_iterator), positions, attention_mask=None)

        def loss_func(output_tensor):
            seen.append(output_tensor.detach())
            return torch.zeros(()), {}

        return output, loss_func

    with torch.no_grad():
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([tokens]), model=[model],
                                    num_microbatches=1, seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0],
                                    forward_only=True)
    if not ps.is_pipeline_last_stage():
        return None
    local = seen[0]
    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        return local
    shards = [torch.empty_like(local) for _ in range(tp)]
    torch.distributed.all_gather(shards, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=-1)


def bridge_case(hf_dir: str, layout: Layout, source: str = "dir", control: bool = False, **build) -> dict:
    """Logits against transformers' and the export against the HF files, on this rank.

    ``source="dict"`` loads from an in-memory {name: tensor} dict (the weight-sync path) instead of files.
    ``control``: load q/k/v stacked as [q; k; v] (not Megatron's per-group layout); the logits must differ.
    ``build``: more ``build_gpt_model`` arguments.
    """
    from gspo_megatron.model import mapping, sharding
    from gspo_megatron.model.bridge import Bridge
    from gspo_megatron.model.hf_config import read_hf_config
    from gspo_megatron.model.hf_files import SafetensorsDir
    from gspo_megatron.model.process_groups import ensure_model_parallel
    from gspo_megatron.model.provider import build_gpt_model

    ensure_model_parallel(layout)
    spec = read_hf_config(hf_dir)
    bridge = Bridge(spec)
    files = SafetensorsDir(hf_dir)
    model = build_gpt_model(spec, layout, **build)
    weights = {name: files.read(name) for name in files.shapes()} if source == "dict" else hf_dir
    if control:
        grouped_join = sharding.join

        def plain_qkv_join(kind, parts, *sizes):
            return torch.cat(parts) if kind == mapping.QKV else grouped_join(kind, parts, *sizes)

        with mock.patch.object(sharding, "join", plain_qkv_join):
            bridge.load_hf_weights(model, weights)
    else:
        bridge.load_hf_weights(model, weights)
    reference = torch.load(Path(hf_dir).parent / f"{Path(hf_dir).name}.reference.pt")
    logits = megatron_logits(model, reference["tokens"])
    result = {}
    if logits is not None:
        result["logits_diff"] = (logits[..., : spec.vocab_size] - reference["logits"]).abs().max().item()
        padding = logits[..., spec.vocab_size :]
        result["padding_logits"] = padding.abs().max().item() if padding.numel() else 0.0
    if control:
        return result
    exported = list(bridge.export_hf_weights(model))
    result["exported"] = [name for name, _ in exported]
    result["not_bitwise"] = [name for name, tensor in exported if not hf_tiny.same_bits(tensor, files.read(name))]
    result["export_names_match"] = bridge.export_names(model) == result["exported"]
    result.update(_export_to_sender(bridge, model, files))
    result["attention"] = {name: tuple(p.shape) for name, p in model.named_parameters()
                           if name.startswith("decoder.layers.0.self_attention.linear_")}
    result["attention_class"] = type(model.decoder.layers[0].self_attention).__name__
    return result


def fused_down_proj_case(hf_dir: str, layout: Layout) -> dict:
    """``bridge_case`` with megatron's fused MLA down projection (``mla_down_proj_fusion``), or the sentence that
    refuses it on a megatron-core without it."""
    from gspo_megatron.model.mla import megatron_has_down_proj_fusion

    if not megatron_has_down_proj_fusion():
        from gspo_megatron.model.hf_config import read_hf_config
        from gspo_megatron.model.provider import build_gpt_model

        try:
            build_gpt_model(read_hf_config(hf_dir), layout, mla_down_proj_fusion=True)
        except ValueError as e:
            return {"refused": str(e)}
        return {"refused": None}
    return bridge_case(hf_dir, layout, "dir", mla_down_proj_fusion=True)


def _export_to_sender(bridge, model, files) -> dict:
    """The weight-sync export: what this rank yields, bit for bit, and which collectives it took part in."""
    from gspo_megatron.model.bridge import is_stage_sender

    calls = {"gather": 0, "all_gather": 0}

    def counting(name):
        real = getattr(torch.distributed, name)

        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return call

    with mock.patch.object(torch.distributed, "gather", counting("gather")), \
            mock.patch.object(torch.distributed, "all_gather", counting("all_gather")):
        sent = list(bridge.export_to_sender(model))
    return {"sender": is_stage_sender(), "to_sender": [name for name, _ in sent], "to_sender_collectives": calls,
            "to_sender_not_bitwise": [n for n, t in sent if not hf_tiny.same_bits(t, files.read(n))]}


def pp2_layout(hf_dir) -> Layout:
    """Two pipeline stages: an even split, or the first layer alone on stage 0 where the count is odd."""
    from gspo_megatron.model.hf_config import read_hf_config

    odd = read_hf_config(hf_dir).num_layers % 2
    return Layout(pipeline=2, first_stage_layers=1 if odd else None)


def bridge_cases(hf_models: dict) -> list:
    cases = []
    for name, path in hf_models.items():
        moe = name in hf_tiny.MOE_VARIANTS
        path = str(path)
        cases.append((("bridge", name, "tp1_dict"), bridge_case, (path, Layout(), "dict"), Layout()))
        if name not in hf_tiny.MLA_VARIANTS:
            cases.append((("bridge", name, "control"), bridge_case, (path, Layout(), "dir", True), Layout()))
        tp2 = Layout(tensor=2, sequence_parallel=moe, expert_tensor=1 if name in hf_tiny.EXPERT_BIAS_VARIANTS else None)
        cases.append((("bridge", name, "tp2"), bridge_case, (path, tp2), tp2))
        pp2 = pp2_layout(path)
        cases.append((("bridge", name, "pp2"), bridge_case, (path, pp2), pp2))
        if name == "deepseek_v3":  # q LoRA: megatron's fused down projection, at world 1 (two replicas) and TP2
            cases.append((("bridge", name, "tp1_fused"), fused_down_proj_case, (path, Layout()), Layout()))
            cases.append((("bridge", name, "tp2_fused"), fused_down_proj_case, (path, tp2), tp2))
        if moe:
            cases.append((("bridge", name, "ep2"), bridge_case, (path, Layout(expert=2)), Layout(expert=2)))
            # dense layers split over TP=2, experts over EP=2 on the same two ranks without expert-TP
            mixed = Layout(tensor=2, expert=2, expert_tensor=1, sequence_parallel=True)
            cases.append((("bridge", name, "tp2_ep2_etp1"), bridge_case, (path, mixed), mixed))
    return cases


# ---- conversion --------------------------------------------------------------------------------------------

TP2, TP2_SP, PP2, EP2, DP2 = (Layout(tensor=2), Layout(tensor=2, sequence_parallel=True), Layout(pipeline=2),
                              Layout(expert=2), Layout())
# (layout converted under, layout converted back under): every pair reshards.
CONVERT_LAYOUTS = {
    "qwen3_moe": (EP2, TP2_SP),
    "qwen3_moe_step2": (TP2_SP, PP2),
    "qwen3": (PP2, TP2),
    "qwen2": (TP2, PP2),
    "llama": (DP2, TP2),
    "glm4_moe": (Layout(tensor=2, expert=2, expert_tensor=1, sequence_parallel=True), PP2),
    "deepseek_v3": (PP2, Layout(tensor=2, expert=2, expert_tensor=1, sequence_parallel=True)),
    "moonlight": (Layout(pipeline=2, first_stage_layers=1), TP2_SP),  # three layers: uneven stages
    "gpt_oss": (Layout(tensor=2, expert=2, expert_tensor=1, sequence_parallel=True), PP2),  # stacked experts
    "minimax_m2": (TP2_SP, EP2),  # the whole-projection q/k norms split over TP, resharded to one rank
    hf_tiny.BF16: (TP2_SP, EP2),  # bf16 weights: megatron keeps the norms in fp32; the way back restores bf16
}


def to_megatron_case(hf_dir: str, megatron_dir: str, layout: Layout) -> dict:
    from gspo_megatron.model.convert import hf_to_megatron

    hf_to_megatron(hf_dir, megatron_dir, layout)
    return {"done": True}


def to_hf_case(megatron_dir: str, hf_out: str, hf_dir: str, layout: Layout) -> dict:
    from gspo_megatron.model.convert import megatron_to_hf

    megatron_to_hf(megatron_dir, hf_out, hf_dir, layout, max_shard_bytes=20_000)  # several shards + an index
    return {"done": True}


def convert_cases(hf_models: dict, work: Path) -> list:
    sources = {**hf_models, hf_tiny.BF16: hf_tiny.bf16_model(hf_models)}
    cases = []
    for name, (there, back) in CONVERT_LAYOUTS.items():
        megatron_dir = str(work / "megatron" / name)
        cases.append((("to_megatron", name), to_megatron_case, (str(sources[name]), megatron_dir, there), there))
        cases.append((("to_hf", name), to_hf_case, (megatron_dir, str(work / "hf_back" / name), str(sources[name]),
                                                    back), back))
    fused_layout = Layout(tensor=2, sequence_parallel=True)  # the checkpoint was written under PP2
    cases.append((("to_hf", "deepseek_v3_fused"), fused_checkpoint_case,
                  (str(work / "megatron" / "deepseek_v3"), str(sources["deepseek_v3"]),
                   str(work / "megatron" / "deepseek_v3_fused"), fused_layout), fused_layout))
    return cases


def fused_checkpoint_case(megatron_dir: str, hf_dir: str, out: str, layout: Layout) -> dict:
    """megatron's fused MLA down projection reads and writes the separate layout's dist checkpoints: the converted
    (separate) checkpoint loads into a fused model, whose checkpoint loads into a separate one; after each, the
    export is the HF files bit for bit. On a megatron-core without the fusion: nothing to check."""
    from gspo_megatron.model.bridge import Bridge
    from gspo_megatron.model.checkpoint import load_weights, save_weights
    from gspo_megatron.model.hf_config import read_hf_config
    from gspo_megatron.model.hf_files import SafetensorsDir
    from gspo_megatron.model.mla import megatron_has_down_proj_fusion
    from gspo_megatron.model.process_groups import ensure_model_parallel
    from gspo_megatron.model.provider import build_gpt_model

    if not megatron_has_down_proj_fusion():
        return {"refused": True}
    ensure_model_parallel(layout)
    spec, files = read_hf_config(hf_dir), SafetensorsDir(hf_dir)
    bridge = Bridge(spec)
    result = {}
    for name, fused, source in (("into_fused", True, megatron_dir), ("from_fused", False, out)):
        model = build_gpt_model(spec, layout, mla_down_proj_fusion=fused)
        load_weights(model, source)
        exported = list(bridge.export_hf_weights(model))
        result[name] = {"names": sorted(n for n, _ in exported),
                        "not_bitwise": [n for n, t in exported if not hf_tiny.same_bits(t, files.read(n))]}
        if fused:
            Path(out).mkdir(parents=True, exist_ok=True)
            save_weights(model, out)
    return result


# ---- scoring ------------------------------------------------------------------------------------------------

SCORE_LAYOUTS = {  # (on the Megatron checkpoint, on the HF directory)
    "qwen3_moe": (Layout(tensor=2, sequence_parallel=True), EP2),
    "qwen3": (PP2, TP2),
    "llama": (TP2, DP2),
    "glm4_moe": (PP2, Layout(tensor=2, expert=2, expert_tensor=1, sequence_parallel=True)),
    "deepseek_v3": (Layout(tensor=2, sequence_parallel=True), EP2),
    "gpt_oss": (EP2, Layout(tensor=2, expert_tensor=1, sequence_parallel=True)),  # expert biases: ETP 1
    "minimax_m2": (Layout(tensor=2, expert=2, expert_tensor=1, sequence_parallel=True), TP2_SP),
}


def assert_bridge_layout(results, key: tuple, atol: float, attention_class: str, names: set[str]) -> None:
    """A ``bridge_case`` result under one layout: logits within ``atol`` of transformers', every rank's export and
    weight-sync export bit for bit with export_names() agreeing, ``attention_class`` built, and the ranks' exports
    together exactly ``names`` (split between the stages under PP2, whole on every rank otherwise)."""
    kind = key[-1]
    per_rank = result(results, key)
    diffs = [r["logits_diff"] for r in per_rank if "logits_diff" in r]
    assert diffs and max(diffs) <= atol, f"{kind}: logits differ by {max(diffs):.2e} > {atol}"
    for rank, r in enumerate(per_rank):
        assert not r["not_bitwise"] and not r["to_sender_not_bitwise"], (kind, rank, r["not_bitwise"])
        assert r["export_names_match"] and r["attention_class"] == attention_class, (kind, rank)
        assert r["to_sender"] == (r["exported"] if r["sender"] else []), (kind, rank)
    exported = [set(r["exported"]) for r in per_rank]
    if kind == "pp2":
        assert exported[0].isdisjoint(exported[1]) and exported[0] | exported[1] == names, kind
    else:
        assert all(e == names for e in exported), kind


def quantized_round_trip_case(quantized: str, megatron_dir: str, back: str) -> list:
    """A quantized checkpoint (block FP8, MXFP4) converted to Megatron and back at world 1, then scored on this rank
    from the quantized directory itself (the tests compare ``back`` and the scores with its dequantized twin)."""
    from gspo_megatron.model.convert import hf_to_megatron, megatron_to_hf
    from gspo_megatron.model.hf_config import read_hf_config
    from gspo_megatron.score import score_on_this_rank

    hf_to_megatron(quantized, megatron_dir, Layout())
    megatron_to_hf(megatron_dir, back, None, Layout())
    return score_on_this_rank(quantized, score_records_for_tests(read_hf_config(quantized).vocab_size), Layout(), 2,
                              None)


def assert_export_is_dequantized_twin(back: Path, twin: Path) -> None:
    """The quantized checkpoint's round trip ``back`` is its dequantized ``twin`` bit for bit, with no
    quantization_config left (exports are in the dequantized dtype)."""
    from gspo_megatron.model.hf_files import SafetensorsDir

    exported, plain = SafetensorsDir(back), SafetensorsDir(twin)
    assert exported.shapes() == plain.shapes()
    for name in plain.shapes():
        assert hf_tiny.same_bits(exported.read(name), plain.read(name)), name
    assert "quantization_config" not in json.loads((Path(back) / "config.json").read_text())


def score_records_for_tests(vocab_size: int):
    """Prompts of 1-6 tokens, responses of 0-9 tokens (one empty), 7 records: micro batches of 2 with a pad row."""
    from gspo_megatron.score import Record

    g = torch.Generator().manual_seed(3)
    lengths = [(1, 4), (3, 9), (6, 1), (2, 0), (4, 7), (5, 5), (2, 3)]
    return [Record(tuple(torch.randint(0, vocab_size, (p,), generator=g).tolist()),
                   tuple(torch.randint(0, vocab_size, (r,), generator=g).tolist())) for p, r in lengths]


def score_case(model_dir: str, layout: Layout, vocab_size: int) -> dict:
    """What ``gspo-megatron score`` runs on each rank (under torchrun, or on the ranks it starts)."""
    from gspo_megatron.model.checkpoint import is_megatron_checkpoint
    from gspo_megatron.score import score_on_this_rank

    results = score_on_this_rank(model_dir, score_records_for_tests(vocab_size), layout, 2, None)
    return {"results": results, "megatron_checkpoint": is_megatron_checkpoint(model_dir)}


def score_cases(hf_models: dict, work: Path) -> list:
    from gspo_megatron.model.hf_config import read_hf_config

    cases = []
    for name, (on_checkpoint, on_hf) in SCORE_LAYOUTS.items():
        vocab = read_hf_config(hf_models[name]).vocab_size
        cases.append((("score", name, "megatron"), score_case, (str(work / "megatron" / name), on_checkpoint, vocab),
                      on_checkpoint))
        cases.append((("score", name, "hf"), score_case, (str(hf_models[name]), on_hf, vocab), on_hf))
    return cases


# ---- mismatched checkpoints --------------------------------------------------------------------------------


def _tampered_copy(source: Path, target: Path, **config_changes) -> None:
    """A copy of a converted checkpoint whose recorded config (spec and hf/config.json) says something else."""
    from gspo_megatron.model.checkpoint import HF_DIR, METADATA_FILE
    from gspo_megatron.model.hf_config import read_hf_config

    shutil.copytree(source, target)
    config_file = target / HF_DIR / "config.json"
    config = {**json.loads(config_file.read_text()), **config_changes}
    config_file.write_text(json.dumps(config))
    info = json.loads((target / METADATA_FILE).read_text())
    info["spec"] = read_hf_config(config).to_dict()
    (target / METADATA_FILE).write_text(json.dumps(info))


def bad_checkpoint_case(source: str, target: str, out: str, config_changes: dict) -> dict:
    import torch.distributed as dist

    from gspo_megatron.model.convert import megatron_to_hf

    if dist.get_rank() == 0:
        _tampered_copy(Path(source), Path(target), **config_changes)
    dist.barrier()
    try:
        megatron_to_hf(target, out, None, Layout())
    except Exception as e:  # the test asserts on the type and message
        dist.barrier()  # rank 0 removes the temporary directory on its way out
        leftovers = sorted(p.name for p in Path(out).parent.iterdir() if p.name.startswith(f".{Path(out).name}"))
        return {"error": type(e).__name__, "message": str(e), "out_exists": Path(out).exists(), "leftovers": leftovers}
    return {"error": None}


def extra_tensors_case(hf_dir: str, target: str, out: str, extra_key: str) -> dict:
    """A checkpoint holding the model plus one more tensor (as a training checkpoint holds optimizer state),
    converted back to HF: fine for ``optimizer.*`` keys, an unexpected tensor otherwise."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from gspo_megatron.model import checkpoint, hf_files
    from gspo_megatron.model.bridge import Bridge
    from gspo_megatron.model.convert import megatron_to_hf
    from gspo_megatron.model.hf_config import read_hf_config
    from gspo_megatron.model.process_groups import ensure_model_parallel
    from gspo_megatron.model.provider import build_gpt_model

    ensure_model_parallel(Layout())
    spec = read_hf_config(hf_dir)
    bridge = Bridge(spec)
    model = build_gpt_model(spec)
    bridge.load_hf_weights(model, hf_dir)
    state = {"model": checkpoint.tensors_state_dict(model),
             "extra": ShardedTensor.from_rank_offsets(extra_key, torch.ones(3), replica_id=dist.get_rank())}
    if dist.get_rank() == 0:
        Path(target).mkdir()
    dist.barrier()
    dist_checkpointing.save(state, target)
    if dist.get_rank() == 0:
        checkpoint.write_info(target, checkpoint.CheckpointInfo(spec=spec, padded_vocab_size=bridge.padded_vocab_size,
                                                                dtype="float32"))
        hf_files.copy_hf_metadata(hf_dir, Path(target) / checkpoint.HF_DIR)
    dist.barrier()
    try:
        megatron_to_hf(target, out)
    except Exception as e:
        dist.barrier()
        return {"error": type(e).__name__, "message": str(e), "out_exists": Path(out).exists()}
    return {"error": None}


def extra_tensors_cases(hf_models: dict, work: Path) -> list:
    return [(("extra_tensors", kind), extra_tensors_case,
             (str(hf_models["llama"]), str(work / "tampered" / f"extra_{kind}"),
              str(work / "hf_back" / f"extra_{kind}"), key), Layout())
            for kind, key in (("optimizer", "optimizer.state.exp_avg.embedding.word_embeddings.weight"),
                              ("model_like", "decoder.layers.7.self_attention.linear_qkv.weight"))]


BAD_CHECKPOINTS = {
    # name: (converted variant, config changes)
    "shape_mismatch": ("qwen3", {"intermediate_size": 96}),
    "missing_tensors": ("qwen3", {"num_hidden_layers": 3}),
    "unexpected_tensors": ("qwen2", {"num_hidden_layers": 1}),
}


def bad_checkpoint_cases(work: Path) -> list:
    return [(("bad_checkpoint", name), bad_checkpoint_case,
             (str(work / "megatron" / variant), str(work / "tampered" / name), str(work / "bad_out" / name), changes),
             Layout()) for name, (variant, changes) in BAD_CHECKPOINTS.items()]


# ---- the launch ---------------------------------------------------------------------------------------------


PHASES = ("bridge", "to_megatron", "to_hf", "score", "bad_checkpoint", "extra_tensors", "packed")  # later use earlier outputs


def _groups_key(layout: Layout) -> tuple:
    return (layout.tensor, layout.pipeline, layout.expert, layout.context, layout.expert_tensor or layout.tensor)


def in_run_order(cases: list) -> list:
    """Phase by phase; within a phase, cases of one group shape together (each change rebuilds the groups)."""
    shapes = []
    for *_, layout in cases:
        if _groups_key(layout) not in shapes:
            shapes.append(_groups_key(layout))
    return sorted(cases, key=lambda c: (PHASES.index(c[0][0]), shapes.index(_groups_key(c[-1]))))


def run_cases(cases) -> dict:
    """On every rank: run the cases in order. A failing case stops the launch (its peers would otherwise
    wait in a collective it never reaches), naming the case; ``run_on_ranks`` reports the traceback."""
    results = {}
    for key, fn, args, _ in cases:
        try:
            results[key] = fn(*args)
        except Exception as e:
            raise RuntimeError(f"case {key} failed") from e
    return results


def shared_results(hf_models: dict, work: Path) -> list[dict]:
    """Per-rank {case key: result} for all cases, computed once per session (cached under ``work``)."""
    from gspo_megatron.parallel.launch import run_on_ranks

    cache = work / "rank_results.pt"
    if not cache.exists():
        work.mkdir(parents=True, exist_ok=True)
        for sub in ("megatron", "hf_back", "tampered", "bad_out"):
            (work / sub).mkdir(exist_ok=True)
        cases = in_run_order(bridge_cases(hf_models) + convert_cases(hf_models, work) + score_cases(hf_models, work)
                             + bad_checkpoint_cases(work) + extra_tensors_cases(hf_models, work))
        try:
            results = run_on_ranks(run_cases, 2, None, cases, timeout=480)
        except Exception:
            results = {"launch_failed": traceback.format_exc()}  # the other folder's fixture fails fast too
        torch.save(results, cache)
    results = torch.load(cache, weights_only=False)
    if isinstance(results, dict):
        raise RuntimeError(f"the shared 2-rank launch failed:\n{results['launch_failed']}")
    return results


def result(results: list[dict], key) -> list[dict]:
    """One case's per-rank results."""
    return [r[key] for r in results]

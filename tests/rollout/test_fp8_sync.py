"""FP8 rollouts' weight sync (``weight_sync.fp8``) into SGLang's own FP8 layer classes, in-process on CPU.

What each sync path sends, produced by our code, fed to SGLang 0.5.23's real ``load_weights`` of a model built from
the FP8 model directory our launched servers start from (``server.serving_model_dir``: SGLang reads its
``quantization_config`` and builds ``Fp8LinearMethod`` / ``Fp8MoEMethod`` layers holding float8_e4m3fn weights and
fp32 ``weight_scale_inv``), in a process of its own (``tests/rollout/sglang_load.py``; a launched server serving
them, its GEMMs on patches/sglang_cpu's stand-in: tests/rollout/test_sglang_fp8_serving.py):

- ``start``: the FP8 directory's files, as a launched server's start-up load reads them;
- ``distributed``: ``DistributedSender``'s packed buckets (FP8 buckets are always flattened: gloo has no float8
  type), each received as SGLang's ``_receive_bucketed_weights_from_distributed`` does (``FlattenedTensorBucket
  .empty`` filled with the bytes the broadcast carries), one ``load_weights`` per bucket;
- ``tensor`` (colocated): ``colocate.pack``'s flattened buckets, unpacked by SGLang's ``FlattenedTensorBucket``;
- ``disk``: ``save_checkpoint``'s directory, read by SGLang's safetensors iterator.

Buckets are 4 KiB, so the scale / weight pairs and DeepSeek's fused q_a / kv_a projections are cut as often as they
can be. Every SGLang parameter must be written (NaN-filled first) and equal the reference quantization
(``fp8.quantize_reference`` of the trainer's fp32 tensor, joined as SGLang's loader joins: qkv_proj, gate_up_proj,
the experts' w13 / w2 stacks, MLA's fused down projection, their scales alike), bit for bit; the rest (embeddings,
lm_head, norms, routers) is the bf16 cast (``weight_sync.dtype``), the router's correction bias fp32. Blocks: 16 x 24
for Qwen3 (partial edge blocks across the 32 columns of the hidden size), 8 x 8 for DeepSeek-V3 (its fused rows, 24 + 24,
are whole blocks: SGLang joins the scales of fused layers block row by block row).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.model import hf_tiny

from .helpers import require_sglang
from .test_deepseek_sglang_names import VOCAB_PARAMS, expected_params

REPO = Path(__file__).resolve().parents[2]
MODELS = {"qwen3": ((16, 24), 5), "deepseek_v3": ((8, 8), 6)}  # variant: (block, seed)
PATHS = ("start", "distributed", "tensor", "disk")


def _export_order(names: list[str]) -> list[str]:
    """The bridge's export order where it matters: each q_a_proj directly followed by its kv_a_proj_with_mqa (as
    ``Bridge.export_to_sender`` yields them; tests/rollout/test_deepseek_sglang_names.py checks it)."""
    out = []
    for name in names:
        if name.endswith("kv_a_proj_with_mqa.weight"):
            continue
        out.append(name)
        if name.endswith("q_a_proj.weight"):
            out.append(name.replace("q_a_proj", "kv_a_proj_with_mqa"))
    return out


def _sender_packing(config):
    """``DistributedSender``'s packing (``_pack``) without its process group."""
    from gspo_megatron.rollout.weight_sync import DistributedSender

    sender = DistributedSender.__new__(DistributedSender)
    sender.backend, sender.device = "gloo", torch.device("cpu")
    sender._configure(config)
    return sender


def _calls(stream: list, config, model_dir: Path, work: Path) -> dict:
    from gspo_megatron.rollout.colocate import pack
    from gspo_megatron.rollout.weight_sync import buckets, save_checkpoint, sent_tensors

    dtype = getattr(torch, config.dtype)
    sender = _sender_packing(config)
    assert sender.flatten, "FP8 buckets must be packed on gloo"
    distributed, tensor = [], []
    for i, bucket in enumerate(buckets(sent_tensors(stream, config), config.bucket_bytes, dtype)):
        packed = sender._pack(bucket, i % 2)
        assert packed.flattened
        distributed.append(("distributed", packed.names, packed.dtypes, packed.shapes, packed.payload[0].clone()))
        flat, _ = pack(bucket, None, dtype)
        tensor.append({"flattened_tensor": flat["flattened_tensor"].clone(), "metadata": flat["metadata"]})
    disk = work / "disk"
    save_checkpoint(stream, disk, model_dir, config.bucket_bytes, dtype, config.fp8)
    return {"start": ["files"], "distributed": distributed, "tensor": tensor, "disk": [("files", str(disk))]}


def _qwen3_params(named: dict) -> dict:
    """SGLang's Qwen3 parameters from HF tensors: qkv_proj = [q; k; v], gate_up_proj = [gate; up]."""
    out, used = {}, set()
    for name in named:
        for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
            if f".{parts[0]}." in name:
                names = [name.replace(parts[0], p) for p in parts]
                out[name.replace(parts[0], fused)] = torch.cat([named[n] for n in names])
                used.update(names)
    out.update({n: t for n, t in named.items() if n not in used})
    return out


def expected(variant: str, stream: list, scheme, config_json: dict) -> dict:
    """Every SGLang parameter as the reference quantization of the trainer's tensors, joined as SGLang joins them.
    Scales join like their weights: the joins run on a copy where each ``X.weight_scale_inv`` stands as
    ``X.weight``, then take their names back."""
    from gspo_megatron.model.fp8 import quantize_reference
    from gspo_megatron.model.mapping import export_dtype

    weights, scales = {}, {}
    for name, tensor in stream:
        if scheme.quantizes(name, tuple(tensor.shape)):
            weights[name], scales[name] = quantize_reference(tensor, scheme.block)
        else:
            weights[name] = tensor.to(export_dtype(name, tensor, torch.bfloat16))
    if variant == "qwen3":
        joined, joined_scales = _qwen3_params(weights), _qwen3_params(scales)
    else:
        joined, _ = expected_params(weights, config_json)
        joined_scales, _ = expected_params({n: s for n, s in scales.items()}, config_json)
    out = dict(joined)
    for name, scale in joined_scales.items():
        out[name.removesuffix(".weight") + ".weight_scale_inv" if name.endswith(".weight")
            else name + "_scale_inv"] = scale
    return out


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    require_sglang()
    from gspo_megatron.model.fp8 import Fp8Scheme
    from gspo_megatron.model.hf_files import SafetensorsDir
    from gspo_megatron.rollout.config import SGLangConfig, WeightSyncConfig
    from gspo_megatron.rollout.server import node_env, serving_model_dir

    out, args = {}, []
    for variant, (block, seed) in MODELS.items():
        work = tmp_path_factory.mktemp(f"fp8_{variant}")
        source = hf_tiny.save_variant(variant, work, seed=seed)  # fp32: the trainer's weights
        config_json = json.loads((source / "config.json").read_text())
        scheme = Fp8Scheme(config_json["num_hidden_layers"], block=block)
        files = SafetensorsDir(source)
        layers = config_json["num_hidden_layers"]
        names = [n for n in _export_order(list(files.shapes())) if not n.startswith(f"model.layers.{layers}.")]
        stream = [(n, files.read(n)) for n in names]  # the policy has no MTP layer: the sync never sends one
        config = WeightSyncConfig(bucket_bytes=4096, dtype="bfloat16", fp8=scheme)
        # what a server launched with this config starts from: the model's block-FP8 copy
        model_dir = Path(serving_model_dir(SGLangConfig(model_path=str(source), weight_sync=config), work))
        assert model_dir == work / "fp8_model"
        loads = _calls(stream, config, model_dir, work)
        torch.save(loads, work / "loads.pt")
        args += [str(model_dir), str(work / "loads.pt"), str(work / "sglang.pt")]
        out[variant] = dict(work=work, scheme=scheme, stream=stream, config=config_json, loads=loads,
                            expected=expected(variant, stream, scheme, config_json))
    run = subprocess.run([sys.executable, "-m", "tests.rollout.sglang_load", *args], cwd=REPO, env=node_env("cpu"),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for variant in MODELS:
        out[variant]["sglang"] = torch.load(out[variant]["work"] / "sglang.pt", weights_only=False)
    return out


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


@pytest.mark.parametrize("variant", list(MODELS))
@pytest.mark.parametrize("path", PATHS)
def test_sglang_fp8_layers_hold_the_reference_quantization(loaded, variant, path):
    case = loaded[variant]
    result, want = case["sglang"]["loads"][path], case["expected"]
    # The attention's k_scale / v_scale: an FP8 KV cache's scales, which Fp8Config gives every RadixAttention
    # (MLA's two); no checkpoint or sync holds them, and without --kv-cache-dtype fp8 they are unused.
    params = {n: p for n, p in result["params"].items() if not n.endswith((".k_scale", ".v_scale"))}
    assert len(params) < len(result["params"]) or variant == "qwen3"
    fp8_params = sorted(n for n, p in params.items() if p.dtype == torch.float8_e4m3fn)
    assert len(fp8_params) >= 6, "SGLang built no FP8 layers: nothing under test"
    assert all(n + "_scale_inv" in params for n in fp8_params)
    assert set(params) == set(want), (sorted(set(params) - set(want)), sorted(set(want) - set(params)))
    unwritten = [n for n, p in params.items() if p.float().isnan().any()]
    assert not unwritten, f"SGLang parameters left (partly) unwritten by the {path} load: {unwritten}"
    params = {n: p[: case["config"]["vocab_size"]] if n in VOCAB_PARAMS else p for n, p in params.items()}
    wrong = [n for n, p in params.items()
             if p.dtype != want[n].dtype or p.shape != want[n].shape or not torch.equal(_bits(p), _bits(want[n]))]
    assert not wrong, [(n, params[n].dtype, want[n].dtype, tuple(params[n].shape), tuple(want[n].shape))
                       for n in wrong[:6]]
    assert not result["warnings"], result["warnings"]


def test_every_path_sends_scale_then_weight_in_one_bucket(loaded):
    """The float8_e4m3fn weights travel with their fp32 weight_scale_inv just before them, in one bucket; buckets of
    4 KiB hold several tensors each, so cuts happen everywhere they may."""
    for variant, case in loaded.items():
        for bucket in case["loads"]["distributed"]:
            _, names, dtypes, _, _ = bucket
            for i, (name, dtype) in enumerate(zip(names, dtypes)):
                if dtype == "float8_e4m3fn":
                    assert i > 0 and names[i - 1] == name + "_scale_inv" and dtypes[i - 1] == "float32", names
        fp8 = sum(d == "float8_e4m3fn" for b in case["loads"]["distributed"] for d in b[2])
        assert fp8 == sum(case["scheme"].quantizes(n, t.shape) for n, t in case["stream"])
        assert len(case["loads"]["distributed"]) > 5


def test_quantization_is_lazy_bucket_by_bucket():
    """The stream is quantized as buckets form: the first bucket pulls only its own tensors (and one more that
    starts the next), whatever the model's size."""
    from gspo_megatron.model.fp8 import Fp8Scheme
    from gspo_megatron.rollout.config import WeightSyncConfig
    from gspo_megatron.rollout.weight_sync import buckets, sent_tensors

    pulled = []

    def source():
        for i in range(1000):
            pulled.append(i)
            yield f"model.layers.{i}.mlp.down_proj.weight", torch.randn(64, 64)

    config = WeightSyncConfig(bucket_bytes=3 * (64 * 64 + 4 * 4), fp8=Fp8Scheme(1000, block=(32, 32)))
    first = next(iter(buckets(sent_tensors(source(), config), config.bucket_bytes)))
    assert [n for n, _ in first][:2] == ["model.layers.0.mlp.down_proj.weight_scale_inv",
                                         "model.layers.0.mlp.down_proj.weight"]
    assert first[1][1].dtype == torch.float8_e4m3fn and len(first) == 6 and len(pulled) == 4


# ---- the model directory train's launched servers start from (bootstrap.engine_model_dir) -------------------------


def _engine_dirs(example: str, plain: str, fp8_checkpoint: str, run_dir: str) -> dict:
    """On a rank (engine_model_dir is collective): the engine's model dir for FP8 rollouts of a plain model, asked
    twice; then, in the same logging.dir, for FP8 rollouts (1 layer kept) of an FP8 checkpoint; then for that
    checkpoint without FP8 rollouts. Each result copied aside; with what the SGLang config gets."""
    import os
    import shutil

    from gspo_megatron.model import fp8
    from gspo_megatron.rollout.server import serving_model_dir
    from gspo_megatron.train.sampling.engine import sglang_config
    from gspo_megatron.train.startup.bootstrap import engine_model_dir
    from gspo_megatron.train.startup.config import load_config

    def cfg(hf_dir, *overrides):
        return load_config(example, [f"model.hf_dir={hf_dir}", f"logging.dir={run_dir}", "data.reward_workers=0",
                                     *overrides])

    # The tiny Qwen3's q, k, v and MLP parts are 16-64 rows, which SGLang's FP8 layers would refuse (pre-flight says
    # so); the copies' files are under test here, servability in test_sglang_fp8_serving.
    fp8.Fp8Scheme.unservable_size = lambda *args: None
    out = {}
    fp8_plain = cfg(plain, "rollout.fp8=true")
    served = engine_model_dir(fp8_plain, Path(plain))
    stamp = os.stat(next(served.glob("*.safetensors"))).st_mtime_ns
    assert engine_model_dir(fp8_plain, Path(plain)) == served  # a restarted run: kept, not rewritten
    out["kept"] = os.stat(next(served.glob("*.safetensors"))).st_mtime_ns == stamp
    config = sglang_config(fp8_plain, served)
    out["scheme"] = config.weight_sync.fp8
    out["serving"] = serving_model_dir(config, Path(run_dir) / "sglang")  # what start_servers launches from
    out["second_copy"] = (Path(run_dir) / "sglang").exists()
    shutil.copytree(served, Path(run_dir) / "fp8_of_plain")
    for name, overrides in (("fp8_of_fp8", ("rollout.fp8=true", "rollout.fp8_keep_layers=1")),
                            ("dequantized", ())):
        assert engine_model_dir(cfg(fp8_checkpoint, *overrides), Path(fp8_checkpoint)) == served
        shutil.copytree(served, Path(run_dir) / name)
    return out


def test_train_serves_fp8_rollouts_from_a_block_fp8_copy(tmp_path):
    """``train`` with ``rollout.fp8`` and launched servers: ``logging.dir/engine_model`` is the model block-FP8
    (float8_e4m3fn weights equal to ``quantize_reference`` of the source's, 128 x 128 blocks, fp32 scales; config.json
    with the scheme's quantization_config), kept on a restart, and what ``start_servers`` launches from (no second
    copy); a later run on an FP8 checkpoint with one layer kept each end replaces it (the checkpoint dequantized
    then quantized by the scheme: what the trainer syncs), and without rollout.fp8 the copy is the dequantized one
    (issue 35)."""
    from gspo_megatron.model.fp8 import Fp8Scheme, quantize_reference
    from gspo_megatron.model.hf_files import SafetensorsDir, open_hf_dir, quantized_copy
    from gspo_megatron.parallel.launch import run_on_ranks

    plain = hf_tiny.save_variant("qwen3", tmp_path / "plain", seed=3)
    layers = json.loads((plain / "config.json").read_text())["num_hidden_layers"]
    fp8_checkpoint = quantized_copy(plain, tmp_path / "fp8_checkpoint", Fp8Scheme(layers, block=(8, 8)))
    run = tmp_path / "run"
    (result,) = run_on_ranks(_engine_dirs, 1, None, str(REPO / "examples/tiny_moe_cpu.yaml"), str(plain),
                             str(fp8_checkpoint), str(run), timeout=300)
    scheme = Fp8Scheme(layers)
    assert result["scheme"] == scheme and result["kept"] and not result["second_copy"]
    assert result["serving"] == str(run / "engine_model")

    def check(copy: Path, source: Path, scheme) -> int:
        """Every tensor of ``copy`` against ``source`` as the trainer reads it; returns how many are FP8."""
        written, read = SafetensorsDir(copy), open_hf_dir(source)
        config = json.loads((copy / "config.json").read_text())
        assert config.get("quantization_config") == (scheme.quantization_config() if scheme else None)
        quantized = {n for n, shape in read.shapes().items() if scheme and scheme.quantizes(n, shape)}
        assert set(written.shapes()) == set(read.shapes()) | {n + "_scale_inv" for n in quantized}
        for name in read.shapes():
            if name in quantized:
                weight, scale = quantize_reference(read.read(name), scheme.block)
                assert written.read(name).dtype == torch.float8_e4m3fn, name
                assert torch.equal(_bits(written.read(name)), _bits(weight)), name
                assert torch.equal(written.read(name + "_scale_inv"), scale), name
            else:
                assert hf_tiny.same_bits(written.read(name), read.read(name)), name
        return len(quantized)

    assert check(run / "fp8_of_plain", plain, scheme) == 7 * layers  # q, k, v, o, gate, up, down per layer
    kept = Fp8Scheme(layers, keep_layers=1)  # the tiny model's two layers both kept: nothing quantized
    assert kept.kept_layers == [0, 1] and check(run / "fp8_of_fp8", fp8_checkpoint, kept) == 0
    assert check(run / "dequantized", fp8_checkpoint, None) == 0
    # An FP8 checkpoint's own blocks (8 x 8) dequantized, then quantized in the scheme's (128 x 128)
    assert check(quantized_copy(fp8_checkpoint, tmp_path / "requantized", scheme), fp8_checkpoint, scheme) == 7 * layers

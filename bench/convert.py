"""Checkpoint conversion throughput (GB/s of weights), HF -> Megatron and back, against plain safetensors.

    .venv/bin/python bench/convert.py [--gb 1.0] [--work /tmp/gspo_bench_convert]

Builds a random Qwen3-MoE-shaped bf16 checkpoint of about ``--gb`` GB (written with safetensors, no
transformers model), then times in one process (world of one, after start-up, so imports do not count):

- ceiling:         safetensors ``load_file`` of every file + ``save_file`` of the same tensors
- hf -> megatron:  ``convert.hf_to_megatron`` (read, fill the Megatron model, torch_dist save, metadata)
- megatron -> hf:  ``convert.megatron_to_hf`` (build, torch_dist load, bridge export, safetensors save)
- for reference:   megatron-core's torch_dist save of the same model alone (it fsyncs every file)

and checks that the round trip is bit for bit. Files are read right after being written, so every read
comes from the page cache; dirty pages are flushed (``os.sync``) before each timing. The numbers compare code
paths on one machine, not disks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch


def random_config(target_gb: float) -> dict:
    """A Qwen3-MoE config whose bf16 weights are about ``target_gb`` GB (layers scale the size)."""
    per_layer = (32 * 3 * 1024 * 512 + 2 * 1024 * 1024 + 2 * 256 * 1024 + 32 * 1024) * 2
    fixed = 2 * 32768 * 1024 * 2
    layers = max(1, round((target_gb * 1e9 - fixed) / per_layer))
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 32768, "hidden_size": 1024,
        "intermediate_size": 2048, "moe_intermediate_size": 512, "num_hidden_layers": layers,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "num_experts": 32,
        "num_experts_per_tok": 4, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "dtype": "bfloat16",
    }


def write_random_checkpoint(directory: Path, config: dict) -> int:
    from gspo_megatron.model.hf_config import read_hf_config
    from gspo_megatron.model.hf_files import write_safetensors
    from gspo_megatron.model.mapping import hf_tensor_shapes

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(0)
    shapes = hf_tensor_shapes(read_hf_config(config))
    tensors = ((name, torch.randn(shape, generator=g).to(torch.bfloat16)) for name, shape in shapes.items())
    write_safetensors(tensors, directory, max_shard_bytes=2 * 10**9)
    return sum(torch.Size(s).numel() * 2 for s in shapes.values())


def plain_safetensors_copy(source: Path, target: Path) -> None:
    from safetensors.torch import load_file, save_file

    target.mkdir()
    for file in sorted(source.glob("*.safetensors")):
        save_file(load_file(file), target / file.name, metadata={"format": "pt"})


def timed(fn, *args) -> float:
    os.sync()  # start each timing with no dirty pages from the previous one (write-back throttling)
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def torch_dist_save_alone(megatron_dir: Path, target: Path) -> float:
    """megatron-core's torch_dist save of the same weights, timed alone (the format's own cost)."""
    from gspo_megatron.model import checkpoint
    from gspo_megatron.model.provider import build_gpt_model

    info = checkpoint.read_info(megatron_dir)
    model = build_gpt_model(info.spec, dtype=checkpoint.torch_dtype(info.dtype),
                            padded_vocab_size=info.padded_vocab_size)
    checkpoint.load_weights(model, megatron_dir)
    target.mkdir()
    return timed(checkpoint.save_weights, model, target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--work", default="/tmp/gspo_bench_convert")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    from gspo_megatron.model.convert import hf_to_megatron, megatron_to_hf
    from gspo_megatron.model.hf_files import SafetensorsDir
    from gspo_megatron.parallel import groups
    from gspo_megatron.parallel.groups import Layout

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    config = random_config(args.gb)
    nbytes = write_random_checkpoint(work / "hf", config)
    groups.init_distributed()
    groups.init_model_parallel(Layout())  # start-up (imports, groups) is not part of the timings

    runs = {"ceiling: safetensors load + save": [], "hf_to_megatron": [], "megatron_to_hf": [],
            "(megatron-core torch_dist save alone)": []}
    for i in range(args.repeats):
        runs["ceiling: safetensors load + save"].append(timed(plain_safetensors_copy, work / "hf", work / f"copy{i}"))
        runs["hf_to_megatron"].append(timed(hf_to_megatron, work / "hf", work / f"megatron{i}"))
        runs["megatron_to_hf"].append(timed(megatron_to_hf, work / f"megatron{i}", work / f"back{i}"))
        runs["(megatron-core torch_dist save alone)"].append(
            torch_dist_save_alone(work / f"megatron{i}", work / f"dist{i}"))
        for name in ("copy", "megatron", "back", "dist"):
            if i < args.repeats - 1:
                shutil.rmtree(work / f"{name}{i}")

    last = args.repeats - 1
    original, back = SafetensorsDir(work / "hf"), SafetensorsDir(work / f"back{last}")
    bitwise = set(original.shapes()) == set(back.shapes()) and all(
        torch.equal(original.read(n).view(torch.int16), back.read(n).view(torch.int16)) for n in original.shapes())
    print(f"model: qwen3_moe, {config['num_hidden_layers']} layers, 32 experts, bf16, {nbytes / 1e9:.3f} GB "
          f"in {len(original.shapes())} tensors; round trip bit for bit: {bitwise}")
    print("| path | best s | GB/s | vs ceiling |")
    print("| --- | --- | --- | --- |")
    ceiling = nbytes / min(runs["ceiling: safetensors load + save"])
    for name, seconds in runs.items():
        best = min(seconds)
        print(f"| {name} | {best:.2f} | {nbytes / best / 1e9:.2f} | {nbytes / best / ceiling:.2f} |")
    groups.destroy()
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":  # required: the torch_dist writer re-imports this script in a spawned process
    main()

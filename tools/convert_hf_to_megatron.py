#!/usr/bin/env python
"""Hugging Face safetensors -> Megatron torch_dist checkpoint (loadable under any layout by resharding).

    python tools/convert_hf_to_megatron.py --hf-dir Qwen3-30B-A3B --out qwen3-30b-megatron
    python tools/convert_hf_to_megatron.py --hf-dir Qwen/Qwen3-30B-A3B --out ...   # from huggingface_hub's cache
    torchrun --nproc-per-node 8 tools/convert_hf_to_megatron.py --hf-dir ... --out ... --tp 2 --ep 4

A small model converts in one CPU process; a large one under torchrun, each rank reading only its shards.
The output (torch_dist files, gspo_megatron.json, hf/ with config and tokenizer) is written to a temporary
directory and renamed at the end. See gspo_megatron/model/convert.py.
"""

from __future__ import annotations

import argparse
import sys

from gspo_megatron.environment import quiet_start
from gspo_megatron.model.atomic import exit_on_sigterm
from gspo_megatron.model.errors import exit_status
from gspo_megatron.parallel.groups import add_layout_arguments, layout_from_args

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", required=True, help="HF model directory (config.json + *.safetensors), or a "
                        "Hugging Face repo id (org/name: its snapshot in huggingface_hub's cache, downloaded there if "
                        "online)")
    parser.add_argument("--out", required=True, help="Megatron checkpoint directory to create (must not exist)")
    add_layout_arguments(parser, "convert under")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="parameter dtype (default: the HF tensors')")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    quiet_start()  # no third-party warnings or progress bars

    def convert():
        import torch

        from gspo_megatron.model import hub
        from gspo_megatron.model.convert import hf_to_megatron

        dtype = getattr(torch, args.dtype) if args.dtype else None
        hf_to_megatron(hub.resolve(args.hf_dir, "--hf-dir"), args.out, layout_from_args(args), dtype=dtype)

    return exit_status("convert_hf_to_megatron", convert)


if __name__ == "__main__":  # required: the torch_dist writer re-imports this script in a spawned process
    sys.exit(main())

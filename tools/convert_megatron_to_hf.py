#!/usr/bin/env python
"""Megatron torch_dist checkpoint -> Hugging Face safetensors, config and tokenizer files.

    python tools/convert_megatron_to_hf.py --megatron-dir qwen3-30b-megatron --out qwen3-30b-hf \
        --hf-config Qwen3-30B-A3B

--hf-config names the HF directory whose config.json and tokenizer files go with the weights (default: the
copy the checkpoint stores); it must describe the converted model. Weights are sharded with an index file
above --max-shard-size. Runs in one process (world of one) or under torchrun with --tp/--pp/--ep; one rank
per pipeline stage writes. The output is written to a temporary directory and renamed at the end.

--fp8 writes the decoder layers' linear weights as block-FP8 (float8_e4m3fn with one fp32 weight_scale_inv per
128 x 128 block, --fp8-block-size), with quantization_config in config.json, for serving in FP8 (SGLang, vLLM);
embeddings, lm_head, norms, routers and the first and last --fp8-keep-layers layers stay as they are.
"""

from __future__ import annotations

import argparse
import sys

from gspo_megatron.environment import quiet_start
from gspo_megatron.model.atomic import exit_on_sigterm
from gspo_megatron.model.errors import exit_status
from gspo_megatron.parallel.groups import add_layout_arguments, layout_from_args


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-dir", required=True, help="checkpoint written by convert_hf_to_megatron.py")
    parser.add_argument("--out", required=True, help="HF directory to create (must not exist)")
    parser.add_argument("--hf-config", help="HF directory with config.json and tokenizer files, or a Hugging Face "
                        "repo id (org/name: those files of its snapshot in huggingface_hub's cache) (default: the "
                        "checkpoint's stored copy)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (e.g. 5GB, 500MB)")
    parser.add_argument("--fp8", action="store_true",
                        help="write the decoder layers' linear weights block-FP8 (float8_e4m3fn + weight_scale_inv, "
                             "quantization_config in config.json): a checkpoint SGLang serves in FP8")
    parser.add_argument("--fp8-block-size", default="128,128", help="with --fp8: rows,cols of one scale block")
    parser.add_argument("--fp8-keep-layers", type=int, default=0,
                        help="with --fp8: the first and last N decoder layers stay in high precision")
    add_layout_arguments(parser, "load under")
    return parser.parse_args(argv)


def fp8_block(args: argparse.Namespace) -> tuple[int, int] | None:
    """--fp8-block-size as (rows, cols) with --fp8, else None; a bad value is a ValueError naming the option."""
    if not args.fp8:
        return None
    sizes = args.fp8_block_size.split(",")
    if len(sizes) != 2 or not all(s.strip().isdigit() and int(s) > 0 for s in sizes):
        raise ValueError(f"--fp8-block-size={args.fp8_block_size!r} must be two integers 'rows,cols', e.g. 128,128")
    if args.fp8_keep_layers < 0:
        raise ValueError(f"--fp8-keep-layers={args.fp8_keep_layers} must be >= 0")
    return int(sizes[0]), int(sizes[1])


def main(argv=None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    quiet_start()  # no third-party warnings or progress bars

    def convert():
        from gspo_megatron.model import hub
        from gspo_megatron.model.convert import megatron_to_hf
        from gspo_megatron.model.hf_files import parse_size

        block = fp8_block(args)  # before anything is built
        hf_config = hub.resolve(args.hf_config, "--hf-config", hub.CONFIG_FILES) if args.hf_config else None
        megatron_to_hf(args.megatron_dir, args.out, hf_config, layout_from_args(args),
                       max_shard_bytes=parse_size(args.max_shard_size), fp8_block=block,
                       fp8_keep_layers=args.fp8_keep_layers)

    return exit_status("convert_megatron_to_hf", convert)


if __name__ == "__main__":  # required: the torch_dist reader/writer may re-import this script
    sys.exit(main())

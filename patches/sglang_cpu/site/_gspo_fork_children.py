"""A CPU server's scheduler and detokenizer processes forked from the launcher, not spawned (sglang 0.5.23).

``engine._set_envs_and_config`` sets multiprocessing's start method to "spawn" (right for CUDA, which cannot be
initialised again in a forked child). A spawned child starts a fresh interpreter and imports sglang, torch and
transformers again: ~7 CPU-seconds for the detokenizer and ~9.5 for the scheduler on the 2-core test machine, two
thirds of a CPU server's start. On a CPU device there is no CUDA context to lose, and the launcher has imported
everything its children run (their target functions are imported by the engine module), so a forked child starts
at once. Its torch has run no parallel region before the fork (the launcher parses arguments and starts children;
it serves only afterwards), so there is no OpenMP pool to inherit. ``GSPO_SGLANG_START_METHOD=spawn`` in the
server's environment keeps SGLang's own choice (``bench/server_start.py`` compares the two).
"""

from __future__ import annotations

import multiprocessing
import os
import sys

ENV = "GSPO_SGLANG_START_METHOD"


def install(engine_module) -> None:
    set_envs_and_config = engine_module._set_envs_and_config

    def set_envs_and_config_forking(server_args):
        set_envs_and_config(server_args)
        if str(getattr(server_args, "device", "")) == "cpu" and os.environ.get(ENV, "fork") == "fork":
            multiprocessing.set_start_method("fork", force=True)
            print("gspo-megatron (patches/sglang_cpu): this CPU server's scheduler and detokenizer are forked, "
                  f"not spawned ({ENV}=spawn to spawn them)", file=sys.stderr, flush=True)

    engine_module._set_envs_and_config = set_envs_and_config_forking

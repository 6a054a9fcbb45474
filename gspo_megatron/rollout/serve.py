"""The rollout nodes' side of a cluster launch (``examples/launch_cluster.sh``): start one SGLang server, and wait
until servers are ready.

    python -m gspo_megatron.rollout.serve --model-path DIR --host 0.0.0.0 --port 30000 --tp-size 8 [sglang args]
    python -m gspo_megatron.rollout.serve --wait-for http://rollout-0:30000,http://rollout-1:30000 --timeout 900

Serving: every argument goes to ``python -m sglang.launch_server`` unchanged. What this adds is the environment the
trainer gives the servers it launches itself (``server.node_env``): no torchrun variables, and with ``--device
cpu`` the stand-ins of ``patches.sglang_cpu`` on PYTHONPATH. The process becomes the server (exec), so a
scheduler's signals reach SGLang directly.

Waiting: a job that starts every node at once (one batch job for trainers and servers) has its trainers wait here
until each server answers ``/health_generate`` (a real one-token generation), instead of failing to attach to a
server that is still loading its weights. A server that is not ready in ``--timeout`` seconds stops the launch
with its URL and last error.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def wait_for(urls: list[str], timeout_s: float, poll_s: float = 2.0) -> None:
    """Return once every URL answers ``/health_generate``; SystemExit naming the first that does not in time."""
    from .client import HttpClient, RetryPolicy
    from .errors import RolloutError

    deadline = time.monotonic() + timeout_s
    for url in urls:
        client = HttpClient(url, RetryPolicy(max_retries=0), timeout=30.0)
        reported = 0.0
        while True:
            try:
                client.get("/health_generate")
                print(f"serve: {url} is ready", flush=True)
                break
            except RolloutError as e:
                now = time.monotonic()
                if now > deadline:
                    raise SystemExit(f"serve: {url} not ready after {timeout_s:.0f} s (--timeout): {e}") from None
                if now - reported > 30:
                    print(f"serve: waiting for {url} ({e})", flush=True)
                    reported = now
                time.sleep(poll_s)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--wait-for"]:
        parser = argparse.ArgumentParser(prog="python -m gspo_megatron.rollout.serve")
        parser.add_argument("--wait-for", required=True, help="comma-separated server URLs")
        parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for all of them")
        args = parser.parse_args(argv)
        wait_for([u for u in args.wait_for.split(",") if u], args.timeout)
        return
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--device", default="cuda")  # sglang detects the device itself; only cpu matters here
    device = parser.parse_known_args(argv)[0].device
    from .server import node_env

    os.execve(sys.executable, [sys.executable, "-m", "sglang.launch_server", *argv], node_env(device))


if __name__ == "__main__":
    main()

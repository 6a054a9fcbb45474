"""Attaching through sglang-router: generation goes through the router, weight updates to each worker."""

from __future__ import annotations

from dataclasses import replace

from gspo_megatron.rollout import SamplingParams, SGLangEngine, flatten, hf_weights
from gspo_megatron.rollout.server import launch_router

from .helpers import prompts


def test_generate_through_router_and_sync_the_worker(started_servers, engine, trainer):
    config, _ = started_servers
    router = launch_router(config, engine.worker_urls)
    try:
        attached = SGLangEngine(replace(config, model_path="", urls=tuple(engine.worker_urls),
                                        router_url=router.url))
        assert attached.generate_urls == [router.url] and attached.worker_urls == engine.worker_urls
        groups = attached.generate(prompts(3), n=2, sampling=SamplingParams(max_new_tokens=4))
        assert [len(g.samples) for g in groups] == [2, 2, 2]
        stats = attached.update_weights(hf_weights.checkpoint_tensors(trainer.model), "via-router-1")
        assert stats.weight_version == "via-router-1" == engine.weight_version()
        samples = flatten(attached.generate(prompts(2), n=2, sampling=SamplingParams(max_new_tokens=4)))
        assert {s.weight_version for s in samples} == {"via-router-1"}
        attached.close()
    finally:
        router.shutdown()

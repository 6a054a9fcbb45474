"""In-process sampling from the current weights with a Hugging Face transformers model: the same interface as
``SGLangEngine``, for machines without SGLang (a lent GPU box, a laptop) and as a reference implementation.

The weights come from the trainer like a server's do: ``update_weights`` takes the ``(hf_name, tensor)`` pairs
of the bridge's export (or ``hf_weights.checkpoint_tensors``) and rebuilds the model from them. Log-probs follow
SGLang's convention: log softmax(logits / temperature) of the sampled token, before top-k / top-p / min-p.
With ``rollout_routing`` each sample carries (``Sample.rollout_routing``) the experts the model's routers chose for
every token but the last, as SGLang's ``--enable-return-routed-experts`` does ([P + R - 1, num_hidden_layers,
top-k]; a dense layer's rows are 0..k-1): forward hooks on transformers' ``*TopKRouter`` modules, which return
(logits, weights, experts).
"""

from __future__ import annotations

import re
import time
from contextlib import contextmanager
from typing import Sequence

import torch

from . import hf_weights
from .types import Group, NamedTensors, Sample, SamplingParams, SyncStats, check_prompts


def _filter(scaled: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Logits [n, V] with the tokens top-k / top-p / min-p exclude set to -inf (SGLang's order: k, p, min-p)."""
    if sampling.top_k > 0 and sampling.top_k < scaled.shape[-1]:
        kth = scaled.topk(sampling.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if sampling.top_p < 1.0:
        probs, order = scaled.softmax(-1).sort(dim=-1, descending=True)
        drop_sorted = probs.cumsum(-1) - probs > sampling.top_p  # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    if sampling.min_p > 0.0:
        probs = scaled.softmax(-1)
        scaled = scaled.masked_fill(probs < sampling.min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return scaled


class LocalEngine:
    """``generate`` / ``update_weights`` / ``weight_version`` on an in-process transformers causal LM."""

    def __init__(self, model: torch.nn.Module, tokenizer=None, eos_token_ids: Sequence[int] | None = None,
                 seed: int = 0, version: str = "default", rollout_routing: bool = False):
        self.model = model.eval()
        self.rollout_routing = rollout_routing
        self.tokenizer = tokenizer
        if eos_token_ids is None:
            eos = getattr(model.config, "eos_token_id", None)
            eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.eos_token_ids = tuple(eos_token_ids)
        self._generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
        self._version = version

    def weight_version(self) -> str:
        return self._version

    def close(self) -> None:
        pass

    def __enter__(self) -> "LocalEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update_weights(self, named_tensors: NamedTensors, version: str) -> SyncStats:
        start = time.perf_counter()
        tensors = list(named_tensors)
        self.model = hf_weights.load_checkpoint_tensors(self.model, tensors)
        self._version = str(version)
        num_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
        return SyncStats("local", self._version, time.perf_counter() - start, len(tensors), num_bytes, 1)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams) -> list[Group]:
        prompts = check_prompts(prompts, n)
        groups = []
        for i, prompt in enumerate(prompts):
            with self._routes() as routes:
                rows = self._sample(prompt, n, sampling)
            samples = []
            for s, (ids, logprobs, finish) in enumerate(rows):
                text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else None
                routed = None
                if routes is not None:  # [n, tokens fed, L, k]: this sample's rows for every token but its last
                    routed = torch.cat(routes, dim=1)[s, :len(prompt) + len(ids) - 1].to(torch.int16)
                samples.append(Sample(list(prompt), ids, logprobs, finish, self._version, i, s, text, routed))
            groups.append(Group(i, list(prompt), samples))
        return groups

    @contextmanager
    def _routes(self):
        """While open, each forward of the model appends its experts [n, t, L, k] (t tokens per row) to the yielded
        list (None without ``rollout_routing``)."""
        if not self.rollout_routing:
            yield None
            return
        config = getattr(self.model.config, "text_config", self.model.config)
        layers, topk = config.num_hidden_layers, config.num_experts_per_tok
        routers = [(int(re.search(r"layers\.(\d+)\.", name).group(1)), module)
                   for name, module in self.model.named_modules() if type(module).__name__.endswith("TopKRouter")]
        if not routers:
            raise ValueError(f"LocalEngine(rollout_routing=True): {type(self.model).__name__} has no "
                             "transformers *TopKRouter modules to capture the experts from")
        routes: list[torch.Tensor] = []
        step: dict[int, torch.Tensor] = {}

        def hook(layer):
            def capture(_module, _inputs, output):
                step[layer] = output[2].detach().cpu()  # [rows * t, k], row-major
                if len(step) == len(routers):  # the forward's last router: one [n, t, L, k] block
                    n = self._rows
                    block = torch.arange(topk).expand(step[layer].shape[0], layers, topk).clone()
                    for index, experts in step.items():
                        block[:, index] = experts
                    routes.append(block.view(n, -1, layers, topk))
                    step.clear()
            return capture

        handles = [module.register_forward_hook(hook(layer)) for layer, module in routers]
        try:
            yield routes
        finally:
            for handle in handles:
                handle.remove()

    def _sample(self, prompt: list[int], n: int, sampling: SamplingParams):
        """n responses to one prompt, sampled together (same prompt length: no padding, one KV cache)."""
        device = next(self.model.parameters()).device
        stop = set() if sampling.ignore_eos else set(self.eos_token_ids)
        stop |= set(sampling.stop_token_ids)
        generator = self._generator
        if sampling.seed is not None:
            generator = torch.Generator(device=device).manual_seed(sampling.seed)
        ids = torch.tensor([prompt] * n, dtype=torch.long, device=device)
        self._rows = n
        out = self.model(input_ids=ids, use_cache=True)
        tokens = [[] for _ in range(n)]
        logprobs = [[] for _ in range(n)]
        finished = [None] * n
        for _ in range(sampling.max_new_tokens):
            scaled = out.logits[:, -1].float() / sampling.temperature
            logp = torch.log_softmax(scaled, dim=-1)
            probs = torch.softmax(_filter(scaled, sampling), dim=-1)
            token = torch.multinomial(probs, 1, generator=generator)  # [n, 1]
            picked = logp.gather(-1, token)[:, 0]
            for r in range(n):
                if finished[r] is None:
                    t = int(token[r])
                    tokens[r].append(t)
                    logprobs[r].append(float(picked[r]))
                    if t in stop:
                        finished[r] = "stop"
            if all(f is not None for f in finished):
                break
            out = self.model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
        return [(tokens[r], logprobs[r], finished[r] or "length") for r in range(n)]

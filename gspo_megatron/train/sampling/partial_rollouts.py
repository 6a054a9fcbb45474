"""Partial rollouts (``rollout.partial_chunk_tokens``): generations still running when a step's batch is full are
cut there and continued next step, under the new weights (slime's partial rollout, Kimi k1.5's).

Rank 0 keeps the groups in flight across steps. Each step, until ``prompts_per_step`` groups are complete:

    start new groups, G samples each, as many as the batch still lacks but at most partial_groups_in_flight
        generating (default 2 x prompts_per_step: slime's over-sampling); their prompts are drawn through ``draw``
        (the other ranks draw as many: ``broadcast.as_rollout``)
    one chunk for every sample still running, at most partial_chunk_tokens new tokens (and max_new_tokens in all):
        a new group's:        engine.generate([prompt ids], G)
        a begun sample's:     engine.generate([prompt ids + its response ids so far], 1)   token ids, never text
    a group whose G samples have all finished is complete (in the order groups started)

The batch is the first prompts_per_step complete groups (a surplus of the last chunk waits for the next step).
The samples still running stay here with their response ids, the engine's per-token log-probs and the weight
version of every token; next step their chunks come from the new weights, so a sample spans versions. Its
``Rollout.versions`` entry is its oldest token's version: the loop marks it stale and takes the engine's
per-token log-probs as pi_old (each token's behaviour policy), and with ``rollout.partial_mask=old_tokens`` the
tokens of older versions carry no loss (``batch["token_versions"]``).

With partial_chunk_tokens >= max_new_tokens every sample finishes in its first chunk: each step is sync mode's
single ``generate`` of prompts_per_step new groups, nothing is carried. Checkpoints keep the groups in flight
(``state_dict``): a resumed run continues them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from gspo_megatron.rollout.types import Sample, SamplingParams
from gspo_megatron.train.startup.config import Config
from gspo_megatron.train.startup.data import Prompt


@dataclass
class _Group:
    """A group in flight: its prompt and G samples so far (``prompt_ids`` the prompt's, the response growing)."""

    prompt: Prompt
    samples: list[Sample]
    running: list[bool]  # per sample: not finished (no stop token yet, under max_new_tokens)

    @property
    def complete(self) -> bool:
        return not any(self.running)


class PartialRollouts:
    """Rank 0's groups in flight between steps (see the module docstring)."""

    def __init__(self, cfg: Config):
        r = cfg.rollout
        self.groups_per_step, self.group_size = r.prompts_per_step, r.group_size
        self.chunk, self.max_new_tokens = r.partial_chunk_tokens, r.max_new_tokens
        self.in_flight = r.partial_groups_in_flight or 2 * r.prompts_per_step
        self.live: list[_Group] = []  # in start order; complete ones leave for ``ready``
        self.ready: list[_Group] = []

    def step(self, engine, draw, sampling: SamplingParams, version: int) -> tuple:
        """This step's complete groups -> (samples prompt-major, their prompts, generation seconds, prompts drawn,
        metrics). ``draw(count)``: the next prompts (rank 0's stream); ``sampling``: the step's parameters (its
        max_new_tokens is replaced by each chunk's); ``version``: the trainer's weight version the engine serves."""
        start, rounds, drawn = time.perf_counter(), 0, 0
        while len(self.ready) < self.groups_per_step:
            # never more than in_flight groups generating, nor more new ones than the batch still lacks
            count = min(self.in_flight - len(self.live), self.groups_per_step - len(self.ready))
            new = draw(count) if count > 0 else []
            drawn += len(new)
            # seeds: new groups as sync mode's round ``rounds``; continuations another per round
            params = replace(sampling, seed=None if sampling.seed is None else sampling.seed + 1_000_003 * rounds)
            self._continue(engine, params, version)
            self._start(engine, new, params, version)
            self.ready += [g for g in self.live if g.complete]
            self.live = [g for g in self.live if not g.complete]
            rounds += 1
        batch, self.ready = self.ready[:self.groups_per_step], self.ready[self.groups_per_step:]
        samples = [replace(s, prompt_index=g, sample_index=k)
                   for g, group in enumerate(batch) for k, s in enumerate(group.samples)]
        carried = [s for g in self.live for s, running in zip(g.samples, g.running) if running]
        spans = [len(set(s.token_versions)) for s in samples]
        tokens = sum(len(s.token_versions) for s in samples)
        old = sum(v != version for s in samples for v in s.token_versions)
        metrics = {
            "partial/rounds": float(rounds),
            "partial/samples_carried": float(len(carried)),  # running at the cut: continued next step
            "partial/tokens_carried": float(sum(len(s.response_ids) for s in carried)),
            "partial/groups_carried": float(len(self.live) + len(self.ready)),
            "partial/samples_spanning_versions": float(sum(n > 1 for n in spans)),
            "partial/max_versions_spanned": float(max(spans)),
            "partial/old_tokens_frac": old / max(tokens, 1),  # the batch's response tokens of older weights
        }
        return samples, [g.prompt for g in batch], time.perf_counter() - start, drawn, metrics

    def state_dict(self) -> dict:
        """The groups in flight and the complete ones waiting, as plain lists (a checkpoint's trainer state)."""
        def group(g: _Group) -> dict:
            return {"prompt": [list(g.prompt.ids), g.prompt.text, g.prompt.label], "running": list(g.running),
                    "samples": [[s.response_ids, s.logprobs, s.finish_reason, s.weight_version, s.token_versions]
                                for s in g.samples]}
        return {"live": [group(g) for g in self.live], "ready": [group(g) for g in self.ready]}

    def load_state_dict(self, state: dict) -> None:
        def group(d: dict) -> _Group:
            prompt = Prompt(*d["prompt"])
            samples = [Sample(list(prompt.ids), list(ids), list(lp), finish, version, 0, k,
                              token_versions=list(versions))
                       for k, (ids, lp, finish, version, versions) in enumerate(d["samples"])]
            return _Group(prompt, samples, list(d["running"]))
        self.live, self.ready = [group(d) for d in state["live"]], [group(d) for d in state["ready"]]

    def _start(self, engine, prompts: list[Prompt], sampling: SamplingParams, version: int) -> None:
        """New groups with their first chunk (one call: G samples per prompt, as sync mode samples them)."""
        if not prompts:
            return
        params = replace(sampling, max_new_tokens=min(self.chunk, self.max_new_tokens))
        for prompt, out in zip(prompts, engine.generate([p.ids for p in prompts], self.group_size, params)):
            group = _Group(prompt, [], [])
            for s in out.samples:
                sample = replace(s, prompt_ids=list(prompt.ids), token_versions=[version] * len(s.response_ids),
                                 rollout_routing=None)
                group.samples.append(sample)
                group.running.append(self._running(sample, s.finish_reason))
            self.live.append(group)

    def _continue(self, engine, sampling: SamplingParams, version: int) -> None:
        """One more chunk for every running sample of the groups begun earlier: prompt + response ids so far as
        the engine's prompt; one call per chunk budget (a sample near max_new_tokens gets only what is left)."""
        running = [(g, k) for g in self.live for k in range(self.group_size) if g.running[k]]
        budgets: dict[int, list] = {}
        for g, k in running:
            left = self.max_new_tokens - len(g.samples[k].response_ids)
            budgets.setdefault(min(self.chunk, left), []).append((g, k))
        params = replace(sampling, seed=None if sampling.seed is None else sampling.seed + 500_009)
        for budget, members in sorted(budgets.items()):
            contexts = [g.samples[k].prompt_ids + g.samples[k].response_ids for g, k in members]
            outs = engine.generate(contexts, 1, replace(params, max_new_tokens=budget))
            for (g, k), out in zip(members, outs):
                s, chunk = g.samples[k], out.samples[0]
                if not chunk.response_ids:
                    raise RuntimeError(f"partial rollouts: the engine returned no token continuing {s.name} "
                                       f"({len(s.response_ids)} tokens so far, finish {chunk.finish_reason!r})")
                g.samples[k] = replace(s, response_ids=s.response_ids + chunk.response_ids,
                                       logprobs=s.logprobs + chunk.logprobs,
                                       token_versions=s.token_versions + [version] * len(chunk.response_ids),
                                       finish_reason=chunk.finish_reason, weight_version=chunk.weight_version,
                                       text=None)
                g.running[k] = self._running(g.samples[k], chunk.finish_reason)

    def _running(self, sample: Sample, finish: str) -> bool:
        """Cut at the chunk's end (``length``) with budget left: continued in the next chunk."""
        return finish == "length" and len(sample.response_ids) < self.max_new_tokens

"""Where the loop's rollouts come from: ``rollout.mode`` sync, one_step_off or async, one loop for all three.

    sync          batch k is sampled when step k asks for it, by the weights of step k-1 (staleness 0)
    one_step_off  batch k+1 is sampled while the trainer updates on batch k, by the same weights as batch k; the
                  weight sync after step k waits for that generation to end, so every sample comes from one
                  version and is exactly one version old when trained on (after the first step: staleness 1)
    async         up to ``rollout.max_staleness`` batches are sampled ahead, one after another; the weight sync
                  pauses the servers (SGLang's pause / continue generation) instead of waiting, so a sample in
                  flight across a sync has its later tokens from the newer weights (staleness <= max_staleness)

Rank 0 owns the engine: the batches ahead are generated and scored on one background thread, which only talks
to the servers (HTTP) and the reward workers; every collective (the batch's broadcast, the weight sync) stays on
the caller's thread, in the same order on every rank. Every rank draws each batch's prompts when the batch is
queued, so data positions stay equal; the checkpointed position is the one before the batches not trained on
yet (a resumed run samples them again). With ``rollout.partial_chunk_tokens`` (sync mode) the samples still
running when a step's batch is full are carried to the next step (``train/sampling/partial_rollouts.py``). A sample's
version is the trainer's weight version the engine served when its batch started (``Rollout.versions``); the loop takes pi_old of samples from older weights from the
engine's log-probs (the behaviour policy's), and logs ``staleness_mean`` / ``staleness_max``.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch.distributed as dist

from gspo_megatron.parallel import control
from gspo_megatron.train.resilience import fault_injection
from gspo_megatron.train.sampling import broadcast, rounds
from gspo_megatron.train.sampling.broadcast import Rollout
from gspo_megatron.train.startup.config import Config
from gspo_megatron.train.startup.data import PromptStream
from gspo_megatron.train.weight_sync import sync as weight_sync
from gspo_megatron.train.sampling.partial_rollouts import PartialRollouts

MODES = ("sync", "one_step_off", "async")


def batches_ahead(cfg: Config) -> int:
    """How many batches past the one being trained on are sampled in the background."""
    return {"sync": 0, "one_step_off": 1, "async": cfg.rollout.max_staleness}[cfg.rollout.mode]


class RolloutSource:
    """Each step's ``Rollout``, identical on every rank (``next`` is collective), and the weight sync
    and eval that must not race the generation running ahead."""

    def __init__(self, engine, prompts: PromptStream, cfg: Config, tokenizer, reward_fn, pad_multiple: int,
                 version: int = 0, policy=None):
        self.engine, self.prompts, self.cfg, self.policy = engine, prompts, cfg, policy
        self._resyncs = 0
        self.sampler = rounds.Sampler(engine, cfg, tokenizer, reward_fn)  # what every generation round uses
        self.pad_multiple = pad_multiple
        self.ahead = batches_ahead(cfg)
        self.served = version  # the weights the engine serves (read by the background thread as a batch starts)
        self.rank0 = dist.get_rank() == 0
        # Rank 0's generator of the batches ahead: one thread, so batches are sampled in order.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead") if self.ahead and self.rank0 else None
        self._queue: deque = deque()  # (step, data position before its prompts, rank 0: its Future) per queued batch
        # Rank 0: the name the engine reports for each version it served (samples carry the one they finished under).
        self._names = {version: engine.weight_version()} if self.rank0 and self.ahead else {}
        # rollout.partial_chunk_tokens: rank 0's groups in flight across steps (sync mode only).
        self.partial = PartialRollouts(cfg) if self.rank0 and cfg.rollout.partial_chunk_tokens else None

    def next(self, step: int, version: int) -> Rollout:
        """Step ``step``'s rollout (collective); ``version``: the weights the trainer holds now, which the engine
        serves. Staleness (mean, max) is ``version`` minus the samples' versions."""
        cfg = self.cfg
        if not self.rank0:  # rank 0 passes this point in rounds.produce, as its generation starts
            fault_injection.at("rollout", step)  # the fault schedule (GSPO_FAULTS); nothing otherwise
        if not self.ahead:  # sync: sampled now (with dynamic sampling: more prompts drawn as rank 0 needs them)
            # (partial rollouts: rank 0 draws every prompt as it starts groups, the others as many)
            first = [] if cfg.rollout.partial_chunk_tokens else self.prompts.next(cfg.rollout.prompts_per_step)
            rollout = broadcast.collect(self.sampler, first, step, self.pad_multiple, more_prompts=self.prompts.next,
                                        version=version, resync=self._resync(), partial=self.partial)
        else:
            while not self._queue or self._queue[-1][0] < step + self.ahead:
                self._enqueue(self._queue[-1][0] + 1 if self._queue else step)
            queued, _, future, prompts = self._queue.popleft()
            assert queued == step, f"the rollout source holds step {queued}'s batch, the loop asks for step {step}"
            # rank 0: the background rollout (re-raising its error); after a resync, this batch sampled now
            attempts = [future.result] if self.rank0 else []

            def work():
                t = time.perf_counter()
                payload = (attempts.pop() if attempts else lambda: self._produce(prompts, step))()
                payload.metrics["time/rollout_wait"] = time.perf_counter() - t  # the trainer idle, waiting for it
                # Samples in flight across a weight sync (async) finished under a newer version than they started.
                started = self._names[payload.versions]
                payload.metrics["samples_across_syncs"] = float(sum(x.weight_version != started
                                                                    for x in payload.samples))
                return payload

            rollout = broadcast.as_rollout(broadcast.on_rank0(work, self._resync()), self.pad_multiple)
        staleness = (version - rollout.versions).float()
        rollout.metrics.update(staleness_mean=float(staleness.mean()), staleness_max=float(staleness.max()),
                               weight_version_min=float(rollout.versions.min()),
                               weight_version_max=float(rollout.versions.max()))
        return rollout

    def _enqueue(self, step: int) -> None:
        """Draw ``step``'s prompts (every rank) and, on rank 0, start sampling them after the batches queued."""
        position = self.prompts.state_dict()
        prompts = self.prompts.next(self.cfg.rollout.prompts_per_step)
        future = self._pool.submit(self._produce, prompts, step) if self.rank0 else None
        self._queue.append((step, position, future, prompts))

    def _produce(self, prompts, step: int) -> rounds.RolloutPayload:
        """Rank 0's background thread: one batch, under the weights served as it starts (no collective here)."""
        return rounds.produce(self.sampler, prompts, step, version=self.served)

    def sync_weights(self, policy, version: int | str) -> dict:
        """``weight_sync.sync_weights`` (collective) without racing the generation ahead: one_step_off lets it finish
        first (it is all the old version's), async pauses the servers around the update."""
        paused = False
        if self.rank0 and self.ahead:
            if self.cfg.rollout.mode == "one_step_off":
                for _, _, future, _ in self._queue:
                    future.exception()  # wait; an error surfaces when the loop asks for that batch
            else:
                self.engine.pause_generation()
                paused = True
        try:
            metrics = weight_sync.sync_weights(policy, self.engine, version)
            served = version if isinstance(version, int) else self.served  # a resync sends the same weights again
            if self.rank0 and self.ahead:
                self._names[served] = str(version)
            self.served = served
        finally:
            if paused:
                self.engine.continue_generation()
        if self.rank0 and self.cfg.rollout.mode == "async":
            metrics["weight_sync/paused"] = int(paused)  # requests in flight were held over the update
        return metrics

    def _resync(self):
        """The weight sync again, under a new name (collective: ``on_rank0`` calls it on every rank), for a rollout
        server restarted serving its launch weights after a distributed sync; None without a policy to send."""
        if self.policy is None:
            return None

        def resync():
            self._resyncs += 1
            self.sync_weights(self.policy, f"{self.served}-resync{self._resyncs}")

        return resync

    def evaluate(self, prompts, step: int) -> dict:
        """``broadcast.evaluate`` (collective); with batches sampled ahead, rank 0 runs it on their thread,
        after them (the reward workers serve one thread at a time)."""
        if not self.ahead:
            return broadcast.evaluate(self.sampler, prompts, step, self._resync())
        return broadcast.on_rank0(lambda: self._pool.submit(rounds.eval_metrics, self.sampler, prompts, step).result(),
                                  self._resync())

    def state_dict(self) -> dict:
        """What a checkpoint keeps (collective): the data position and, with partial rollouts, rank 0's groups in
        flight (the other ranks save the same)."""
        state = {"data_position": self.position()}
        if self.cfg.rollout.partial_chunk_tokens:
            state["partial_rollouts"] = control.broadcast_from_rank0(self.partial.state_dict() if self.rank0 else None)
        return state

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state["data_position"])
        if self.partial is not None and state.get("partial_rollouts"):
            self.partial.load_state_dict(state["partial_rollouts"])

    def position(self) -> dict:
        """The data position to checkpoint: before the prompts of the batches not trained on yet."""
        return self._queue[0][1] if self._queue else self.prompts.state_dict()

    def close(self) -> None:
        """Stop sampling ahead (a request in flight ends with the engine's close)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

"""Environments for the multi-turn tests (loaded by name: ``tests.rewards.user_envs:ScriptedEnv``)."""

from __future__ import annotations

from gspo_megatron.rewards.multiturn import Step

OBSERVATION_IDS = [7, 8, 9]


class ScriptedEnv:
    """Deterministic: turn k (1-based) gets reward 0.5 k; odd turns observe the text "<r{k}>", even turns the token
    ids OBSERVATION_IDS; done after ``turns`` turns. Records every turn it saw and every observation it gave."""

    def __init__(self, turns: int = 3):
        self.turns = turns

    def reset(self, prompt) -> None:
        self.prompt = list(prompt.ids)
        self.seen: list[list[int]] = []
        self.observations: list = []

    def step(self, text: str, token_ids: list[int]) -> Step:
        self.seen.append(list(token_ids))
        k = len(self.seen)
        observation = f"<r{k}>" if k % 2 else list(OBSERVATION_IDS)
        self.observations.append(observation)
        return Step(observation=observation, reward=0.5 * k, done=k >= self.turns)


class FailingEnv:
    """Raises on its second turn."""

    def reset(self, prompt) -> None:
        self.count = 0

    def step(self, text, token_ids) -> Step:
        self.count += 1
        if self.count == 2:
            raise KeyError("tool crashed")
        return Step(observation="x")


class BadRewardEnv:
    def reset(self, prompt) -> None:
        pass

    def step(self, text, token_ids) -> Step:
        return Step(reward=float("nan"), done=True)


NotAnEnv = 3

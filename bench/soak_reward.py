"""The soak run's reward: the CPU example's (``synthetic``), misbehaving on a schedule.

A response whose hash (of prompt and response: the same call gives the same fate on a retry) falls in the first
``HANG_PER_MILLE`` per mille never returns (the reward pool's time limit must mask it), the next ``RAISE_PER_MILLE``
raise (masked as a crash of the call), the rest score as the example does.
"""

from __future__ import annotations

import time
import zlib

from gspo_megatron.rewards.rewards import synthetic_reward

HANG_PER_MILLE = 2
RAISE_PER_MILLE = 3


def reward(prompt: str, response: str, label) -> float:
    fate = zlib.crc32(f"{prompt}\x00{response}".encode()) % 1000
    if fate < HANG_PER_MILLE:
        time.sleep(3600)
    if fate < HANG_PER_MILLE + RAISE_PER_MILLE:
        raise RuntimeError(f"soak: an injected reward failure ({fate})")
    return synthetic_reward(prompt, response, label)

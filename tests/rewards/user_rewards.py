"""User reward functions for test_rewards (loaded as ``tests.rewards.user_rewards:NAME``)."""


def length_reward(prompt, response, label):
    return len(response) / 10


def raises(prompt, response, label):
    if "x" in response:
        raise KeyError("no x allowed")
    return 1.0


def nan_for_b(prompt, response, label):
    return float("nan") if response.startswith("b") else 0.5


def returns_text(prompt, response, label):
    return "1.0"


not_callable = 3


def misbehaves(prompt, response, label):
    """Hangs, kills its own process or raises, as the response says (for the reward pool's tests)."""
    import os
    import time

    if response == "hang":
        time.sleep(600)
    if response == "crash":
        os._exit(3)
    if response == "raise":
        raise KeyError("bad")
    return len(response) / 10


def segments_misbehave(prompt, response_tokens, label):
    """Per-segment rewards that hang or kill their process, as the label says (for the reward pool's tests)."""
    import os
    import time

    if label == "hang":
        time.sleep(600)
    if label == "crash":
        os._exit(3)
    return [(len(response_tokens), 1.0)]

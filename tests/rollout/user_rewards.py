"""User reward functions for test_rewards (loaded as ``tests.rollout.user_rewards:NAME``)."""


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

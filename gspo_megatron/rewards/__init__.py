"""Rewards and environments: what a response is rewarded for and how a multi-turn episode unfolds. The engines that
sample the responses are ``rollout``'s; this side imports its types and errors, never the other way round
(``tests/test_import_cycles.py`` checks the direction).

- ``rewards``: math verifier, exact match, the synthetic tasks' partial credit, code tests, ``module:function``;
  ``score`` (a reward that fails is a ``RewardError`` or a masked sample, never a NaN).
- ``reward_pool.RewardPool``: scoring in worker processes with a timeout (a reward that hangs or crashes is masked).
- ``sandbox``: a Python program run in its own process under CPU, memory, output and wall-time limits;
  ``code_tests``: the reward that runs a prompt's tests there.
- ``multiturn``: multi-turn, tool-using rollouts: an environment (``reset(prompt)``, ``step(text, token_ids) ->
  Step``) answering each turn; token-exact trajectories with the observations masked; the calculator and Python
  tools. ``tool_calls``: how a turn calls a built-in tool and how its answer reads.
- ``synthetic``: the CPU example's verifiable tasks, and the character tokenizer and tiny random models they are
  served with.
- ``user_code.load_named``: a built-in by name, or ``module:attribute`` named in the config (rewards, environments).
"""

from .rewards import Rewards, load_reward_fn, score

__all__ = ["Rewards", "load_reward_fn", "score"]

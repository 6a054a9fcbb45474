"""How a turn calls a built-in tool, and how the tool's answer reads: the text both the environments
(``multiturn.CalculatorEnv``) and the synthetic tasks' demonstrations (``synthetic``) write."""

from __future__ import annotations


def calculator_call(expression: str) -> str:
    """A turn that calls ``CalculatorEnv``."""
    return f"<calc>{expression}</calc>"


def calculator_observation(result: str) -> str:
    """``CalculatorEnv``'s answer to a call."""
    return f"<result>{result}</result>"

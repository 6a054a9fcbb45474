"""The loss's configuration: each algorithm's clip range defined once (``algo.defaults.CLIP_RANGES``) and read by
``LossConfig``, ``LossConfig.grpo``, the trainer's ``bootstrap.loss_config`` and the loss functions alike."""

from __future__ import annotations

import inspect

import pytest

from gspo_megatron.train.startup.bootstrap import loss_config
from gspo_megatron.train.startup.config import load_config
from gspo_megatron import algo as algo_math
from gspo_megatron.algo.defaults import ALGORITHMS, CLIP_RANGES
from gspo_megatron.train.update.loss import LossConfig


def test_clip_ranges_are_the_papers():
    assert CLIP_RANGES == {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "grpo": (0.2, 0.27)}
    assert set(CLIP_RANGES) == set(ALGORITHMS)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_an_unset_clip_bound_is_the_algorithms(name):
    algo = LossConfig(name=name)
    assert (algo.eps_low, algo.eps_high) == CLIP_RANGES[name]
    trainer = loss_config(load_config(None, [f"algo.name={name}"]))
    assert (trainer.eps_low, trainer.eps_high) == CLIP_RANGES[name]


def test_a_set_clip_bound_is_kept():
    assert (LossConfig(eps_low=0.1).eps_low, LossConfig(eps_low=0.1).eps_high) == (0.1, 4e-4)
    assert LossConfig.grpo(eps_high=0.3).eps_low == 0.2 and LossConfig.grpo(eps_high=0.3).eps_high == 0.3
    trainer = loss_config(load_config(None, ["algo.name=grpo", "algo.eps_low=0.1"]))
    assert (trainer.eps_low, trainer.eps_high) == (0.1, 0.27)


def test_the_loss_functions_default_to_the_same_constants():
    def default(fn, name):
        return inspect.signature(fn).parameters[name].default

    for fn, name in ((algo_math.gspo_loss, "gspo"), (algo_math.gspo_sequence_objective, "gspo"),
                     (algo_math.gspo_token_loss, "gspo_token"), (algo_math.grpo_loss, "grpo")):
        assert (default(fn, "eps_low"), default(fn, "eps_high")) == CLIP_RANGES[name], fn.__name__
        assert default(fn, "max_log_ratio") == LossConfig().max_log_ratio == load_config(None, []).algo.max_log_ratio

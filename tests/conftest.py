"""Suite-wide settings: warm rank workers, and the ``megatron`` marker that selects the megatron-core 0.19 run.

- tests/gpu runs in its CPU mode (``GSPO_GPU_TESTS_ON_CPU=1``) on a machine without CUDA.
- The session's SGLang servers: ``tests/sglang_servers.py`` (tests that destroy them run last).
- ``run_on_ranks`` uses warm workers here (``GSPO_RANK_WORKERS=warm``, see ``gspo_megatron.parallel.launch``):
  ~100 multi-rank launches would otherwise pay ~8 s of start-up each. ``GSPO_RANK_WORKERS=fresh`` in the
  environment restores fresh processes for every call.
- ``@pytest.mark.megatron``: the test depends on megatron-core's version — it builds or runs a Megatron model,
  optimizer or dist checkpoint, or one of our megatron patches, in its process, in its ranks or through a CLI that
  trains one. tests/test_megatron_019.py runs exactly these again on megatron-core 0.19.2, except those also marked
  ``megatron_covered_by`` a test that runs there (``tests.megatron_use``). So that the subset cannot
  rot, a test that builds a megatron-core module without the marker fails here (``tests.megatron_use``): in its
  process, in its ``run_on_ranks`` ranks, in a command run through ``tests.warm_cli``, or in a session fixture it
  uses. Commands under torchrun or plain ``subprocess`` are out of its sight: those tests carry the marker by hand.
"""

from __future__ import annotations

import os

import torch

from tests import background
from tests import test_megatron_019  # registers its background run
from tests.megatron_use import MegatronCheck
from tests.soak import test_soak  # noqa: F401  (registers its background run)

pytest_plugins = ["tests.sglang_servers"]  # the session's SGLang servers (fixtures started_servers, engine, ...)

os.environ.setdefault("GSPO_RANK_WORKERS", "warm")
# Without a GPU, tests/gpu runs its harness with both sides on the CPU (bench/gpu_check.sh runs it on a GPU).
if not torch.cuda.is_available():
    os.environ.setdefault("GSPO_GPU_TESTS_ON_CPU", "1")
os.environ["GSPO_RANK_PROBE"] = "tests.megatron_use:probe"


def pytest_configure(config):
    # Registered, not conftest hooks: a session fixture's set-up hook is the session's, outside this folder's scope.
    config.pluginmanager.register(MegatronCheck(), "megatron_check")
    config.addinivalue_line(
        "markers", "megatron: depends on megatron-core's version (runs again on 0.19 in tests/test_megatron_019.py)")
    config.addinivalue_line(
        "markers", "triton: runs Triton kernels (runs again under the 0.19 environment's own Triton)")
    config.addinivalue_line(
        "markers", "megatron_covered_by(node_id): builds Megatron only through that test's calls; not run on 0.19")
    config.addinivalue_line("markers", "destroys_server: hangs or stops the session's SGLang server; runs last")


def pytest_collection_modifyitems(config, items):
    """Tests that hang, kill or shut down the session's SGLang servers run after every test that needs them (in
    their collected order); the tests whose command runs in the background (tests/background.py: the megatron-core
    0.19 run, the soak) wait for it, so they come last of all."""
    items.sort(key=lambda item: (background.is_background(item.nodeid),
                                 item.get_closest_marker("destroys_server") is not None))


def pytest_collection_finish(session):
    background.start_collected(session.items)  # they run beside this run
    _leave_gpu_cpu_mode_to_the_019_run(session.items)


def _leave_gpu_cpu_mode_to_the_019_run(items) -> None:
    """tests/gpu's CPU mode checks bench/gpu_check.sh's harness, which runs on the GPU machine with the megatron-core
    0.19.2 wheel it carries there: where this session also runs the 0.19 run (tests/test_megatron_019.py), the tests
    of tests/gpu that it selects run there only, not twice (~30 s of this run). Run alone (``pytest tests/gpu``), or
    without that environment, they run here."""
    import pytest

    if torch.cuda.is_available() or test_megatron_019.NODE_ID not in {item.nodeid for item in items}:
        return
    if not test_megatron_019.will_run():
        return
    for item in items:
        if item.nodeid.startswith("tests/gpu/") and test_megatron_019.selects(item):
            item.add_marker(pytest.mark.skip(reason="tests/gpu's CPU mode runs in the megatron-core 0.19 run "
                                                    "(tests/test_megatron_019.py), as on the GPU machine"))


def pytest_sessionfinish(session):
    background.stop_all()

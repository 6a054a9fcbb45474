"""Whether a test built a Megatron model, in its own process or in its ranks: what decides that it runs again on
megatron-core 0.19 (the ``megatron`` marker; tests/conftest.py fails an unmarked test that does).

A Megatron model is any ``torch.nn.Module`` whose class is megatron-core's: every model, layer spec, optimizer and
dist checkpoint of ours starts from one. Building process groups alone does not count (it needs no model).
"""

from __future__ import annotations

import pytest
import torch

_real_init = torch.nn.Module.__init__


class MegatronUse:
    """``start()`` from now on records the megatron-core module classes constructed; ``stop()`` returns them."""

    def __init__(self):
        self.built: set[str] = set()

    def _install(self) -> None:
        if torch.nn.Module.__init__ is not _real_init:
            return
        built = self.built

        def init(module, *args, **kwargs):
            cls = type(module)
            if cls.__module__.startswith("megatron."):
                built.add(f"{cls.__module__}.{cls.__qualname__}")
            _real_init(module, *args, **kwargs)

        torch.nn.Module.__init__ = init

    def start(self) -> None:
        self._install()
        self.built.clear()

    def stop(self) -> list[str]:
        return sorted(self.built)


probe = MegatronUse()


class MegatronCheck:
    """The suite's hooks (tests/conftest.py registers them): a test that built megatron-core modules, in its process,
    its ranks (``parallel.launch.probe_reports``), a command run through ``tests.warm_cli``, or a fixture it uses
    (a session fixture is built once, for the first test that asks), fails unless marked ``megatron``."""

    def __init__(self):
        self.fixture_builds: dict[str, set[str]] = {}

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        from gspo_megatron.parallel import launch

        probe.start()
        launch.probe_reports.clear()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        from gspo_megatron.parallel import launch

        before, reports = set(probe.built), len(launch.probe_reports)
        yield
        built = (probe.built - before).union(*launch.probe_reports[reports:])
        if built:
            self.fixture_builds.setdefault(fixturedef.argname, set()).update(built)

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_teardown(self, item, nextitem):
        from gspo_megatron.parallel import launch

        fixtures = (self.fixture_builds.get(name, ()) for name in getattr(item, "fixturenames", ()))
        built = set(probe.stop()).union(*launch.probe_reports, *fixtures)
        launch.probe_reports.clear()
        if built and item.get_closest_marker("megatron") is None:
            shown = ", ".join(sorted(built)[:3]) + (", ..." if len(built) > 3 else "")
            pytest.fail(f"{item.nodeid} built megatron-core modules ({shown}), or uses a fixture that did, but is "
                        "not marked @pytest.mark.megatron: mark it, so that it runs again on megatron-core 0.19",
                        pytrace=False)

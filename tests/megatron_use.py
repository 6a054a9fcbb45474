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

# ``@pytest.mark.megatron_covered_by("<node id>")`` on a test marked ``megatron``: it builds a Megatron model only
# through the calls the named test makes, which runs on 0.19 too; what it tests on top (the loop's rollout
# schedule, say) does not depend on megatron-core's version. So it runs once, in the main run: the 0.19 run
# selects ``megatron and not megatron_covered_by`` (tests/test_megatron_019.py).
COVERED_BY = "megatron_covered_by"


def check_covering_tests(items) -> None:
    """Each ``megatron_covered_by`` marker names a collected test that runs on 0.19 (marked ``megatron``, not covered
    by another), checked before any selection wherever the named test's module was collected: a covering test
    renamed, or no longer marked, stops the collection with both names."""
    by_id = {item.nodeid: item for item in items}
    collected_files = {item.nodeid.split("::")[0] for item in items}
    for item in items:
        marker = item.get_closest_marker(COVERED_BY)
        if marker is None:
            continue
        (covering,) = marker.args
        if covering.split("::")[0] not in collected_files:
            continue  # a run of a subset without the covering test's module
        runs_on_019 = covering in by_id and by_id[covering].get_closest_marker("megatron") is not None \
            and by_id[covering].get_closest_marker(COVERED_BY) is None
        if not runs_on_019:
            raise pytest.UsageError(f"{item.nodeid} is marked {COVERED_BY}({covering!r}), but no collected test of "
                                    "that name runs on megatron-core 0.19 (marked megatron, not covered by another)")


class MegatronCheck:
    """The suite's hooks (tests/conftest.py registers them): a test that built megatron-core modules, in its process,
    its ranks (``parallel.launch.probe_reports``), a command run through ``tests.warm_cli``, or a fixture it uses
    (a session fixture is built once, for the first test that asks), fails unless marked ``megatron``."""

    def __init__(self):
        # by fixture definition, not name: test modules define fixtures of the same name (``loaded``), some building
        # megatron-core modules and some not
        self.fixture_builds: dict[object, set[str]] = {}

    @pytest.hookimpl(tryfirst=True)  # before -m / -k deselect: the whole collection
    def pytest_collection_modifyitems(self, items):
        check_covering_tests(items)

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
            self.fixture_builds.setdefault(fixturedef, set()).update(built)

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_teardown(self, item, nextitem):
        from gspo_megatron.parallel import launch

        info = getattr(item, "_fixtureinfo", None)
        definitions = [d for defs in (info.name2fixturedefs.values() if info else ()) for d in defs]
        fixtures = (self.fixture_builds.get(d, ()) for d in definitions)
        built = set(probe.stop()).union(*launch.probe_reports, *fixtures)
        launch.probe_reports.clear()
        if built and item.get_closest_marker("megatron") is None:
            shown = ", ".join(sorted(built)[:3]) + (", ..." if len(built) > 3 else "")
            pytest.fail(f"{item.nodeid} built megatron-core modules ({shown}), or uses a fixture that did, but is "
                        "not marked @pytest.mark.megatron: mark it, so that it runs again on megatron-core 0.19",
                        pytrace=False)

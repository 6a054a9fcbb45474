"""Examples for tests/test_background.py's side-session test (not collected by the suite: not a test_*.py file)."""

import os

import pytest


@pytest.mark.beside
def test_passes_in_the_side_session():
    print(f"side pid {os.getpid()} session {os.environ.get('GSPO_BESIDE_SESSION')}")


@pytest.mark.beside
def test_fails_in_the_side_session():
    assert 1 + 1 == 3, "arithmetic in the side session"


@pytest.mark.beside
def test_skips_in_the_side_session():
    pytest.skip("nothing to do on this machine")


@pytest.mark.beside
@pytest.mark.parametrize("n", [1, 2])
def test_parametrized_in_the_side_session(n):
    assert n in (1, 2)


def test_stays_in_the_main_session():
    print(f"main pid {os.getpid()} session {os.environ.get('GSPO_BESIDE_SESSION')}")


if os.environ.get("BESIDE_EXAMPLE_SHARED"):
    @pytest.mark.beside
    def test_uses_the_session_server(engine):
        pass

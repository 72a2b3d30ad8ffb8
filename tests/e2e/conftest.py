"""The end-to-end tests' module fixtures: the chaos platform (tests/e2e/chaos_platform.py),
one per test module, so that the chaos modules run side by side on two test processes."""

from __future__ import annotations

import pytest

from .chaos_platform import ChaosPlatform


@pytest.fixture(scope="module")
def chaos(assets):
    p = ChaosPlatform(assets)
    try:
        yield p
    finally:
        p.close()

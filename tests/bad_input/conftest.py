"""What the bad-input tests share: a ratchet Client whose Temporal side fails any use, for
tests that show a bad input is refused before anything reaches Temporal."""

from __future__ import annotations

import asyncio

import pytest

from ratchet.platform.client import Client


class Untouchable:
    """Stands in for the Temporal client where a test proves nothing reaches Temporal."""

    def __getattr__(self, name):
        raise AssertionError(f"Temporal was reached ({name})")


@pytest.fixture
def offline_client():
    loop = asyncio.new_event_loop()
    yield Client(Untouchable(), loop, "unused")
    loop.close()

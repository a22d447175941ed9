"""Integration-tier fixtures."""

import asyncio

import pytest


@pytest.fixture()
def run():
    """Run a coroutine to completion (the client is asyncio)."""
    return lambda coro: asyncio.run(coro)

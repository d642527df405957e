"""Core test fixtures. Nothing here applies unless a test asks for it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tensorfold.family.plugins import PluginManager, reset_plugin_manager


@pytest.fixture
def tf_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No TF_* variables from the developer's shell or CI; set the test's own on the result."""
    for name in list(os.environ):
        if name.startswith("TF_"):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.fixture
def no_installed_plugins(tf_env: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """TF_PLUGINS="" and a fresh cached plugin manager: installed plugins stay out of the test."""
    tf_env.setenv("TF_PLUGINS", "")
    reset_plugin_manager()
    yield tf_env
    reset_plugin_manager()


@pytest.fixture
def pm() -> PluginManager:
    """A fresh plugin manager with tensorfold's hookspecs and no plugins."""
    return PluginManager()


@pytest.fixture(scope="session")
def chromium_exe() -> str:
    """Debian's chromium, installed with apt-get first where it is missing and can be (CI)."""
    from chromium import find_or_install

    return find_or_install()

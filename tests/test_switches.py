"""The kernel switches' registry (tensorfold.ops.switches): one typed place to read and set the
switches still undecided, and no A/B switch left as a module constant in a kernel."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tensorfold.ops import switches

ROOT = Path(__file__).resolve().parent.parent
# a module-level boolean constant: how the switches were written before the registry
BOOL_CONSTANT = re.compile(r"^[A-Z][A-Z0-9_]*\s*(:\s*bool\s*)?=\s*(True|False)\b", re.M)


def test_every_switch_is_registered_with_its_record_and_both_values_described():
    assert switches.SWITCHES
    for name, s in switches.SWITCHES.items():
        assert s.name == name and isinstance(s.default, bool)
        assert s.on() == s.default
        assert s.when_on and s.when_off and s.why
        assert s.record == f'docs/performance.md, "{name}"'


def test_a_switch_is_set_inside_a_block_and_restored_after_it():
    s = switches.OWN_RECURRENT
    with switches.switched(s, not s.default):
        assert s.on() is (not s.default)
        with switches.switched(s, s.default):
            assert s.on() is s.default
        assert s.on() is (not s.default)
    assert s.on() is s.default
    with pytest.raises(RuntimeError), switches.switched(s, not s.default):
        raise RuntimeError("restored on the way out")
    assert s.on() is s.default


def test_set_value_takes_a_registered_name_and_a_bool():
    s = switches.FP32_CHAIN_SUMS
    assert switches.set_value(s.name, False) is s.default
    try:
        assert not s.on()
    finally:
        switches.set_value(s.name, s.default)
    with pytest.raises(KeyError, match="no switch"):
        switches.set_value("NO_SUCH_SWITCH", True)
    with pytest.raises(TypeError, match="True or False"):
        switches.set_value(s.name, 1)  # type: ignore[arg-type]


def test_every_switch_is_read_by_the_code_it_switches():
    sources = [p.read_text() for p in (ROOT / "core").rglob("*.py") if p.name != "switches.py"]
    sources += [p.read_text() for p in ROOT.glob("plugins/*/tensorfold_*/**/*.py")]
    for name in switches.SWITCHES:
        assert any(f"switches.{name}.on()" in text for text in sources), name


def test_no_kernel_keeps_an_ab_switch_as_a_module_constant():
    """A kernel's way is decided (the loser deleted) or registered in tensorfold.ops.switches;
    a module-level True/False in the core or a family is how an undecided A/B used to hide."""
    files = list((ROOT / "core").rglob("*.py"))
    files += list(ROOT.glob("plugins/*/tensorfold_*/**/*.py"))
    found = [
        f"{p.relative_to(ROOT)}: {m.group(0)}"
        for p in files
        for m in BOOL_CONSTANT.finditer(p.read_text())
    ]
    assert not found, found

"""Find an executor by name (as tinygrad's ``Device["CPU"]``), without importing it by name.

Executors live in the top-level `executors` package and announce themselves through the
``graphlm.executors`` entry-point group (see pyproject.toml) or by calling `register_executor`.
Code in `graphlm` that must run a graph (``model.logits(...)``) asks this registry.
"""
from __future__ import annotations

from importlib import metadata
from typing import Any, Callable

_FACTORIES: dict[str, Callable[[], Any]] = {}
_INSTANCES: dict[str, Any] = {}


def register_executor(name: str, factory: Callable[[], Any]) -> None:
    _FACTORIES[name] = factory


def _load_entry_points() -> None:
    for ep in metadata.entry_points(group="graphlm.executors"):
        if ep.name not in _FACTORIES:
            _FACTORIES[ep.name] = ep.load


def available_executors() -> list[str]:
    _load_entry_points()
    return sorted(_FACTORIES)


def default_executor() -> str:
    """The fastest executor that works on this machine: "native" where its C kernels build (it
    says so through its `available()`), else "numpy"."""
    names = available_executors()
    if "native" in names:
        native = get_executor("native")
        if getattr(native, "available", lambda: True)():
            return "native"
    return "numpy"


def get_executor(name: str):
    """The executor registered as `name` (one shared instance per name); "auto" is
    `default_executor()`."""
    if name == "auto":
        name = default_executor()
    if name not in _INSTANCES:
        if name not in _FACTORIES:
            _load_entry_points()
        if name not in _FACTORIES:
            raise ValueError(f"no executor named '{name}'; available: {', '.join(available_executors()) or 'none'}")
        obj = _FACTORIES[name]()
        _INSTANCES[name] = obj() if isinstance(obj, type) else obj
    return _INSTANCES[name]

"""Registries by name and user functions by dotted path, shared by rewards and algorithms.

Torch-free on purpose: reward workers import :mod:`megarl.rewards` (and so this module) and must
start fast; :mod:`megarl.algorithms` uses the same loader without importing the rewards package.

A registered name is looked up in a plain dict; anything else containing ``:`` or ``.`` is
imported as ``package.module:attr`` (attr may be ``Class.method``) or ``package.module.attr``.
The function must be importable in every process that uses it, i.e. defined at module level.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

__all__ = ["load_function", "resolve"]


def load_function(path: str) -> Callable[..., Any]:
    """Import ``package.module:attr`` (attr may be ``Class.method``) or ``package.module.attr``."""
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
    else:
        module_name, _, attr_path = path.rpartition(".")
    if not module_name or not attr_path:
        raise ValueError(f"not a dotted path: {path!r}; expected 'package.module:function' or 'package.module.function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} for {path!r}: {exc}") from exc
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise ValueError(f"{path!r}: {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise TypeError(f"{path!r} resolved to {type(obj).__name__}, which is not callable")
    return obj


def resolve(name_or_path: str | Callable[..., Any], registry: dict[str, Callable[..., Any]], kind: str) -> Callable[..., Any]:
    """A callable passes through; a registered name is looked up; a dotted path is imported."""
    if callable(name_or_path):
        return name_or_path
    if not isinstance(name_or_path, str):
        raise TypeError(f"{kind} must be a name, a dotted path or a callable, got {type(name_or_path).__name__}")
    if name_or_path in registry:
        return registry[name_or_path]
    if ":" in name_or_path or "." in name_or_path:
        return load_function(name_or_path)
    raise ValueError(f"unknown {kind} {name_or_path!r}; known: {sorted(registry)} (or a dotted path 'package.module:function')")

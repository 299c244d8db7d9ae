"""The one registry of every vLLM attribute that vllm-tfm replaces.

Each patch is applied by one function in one place (``config_patch``, ``guards``, the runtime
package), exactly once per process: :func:`replace_attribute` keeps the original value, sets
``__wrapped__`` on the replacement, refuses to patch twice, and names the missing attribute in a
one-line error when the installed vLLM does not have it (the version check in ``version.py`` runs
before any patch). :func:`restore_all` puts every original back, for tests that must show that
vLLM without the plugin behaves as before.

Runtime patches (``vllm_tfm.vllm_plugin.runtime``) should use the same registry so that
``installed_patches()`` lists everything the plugin changed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Patch",
    "replace_attribute",
    "record_patch",
    "original",
    "is_patched",
    "installed_patches",
    "restore",
    "restore_all",
]

_MISSING = object()
_LOCK = threading.RLock()


@dataclass(frozen=True)
class Patch:
    """One replaced attribute: ``owner.name`` was ``original`` and is now ``replacement``."""

    key: str
    original: Any
    replacement: Any
    reason: str
    undo: Callable[[], None]


_PATCHES: dict[str, Patch] = {}


def _owner_name(owner: Any) -> str:
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return getattr(owner, "__name__", repr(owner))


def _key(owner: Any, name: str) -> str:
    return f"{_owner_name(owner)}.{name}"


def _vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # pragma: no cover - only reached without vLLM
        return "unknown"


def replace_attribute(
    owner: Any,
    name: str,
    make_replacement: Callable[[Any], Any],
    *,
    reason: str,
) -> bool:
    """Replace ``owner.name`` by ``make_replacement(original)``; a no-op when already done.

    ``original`` is the value found on ``owner`` (for a class, the plain function as stored in
    the class or inherited from a base). Returns True when the patch was applied now, False when
    it was already in place. Raises RuntimeError (one line) when vLLM has no such attribute or
    when something else replaced our patch afterwards.
    """
    key = _key(owner, name)
    with _LOCK:
        current = getattr(owner, "__dict__", {}).get(name, _MISSING) if isinstance(owner, type) else _MISSING
        if key in _PATCHES:
            live = current if current is not _MISSING else getattr(owner, name, _MISSING)
            if live is _PATCHES[key].replacement:
                return False
            raise RuntimeError(f"vllm_tfm: {key} was replaced by other code after vllm-tfm patched it")
        if current is _MISSING:
            current = getattr(owner, name, _MISSING)
            owned = not isinstance(owner, type)  # a module's attribute is its own; a class may inherit it
        else:
            owned = True
        if current is _MISSING:
            raise RuntimeError(
                f"vllm_tfm: vLLM {_vllm_version()} has no {key}; vllm-tfm supports vLLM 0.26.x only"
            )
        replacement = make_replacement(current)
        if callable(replacement) and not hasattr(replacement, "__wrapped__"):
            try:
                replacement.__wrapped__ = current
            except (AttributeError, TypeError):  # pragma: no cover - builtins refuse attributes
                pass
        setattr(owner, name, replacement)

        def undo(owner: Any = owner, name: str = name, value: Any = current, owned: bool = owned) -> None:
            if owned:
                setattr(owner, name, value)
            else:
                delattr(owner, name)

        _PATCHES[key] = Patch(key=key, original=current, replacement=replacement, reason=reason, undo=undo)
        return True


def record_patch(key: str, original: Any, replacement: Any, *, reason: str, undo: Callable[[], None]) -> bool:
    """Register a patch that is not a plain attribute swap (e.g. a rebuilt pydantic schema).

    Returns False (and records nothing) when ``key`` is already registered.
    """
    with _LOCK:
        if key in _PATCHES:
            return False
        _PATCHES[key] = Patch(key=key, original=original, replacement=replacement, reason=reason, undo=undo)
        return True


def original(owner: Any, name: str) -> Any:
    """The value ``owner.name`` had before vllm-tfm patched it (KeyError when not patched)."""
    return _PATCHES[_key(owner, name)].original


def is_patched(owner: Any, name: str) -> bool:
    return _key(owner, name) in _PATCHES


def installed_patches() -> dict[str, Patch]:
    """A copy of the registry, keyed ``module.Class.attribute``, in the order applied."""
    with _LOCK:
        return dict(_PATCHES)


def restore(keys: Iterable[str]) -> list[str]:
    """Undo the patches named by ``keys`` (those registered), newest first; returns the keys undone."""
    wanted = set(keys)
    with _LOCK:
        done = [key for key in list(_PATCHES)[::-1] if key in wanted]
        for key in done:
            _PATCHES.pop(key).undo()
        return done


def restore_all() -> list[str]:
    """Undo every patch, newest first; returns the keys restored. For tests and teardown.

    A component whose ``install()`` keeps its own "already installed" flag will not re-apply its
    patches after this; decide "installed" with :func:`is_patched` instead.
    """
    return restore(list(_PATCHES))

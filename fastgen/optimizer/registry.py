"""The one table of patches, and the machinery that applies and undoes them.

A patch is data (:class:`Patch`): which attribute to replace, which factory builds the
replacement, and which versions of the target package it was tested against. Patches are
applied lazily: a target whose module is not imported yet is patched the moment it is
imported (a ``sys.meta_path`` hook), so ``import fastgen`` never imports fairseq or the heavy
parts of transformers itself.

Every installed replacement is wrapped in a dispatcher that calls the original while
:func:`unpatched` is in force (a ``ContextVar``, so it is thread- and task-safe), and
:func:`disable` puts back the exact original objects.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import inspect
import logging
import os
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

log = logging.getLogger("fastgen")

_active: contextvars.ContextVar[bool] = contextvars.ContextVar("fastgen_active", default=True)
_lock = threading.RLock()


@dataclasses.dataclass(frozen=True)
class Patch:
    """One replacement of one attribute, declared as data.

    ``target`` is ``"module.path:Owner.attr"``; ``factory`` is ``"module.path:function"``, a
    callable that receives the original function and returns its replacement (so the
    replacement can fall back to it per call). ``package`` is the import name of the patched
    package and ``versions`` the PEP 440 range it was tested against. ``expects`` lists
    parameter names the target must have: a moved or changed signature is refused at patch
    time rather than failing mid-generation.
    """

    feature: str
    target: str
    factory: str
    package: str
    versions: str
    expects: tuple[str, ...] | None = None

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def attr_path(self) -> list[str]:
        return self.target.partition(":")[2].split(".")


@dataclasses.dataclass
class _Applied:
    owner: Any
    name: str
    original: Any  # the raw object found in owner.__dict__, or _MISSING if inherited
    installed: Any


_MISSING = object()


class _State:
    """Mutable registry state, guarded by ``_lock``."""

    def __init__(self) -> None:
        self.enabled_features: set[str] | None = None  # None: fastgen disabled; else the selected features
        self.applied: dict[Patch, _Applied] = {}
        self.status: dict[Patch, str] = {}
        self.warned: set[tuple[str, str]] = set()


_state = _State()


def declared_patches() -> list[Patch]:
    """All patches fastgen knows, from the per-framework declaration modules."""
    from fastgen.optimizer.fairseq.patches import PATCHES as fairseq_patches
    from fastgen.optimizer.transformers.patches import PATCHES as hf_patches

    return [*hf_patches, *fairseq_patches]


#: features applied only when named (``enable([...])`` / ``FASTGEN_FEATURES``), never by default:
#: unfinished work that must not change what a plain ``import fastgen`` runs.
OPT_IN_FEATURES = frozenset({"beam"})


def known_features() -> list[str]:
    """Feature names, in declaration order."""
    return list(dict.fromkeys(p.feature for p in declared_patches()))


# ---------------------------------------------------------------------------- versions


@functools.cache
def installed_version(package: str) -> str | None:
    """Version of the distribution that provides import name ``package``, without importing it."""
    if importlib.util.find_spec(package) is None:
        return None
    dists = importlib.metadata.packages_distributions().get(package, [])
    for dist in dists:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    return "unknown"


def version_problem(patch: Patch) -> str | None:
    """Why ``patch`` must be skipped for the installed package version, or None."""
    version = installed_version(patch.package)
    if version is None:
        return f"{patch.package} is not installed"
    if version == "unknown":
        return f"{patch.package} version is unknown"
    if Version(version) not in SpecifierSet(patch.versions):
        return f"{patch.package} {version} is outside the tested range {patch.versions}"
    return None


# ---------------------------------------------------------------------------- applying


def _resolve_owner(patch: Patch) -> tuple[Any, str]:
    module = sys.modules[patch.module]
    *owner_path, name = patch.attr_path
    owner: Any = module
    for part in owner_path:
        owner = getattr(owner, part)
    return owner, name


def _raw_attribute(owner: Any, name: str) -> Any:
    """The attribute as stored on ``owner`` or the first class of its MRO that has it."""
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if name in klass.__dict__:
                return klass.__dict__[name]
        raise AttributeError(name)
    return inspect.getattr_static(owner, name)


def _signature_problem(func: Callable[..., Any], expects: tuple[str, ...] | None) -> str | None:
    if not expects:
        return None
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return "target signature cannot be inspected"
    missing = [p for p in expects if p not in params]
    if missing:
        return f"target signature changed: missing parameter(s) {', '.join(missing)}"
    return None


def _make_dispatcher(original: Callable[..., Any], replacement: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def dispatcher(*args: Any, **kwargs: Any) -> Any:
        if _active.get():
            return replacement(*args, **kwargs)
        return original(*args, **kwargs)

    dispatcher.__fastgen_patched__ = True  # type: ignore[attr-defined]
    return dispatcher


def _load_factory(path: str) -> Callable[..., Any]:
    module_name, _, func_name = path.partition(":")
    return getattr(importlib.import_module(module_name), func_name)


def _apply(patch: Patch) -> None:
    """Install ``patch`` now; its module must be imported. Records the outcome in status."""
    problem = version_problem(patch)
    if problem:
        _state.status[patch] = f"skipped: {problem}"
        return
    try:
        owner, name = _resolve_owner(patch)
        raw = _raw_attribute(owner, name)
    except AttributeError as exc:
        _state.status[patch] = f"skipped: target not found ({exc}); symbol path may have changed"
        _warn_once(patch.feature, _state.status[patch])
        return
    descriptor: type | None = type(raw) if isinstance(raw, staticmethod | classmethod) else None
    func = raw.__func__ if descriptor else raw
    own = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name)
    if getattr(func, "__fastgen_patched__", False):
        if own is not _MISSING:
            _state.status[patch] = "skipped: already patched"
            return
        func = func.__wrapped__  # inherited from a patched base class: wrap the upstream original
    problem = _signature_problem(func, patch.expects)
    if problem:
        _state.status[patch] = f"skipped: {problem}"
        _warn_once(patch.feature, f"{patch.target}: {problem}")
        return
    try:
        replacement = _load_factory(patch.factory)(func)
    except Exception as exc:  # a broken factory must never break the user's program
        _state.status[patch] = f"skipped: factory failed ({type(exc).__name__}: {exc})"
        _warn_once(patch.feature, _state.status[patch])
        return
    installed: Any = _make_dispatcher(func, replacement)
    if descriptor:
        installed = descriptor(installed)
    setattr(owner, name, installed)
    _state.applied[patch] = _Applied(owner, name, own, installed)
    _state.status[patch] = "applied"


def _restore(patch: Patch) -> None:
    record = _state.applied.pop(patch)
    if record.original is _MISSING:
        delattr(record.owner, record.name)
    else:
        setattr(record.owner, record.name, record.original)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Applies pending patches right after their target module is first imported."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if _state.enabled_features is None or not any(p.module == fullname for p in _pending()):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original_exec = loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            original_exec(module)
            with _lock:
                for patch in _pending():
                    if patch.module == fullname:
                        _apply(patch)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_finder = _PatchOnImport()


def _selected(patches: Iterable[Patch]) -> list[Patch]:
    chosen = _state.enabled_features
    if chosen is None:
        return []
    return [p for p in patches if p.feature in chosen]


def _pending() -> list[Patch]:
    """Selected patches waiting for their module to be imported."""
    return [p for p in _selected(declared_patches()) if _state.status.get(p, "").startswith("pending")]


# ---------------------------------------------------------------------------- public API


def _features_from_env() -> list[str] | None:
    raw = os.environ.get("FASTGEN_FEATURES", "").strip()
    return [f.strip() for f in raw.split(",") if f.strip()] or None


def enable(features: Iterable[str] | None = None) -> None:
    """Apply the declared patches (all, or only the named features).

    ``features=None`` honours ``FASTGEN_FEATURES=a,b``, else enables everything but
    ``OPT_IN_FEATURES``; ``features=[]``
    enables none (fastgen stays importable and ``status()`` lists every patch as not selected).
    Patches of a module not imported yet are applied when it is imported. Calling again re-selects.
    """
    wanted = list(features) if features is not None else _features_from_env()
    known = known_features()
    unknown = set(wanted or []) - set(known)
    if unknown:
        raise ValueError(f"unknown fastgen feature(s) {sorted(unknown)}; known: {known}")
    with _lock:
        disable()
        _state.enabled_features = set(known) - OPT_IN_FEATURES if wanted is None else set(wanted)
        for patch in _selected(declared_patches()):
            problem = version_problem(patch)
            if problem:
                _state.status[patch] = f"skipped: {problem}"
                if installed_version(patch.package) is not None:
                    _warn_once(patch.feature, problem)
            elif patch.module in sys.modules:
                _apply(patch)
            else:
                _state.status[patch] = f"pending: applied when {patch.module} is imported"
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


def disable() -> None:
    """Undo every patch, restoring the exact original objects; stop patching on import."""
    with _lock:
        for patch in list(_state.applied):
            _restore(patch)
        _state.enabled_features = None
        _state.status.clear()
        if _finder in sys.meta_path:
            sys.meta_path.remove(_finder)


def is_enabled() -> bool:
    return _state.enabled_features is not None


def feature_enabled(feature: str) -> bool:
    """True while ``feature`` is selected by :func:`enable` (cheap enough to ask per call)."""
    chosen = _state.enabled_features
    return chosen is not None and feature in chosen


def active() -> bool:
    """True unless the current context is inside :func:`unpatched`."""
    return _active.get()


@contextlib.contextmanager
def unpatched() -> Iterator[None]:
    """Run upstream code inside the block (this thread/task only); patches stay installed."""
    token = _active.set(False)
    try:
        yield
    finally:
        _active.reset(token)


@contextlib.contextmanager
def patched(features: Iterable[str] | None = None) -> Iterator[None]:
    """Enable fastgen (optionally only ``features``) inside the block, then restore the previous state."""
    previous = None if _state.enabled_features is None else set(_state.enabled_features)
    enable(features)
    token = _active.set(True)
    try:
        yield
    finally:
        _active.reset(token)
        if previous is None:
            disable()
        else:
            enable(previous)


@dataclasses.dataclass(frozen=True)
class PatchStatus:
    feature: str
    target: str
    state: str

    def __str__(self) -> str:
        return f"{self.feature:<10} {self.target:<95} {self.state}"


class StatusTable(list[PatchStatus]):
    """A list of :class:`PatchStatus` that prints as a table."""

    def __str__(self) -> str:
        header = f"{'feature':<10} {'target':<95} state"
        return "\n".join([header, "-" * len(header), *map(str, self)])


def status() -> StatusTable:
    """Every declared patch with its state: applied, pending (module not imported), skipped (why), disabled."""
    with _lock:
        rows = StatusTable()
        selected = set(_selected(declared_patches()))
        for patch in declared_patches():
            if patch in _state.status:
                state = _state.status[patch]
            elif _state.enabled_features is None:
                state = "disabled: fastgen.disable() or FASTGEN_DISABLE=1"
            elif patch not in selected:
                state = "disabled: feature not selected"
            else:
                state = "pending"
            rows.append(PatchStatus(patch.feature, patch.target, state))
        return rows


def _warn_once(feature: str, reason: str) -> None:
    key = (feature, reason)
    if key not in _state.warned:
        _state.warned.add(key)
        log.warning("fastgen[%s]: %s", feature, reason)


def fallback(feature: str, reason: str) -> None:
    """Note that a replacement handed a call back to upstream; warns once per distinct reason."""
    _warn_once(feature, f"falling back to upstream: {reason}")

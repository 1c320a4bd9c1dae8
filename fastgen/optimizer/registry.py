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
import textwrap
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from fastgen._log import origin
from fastgen.optimizer import report

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

    ``traced`` marks a target that runs inside a model's forward, possibly under
    ``torch.compile``: its replacement is installed as is, without the dispatcher, because Dynamo
    cannot trace the dispatcher's ``ContextVar`` read (one graph break per call). Such a
    replacement must be traceable and honour :func:`unpatched` itself, outside traces.

    ``requires`` is ``"module.path:function"``, a check run before applying: it returns why the
    installed package's structure rules the patch out (e.g. a renamed name the replacement needs),
    or None. The patch is then skipped with that reason, so ``status()`` never says ``applied`` for
    a patch that cannot run. The registry knows nothing of the frameworks; the check does.
    """

    feature: str
    target: str
    factory: str
    package: str
    versions: str
    expects: tuple[str, ...] | None = None
    traced: bool = False
    requires: str | None = None

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


_declared: list[Patch] = []


def declare(patches: Iterable[Patch]) -> None:
    """Add patches to the table (:mod:`fastgen.optimizer.catalog` declares the frameworks' at import).

    The registry knows no framework: declarations come from outside, so nothing here imports them.
    """
    with _lock:
        _declared.extend(p for p in patches if p not in _declared)


def declared_patches() -> list[Patch]:
    """All patches declared so far, in declaration order."""
    return list(_declared)


#: features applied only when named (``enable([...])`` / ``FASTGEN_FEATURES``), never by default:
#: unfinished work that must not change what a plain ``import fastgen`` runs.
#: fast_gemm: oneDNN packed linears, faster on CPU but not bit-identical to upstream (issue 18).
#: int8: int8 linears (issue 27), approximate by design.
OPT_IN_FEATURES: frozenset[str] = frozenset({"fast_gemm", "int8"})  # beam was, until its loop matched upstream's suites


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


def _make_dispatcher(
    original: Callable[..., Any], replacement: Callable[..., Any], traced: bool = False
) -> Callable[..., Any]:
    if traced:  # see Patch.traced: the replacement itself, marked as patched
        installed = functools.wraps(original)(replacement)
        installed.__fastgen_patched__ = True  # type: ignore[attr-defined]
        return installed
    # The body reads closure variables only, never this module's globals (see below); their names
    # are unlikely to shadow a global of the upstream module for TorchScript.
    _fastgen_active, _fastgen_original, _fastgen_replacement = _active, original, replacement

    def dispatcher(*args: Any, **kwargs: Any) -> Any:
        if _fastgen_active.get():
            return _fastgen_replacement(*args, **kwargs)
        return _fastgen_original(*args, **kwargs)

    # TorchScript (torch.jit.script of a fairseq SequenceGenerator) compiles the *original*: it reads
    # the source through ``__wrapped__`` but resolves names in the dispatcher's ``__globals__`` (plus
    # its closure). Giving the dispatcher the original's globals makes scripting compile upstream's
    # code exactly as without fastgen (instead of failing on "undefined value torch" and leaving
    # TorchScript's type cache half-built). Python calls are unaffected: the body reads no globals.
    source = inspect.unwrap(original)
    globals_ = getattr(source, "__globals__", None)
    if globals_ is not None:
        dispatcher = types.FunctionType(
            dispatcher.__code__, globals_, dispatcher.__name__, None, dispatcher.__closure__
        )
    functools.update_wrapper(dispatcher, original)
    dispatcher.__fastgen_patched__ = True  # type: ignore[attr-defined]
    return dispatcher


def _load_factory(path: str) -> Callable[..., Any]:
    module_name, _, func_name = path.partition(":")
    return getattr(importlib.import_module(module_name), func_name)


def _factory_module(patch: Patch) -> str:
    return patch.factory.partition(":")[0]


def _helper_modules(patch: Patch) -> tuple[str, ...]:
    """The fastgen modules a patch loads when applied: its factory's and its check's."""
    modules = (_factory_module(patch),)
    return (*modules, patch.requires.partition(":")[0]) if patch.requires else modules


def _requirement_problem(patch: Patch) -> str | None:
    if patch.requires is None:
        return None
    try:
        return _load_factory(patch.requires)()
    except Exception as exc:  # a broken check must never break the user's program
        return f"requirement check failed ({type(exc).__name__}: {exc})"


def _initializing(module_name: str) -> bool:
    """Whether ``module_name`` is being imported right now (in ``sys.modules``, not yet executed)."""
    module = sys.modules.get(module_name)
    return module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False)


def _stacks_on(patch: Patch, owner: Any, name: str, own: Any) -> bool:
    """Whether ``own`` on ``owner.name`` was installed by an applied patch of another feature.

    Two features may hook the same target (e.g. ``generate``: dedup folds the returned cache, gemm
    scopes its output-projection hook to the call). The later one wraps the earlier one's
    installed dispatcher, so both run, each still falling back per call on its own; ``disable()``
    undoes patches in reverse order, so every original comes back exactly.
    """
    return any(
        record.owner is owner and record.name == name and record.installed is own and other.feature != patch.feature
        for other, record in _state.applied.items()
    )


def _apply(patch: Patch, executed: str | None = None) -> None:
    """Install ``patch`` now; its module must be imported. Records the outcome in status.

    ``executed``: a module whose code has just run to its end (its import is still finishing).
    """
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
        if own is not _MISSING and not _stacks_on(patch, owner, name, own):
            _state.status[patch] = "skipped: already patched"
            return
        if own is _MISSING:
            func = func.__wrapped__  # inherited from a patched base class: wrap the upstream original
        # else another feature's replacement is installed here: wrap it (see _stacks_on)
    problem = _signature_problem(func, patch.expects)
    if problem:
        _state.status[patch] = f"skipped: {problem}"
        _warn_once(patch.feature, f"{patch.target}: {problem}")
        return
    busy = [module for module in _helper_modules(patch) if module != executed and _initializing(module)]
    if busy:
        # The factory's (or check's) own module imports the target (e.g. a loop module importing the
        # module whose method it replaces) and is only half executed: apply once it has finished
        # (_PatchOnImport).
        _state.status[patch] = f"pending: applied when {busy[0]} has been imported"
        return
    problem = _requirement_problem(patch)
    if problem:
        _state.status[patch] = f"skipped: {problem}"
        _warn_once(patch.feature, problem)
        return
    try:
        replacement = _load_factory(patch.factory)(func)
    except Exception as exc:  # a broken factory must never break the user's program
        _state.status[patch] = f"skipped: factory failed ({type(exc).__name__}: {exc})"
        _warn_once(patch.feature, _state.status[patch])
        return
    installed: Any = _make_dispatcher(func, replacement, patch.traced)
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


def _ready(patch: Patch, imported: str) -> bool:
    """Whether ``patch`` can be applied now that module ``imported`` has been executed."""
    if patch.module == imported:
        return True
    return imported in _helper_modules(patch) and patch.module in sys.modules and not _initializing(patch.module)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Applies pending patches right after their target module is first imported (or, when the
    factory's module imported the target while being imported itself, right after the factory's)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if _state.enabled_features is None or not any(fullname in (p.module, *_helper_modules(p)) for p in _pending()):
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
                    if _ready(patch, fullname):
                        _apply(patch, executed=fullname)

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


def _feature_names(features: str | Iterable[str]) -> list[str]:
    """``"ngram"``, ``"NGram, dedup"`` or ``["ngram", " Dedup "]`` -> ``["ngram", "dedup"]``."""
    items = features.split(",") if isinstance(features, str) else list(features)
    if not all(isinstance(item, str) for item in items):
        raise TypeError(f"fastgen features are names (str), got {items!r}")
    return [name for item in items if (name := item.strip().lower())]


def _features_from_env(known: list[str]) -> list[str] | None:
    """``FASTGEN_FEATURES`` as a selection (None: unset or empty). A typo warns, never raises."""
    names = _feature_names(os.environ.get("FASTGEN_FEATURES", ""))
    if not names:
        return None
    unknown = [name for name in names if name not in known]
    if unknown:
        log.warning(
            "%sFASTGEN_FEATURES: ignoring unknown feature(s) %s; known features: %s",
            origin(),
            ", ".join(unknown),
            ", ".join(known),
        )
    return [name for name in names if name in known]


def enable(features: str | Iterable[str] | None = None) -> None:
    """Apply the declared patches (all, or only the named features).

    ``features`` is a name, a comma-separated string or a list of names (case and spaces ignored);
    ``None`` honours ``FASTGEN_FEATURES=a,b``, else enables everything but
    ``OPT_IN_FEATURES``; ``[]`` enables none
    (fastgen stays importable and ``status()`` lists every patch as not selected). An unknown name
    raises ``ValueError`` (in ``FASTGEN_FEATURES`` it only warns, so a typo never breaks an import).
    Patches of a module not imported yet are applied when it is imported. Calling again re-selects.
    """
    known = known_features()
    wanted = _feature_names(features) if features is not None else _features_from_env(known)
    unknown = [name for name in wanted or [] if name not in known]
    if unknown:
        raise ValueError(f"unknown fastgen feature(s): {', '.join(unknown)}; known features: {', '.join(known)}")
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
        for patch in reversed(list(_state.applied)):  # stacked patches (_stacks_on) unwind in order
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
def patched(features: str | Iterable[str] | None = None) -> Iterator[None]:
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
        return f"{self.feature} {self.target} {self.state}"


class StatusTable(list[PatchStatus]):
    """A list of :class:`PatchStatus` that prints as a table 80 columns wide, grouped by module."""

    WIDTH = 80

    def __str__(self) -> str:
        lines = [
            "fastgen patches ('pending': applied when its module is imported)",
            f"  {'feature':<12} {'state':<9} target",
        ]
        module = None
        for row in self:
            row_module, _, attr = row.target.partition(":")
            if row_module != module:
                module = row_module
                lines.append(module)
            word, _, why = row.state.partition(": ")
            why = "" if word == "pending" else why  # the header says when pending patches apply
            lines.append(f"  {row.feature:<12} {word:<9} {attr}")
            if why:
                lines += textwrap.wrap(why, self.WIDTH, initial_indent=" " * 6, subsequent_indent=" " * 6)
        return "\n".join(lines)


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


def _warn_once(feature: str, message: str) -> None:
    key = (feature, message)
    if key not in _state.warned:
        _state.warned.add(key)
        log.warning("%s%s", origin(feature), message)


def fallback(feature: str, reason: str) -> None:
    """A replacement handed this whole call to upstream's code; warns once per distinct reason.

    Use it only when every hook of ``feature`` steps aside for the call (so the result is
    upstream's bit for bit); a partial step-aside is :func:`degraded`.
    """
    report.note_fallback(feature, reason)
    _warn_once(feature, f"falling back to upstream: {reason}")


def degraded(feature: str, reason: str) -> None:
    """``feature`` ran, but part of the call took a slower path that gives the same result."""
    report.note_degraded(feature, reason)
    _warn_once(feature, f"slower path (same result): {reason}")

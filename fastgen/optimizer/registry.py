"""The one table of patches, and the machinery that applies and undoes them.

A patch is data (:class:`Patch`): which attribute to replace, which factory builds the
replacement, and which versions of the target package it was tested against. Patches are
applied lazily: a target whose module is not imported yet is patched the moment it is
imported (a ``sys.meta_path`` hook), so ``import fastgen`` never imports fairseq or the heavy
parts of transformers itself.

Which features run is decided per call, not by what is installed. While fastgen is enabled the
patches of *every* declared feature are installed, each wrapped in a dispatcher that asks, per call,
whether its feature is on here: in the innermost :func:`patched` / :func:`unpatched` / :func:`mode`
block of this thread or task (a ``ContextVar``), else in the mode of the model the call is on (set
with ``mode(name, model=m)``), else in the process-wide selection of :func:`enable`
(``FASTGEN_MODE`` / ``FASTGEN_FEATURES``). So a block in one thread never changes what another
thread runs, and entering one swaps no attribute. :func:`disable` puts back the exact original
objects.
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
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from fastgen._log import origin
from fastgen.optimizer import report

log = logging.getLogger("fastgen")

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
        self.enabled_features: set[str] | None = None  # None: fastgen disabled; else the process-wide selection
        self.on: frozenset[str] = frozenset()  # enabled_features as read per call (empty when disabled)
        self.installed = False  # the patches of every declared feature are installed (or pending)
        self.holders = 0  # blocks (patched()/mode()) that keep the patches installed while fastgen is disabled
        self.sticky = False  # a model's own mode keeps them installed while fastgen is disabled
        self.applied: dict[Patch, _Applied] = {}
        self.status: dict[Patch, str] = {}
        self.problems: dict[str, list[str]] = {}  # feature -> why some of its patches cannot run (warned when used)
        self.warned: set[tuple[str, str]] = set()
        #: model-specific rules anywhere (models with a mode of their own, model blocks, handles not yet
        #: entered): 0 lets every dispatcher skip looking at its call's arguments
        self.model_rules = 0
        self.model_modes: dict[int, tuple[Any, frozenset[str], str]] = {}  # id(model) -> (weakref, features, name)
        self.pending: dict[int, _Pending] = {}  # id(handle) -> mode(..., model=) handles not entered yet
        self.model_rules_in_blocks = 0  # `with mode(..., model=)` blocks running, in every thread


_state = _State()


@dataclasses.dataclass(frozen=True, eq=False)
class _Layer:
    """One block's choice of features: for every call in the block, or (``model``) for calls on one model."""

    features: frozenset[str]
    name: str  # the mode's name, or "custom"
    model: Any = None
    parent: _Layer | None = None


#: the innermost block of this thread or task (None: the model's own mode, else the process-wide selection)
_scope: contextvars.ContextVar[_Layer | None] = contextvars.ContextVar("fastgen_scope", default=None)


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
    original: Callable[..., Any], replacement: Callable[..., Any], traced: bool = False, feature: str = ""
) -> Callable[..., Any]:
    if traced:  # see Patch.traced: the replacement itself, marked as patched
        installed = functools.wraps(original)(replacement)
        installed.__fastgen_patched__ = True  # type: ignore[attr-defined]
        return installed
    # The body reads closure variables only, never this module's globals (see below); their names
    # are unlikely to shadow a global of the upstream module for TorchScript.
    _fastgen_features_for, _fastgen_scope, _fastgen_feature = _features_for, _scope, feature
    _fastgen_state, _fastgen_original, _fastgen_replacement = _state, original, replacement

    def dispatcher(*args: Any, **kwargs: Any) -> Any:
        # Decided here, per call, outside any traced forward: which features are on for this call.
        if not _fastgen_state.model_rules:  # _features_for's common case, inline (one ContextVar read)
            layer = _fastgen_scope.get()
            if _fastgen_feature in (_fastgen_state.on if layer is None else layer.features):
                return _fastgen_replacement(*args, **kwargs)
            return _fastgen_original(*args, **kwargs)
        features, carry = _fastgen_features_for(args)
        if carry is None:
            if _fastgen_feature in features:
                return _fastgen_replacement(*args, **kwargs)
            return _fastgen_original(*args, **kwargs)
        # The call is on a model with a mode of its own: the hooks it reaches (which do not see the model)
        # run in that mode too, for this call only.
        token = _fastgen_scope.set(carry)
        try:
            if _fastgen_feature in features:
                return _fastgen_replacement(*args, **kwargs)
            return _fastgen_original(*args, **kwargs)
        finally:
            _fastgen_scope.reset(token)

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
        _problem(patch.feature, _state.status[patch])
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
        _problem(patch.feature, f"{patch.target}: {problem}")
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
        _problem(patch.feature, problem)
        return
    try:
        replacement = _load_factory(patch.factory)(func)
    except ImportError as exc:
        if exc.name and _initializing(exc.name):
            # The factory imports a module that is half executed (it imported the target, whose import hook
            # runs this): apply once that module has finished (_PatchOnImport, _ready).
            _state.status[patch] = _waiting_on(exc.name)
            return
        _state.status[patch] = f"skipped: factory failed ({type(exc).__name__}: {exc})"
        _problem(patch.feature, _state.status[patch])
        return
    except Exception as exc:  # a broken factory must never break the user's program
        _state.status[patch] = f"skipped: factory failed ({type(exc).__name__}: {exc})"
        _problem(patch.feature, _state.status[patch])
        return
    installed: Any = _make_dispatcher(func, replacement, patch.traced, patch.feature)
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
    waits_for = imported in _helper_modules(patch) or _state.status.get(patch) == _waiting_on(imported)
    return waits_for and patch.module in sys.modules and not _initializing(patch.module)


def _waiting_on(module: str) -> str:
    return f"pending: applied when {module} has been imported"


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Applies pending patches right after their target module is first imported (or, when the
    factory's module imported the target while being imported itself, right after the factory's)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not _state.installed or not any(fullname in (p.module, *_helper_modules(p)) for p in _pending()):
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


def _pending() -> list[Patch]:
    """Patches waiting for their module to be imported."""
    if not _state.installed:
        return []
    return [p for p in declared_patches() if _state.status.get(p, "").startswith("pending")]


# ---------------------------------------------------------------------------- features and modes

#: The modes, one word each for a set of features: ``exact`` is every feature but the opt-in ones (tokens
#: equal upstream's), ``fast`` adds ``fast_gemm`` (fp32 linears on oneDNN, not bit-identical) and ``int8``
#: adds ``int8`` (int8 linears). The value is what a mode adds to the default features.
MODES: dict[str, frozenset[str]] = {
    "exact": frozenset(),
    "fast": frozenset({"fast_gemm"}),
    "int8": frozenset({"int8"}),
}


def default_features() -> frozenset[str]:
    """The features of mode ``exact``: every declared feature but :data:`OPT_IN_FEATURES`."""
    return frozenset(known_features()) - OPT_IN_FEATURES


def _mode_key(name: Any) -> str:
    key = name.strip().lower() if isinstance(name, str) else None
    if key not in MODES:
        raise ValueError(f"unknown fastgen mode {name!r}; modes: {', '.join(MODES)}")
    return key


def mode_features(name: str) -> frozenset[str]:
    """The features of mode ``name`` (``exact``, ``fast`` or ``int8``; case and spaces ignored)."""
    return default_features() | MODES[_mode_key(name)]


def mode_name(features: Iterable[str]) -> str:
    """The mode whose features these are (``exact``, ``fast``, ``int8``), ``off`` for none, else ``custom``."""
    chosen = frozenset(features)
    if not chosen:
        return "off"
    return next((name for name in MODES if chosen == mode_features(name)), "custom")


def _feature_names(features: str | Iterable[str]) -> list[str]:
    """``"ngram"``, ``"NGram, dedup"`` or ``["ngram", " Dedup "]`` -> ``["ngram", "dedup"]``.

    A change keeps its sign: ``"+ Int8"`` -> ``"+int8"``."""
    items = features.split(",") if isinstance(features, str) else list(features)
    if not all(isinstance(item, str) for item in items):
        raise TypeError(f"fastgen features are names (str), got {items!r}")
    names = [name for item in items if (name := item.strip().lower())]
    return [name[0] + name[1:].strip() if name[0] in "+-" else name for name in names]


def _choose(names: list[str], base: frozenset[str] | None, known: list[str]) -> frozenset[str]:
    """The features that ``names`` select: a list of names on its own, or ``+name`` / ``-name`` changes to
    ``base`` (a mode's features; the defaults when None). Raises ``ValueError`` naming what is wrong."""
    signed = [name for name in names if name[0] in "+-"]
    stems = [name.lstrip("+-") for name in names]
    unknown = [stem for stem in stems if stem not in known]
    if unknown:
        modes = [stem for stem in unknown if stem in MODES]
        hint = f" ({', '.join(modes)}: a mode, selected with mode={modes[0]!r})" if modes else ""
        raise ValueError(f"unknown fastgen feature(s): {', '.join(unknown)}; known features: {', '.join(known)}{hint}")
    if signed and len(signed) != len(names):
        raise ValueError(
            f"fastgen features {', '.join(names)}: either a list of names or +name/-name changes to the "
            "defaults, not both"
        )
    if signed:
        chosen = set(default_features() if base is None else base)
        for name in signed:
            (chosen.add if name[0] == "+" else chosen.discard)(name[1:])
        return frozenset(chosen)
    if base is not None:
        if names:
            raise ValueError(
                f"fastgen: mode= or a list of features ({', '.join(names)}), not both; "
                "+name/-name change a mode's features"
            )
        return base
    return frozenset(stems)


def _alone_hint(chosen: frozenset[str], spelled: str, environment: bool) -> None:
    """The old spelling of an opt-in mode (``enable("int8")``, ``FASTGEN_FEATURES=int8``) selects it *alone*,
    switching every default feature off: kept, since it is what it always meant, but said once."""
    if not chosen or not chosen <= OPT_IN_FEATURES:
        return
    names = ", ".join(sorted(chosen))
    plus = ",".join(f"+{name}" for name in sorted(chosen))
    mode = next((name for name, extra in MODES.items() if extra == chosen), None)
    if environment:
        ways = [f"FASTGEN_MODE={mode}"] if mode else []
        ways.append(f"FASTGEN_FEATURES={plus}")
    else:
        ways = [f"fastgen.enable(mode={mode!r})"] if mode else []
        ways.append(f"fastgen.enable({plus!r})")
    off = ", ".join(f for f in known_features() if f in default_features())
    _warn_once(
        names,
        f"{spelled} selects {names} alone: the default features ({off}) are off. "
        f"For {names} on top of them: {' or '.join(ways)}",
    )


def _from_environment(known: list[str]) -> frozenset[str]:
    """``FASTGEN_MODE`` and ``FASTGEN_FEATURES`` as a selection. A name fastgen does not know warns once,
    naming the known ones, and leaves the defaults (or ``FASTGEN_MODE``'s features) on: a typo must
    neither break an import nor switch fastgen off."""
    base = default_features()
    mode_text = os.environ.get("FASTGEN_MODE", "").strip()
    if mode_text:
        try:
            base = mode_features(mode_text)
        except ValueError:
            _warn_once(
                "",
                f"FASTGEN_MODE={mode_text} is not a mode (modes: {', '.join(MODES)}); "
                "running mode exact (the default features)",
            )
            mode_text = ""
    raw = os.environ.get("FASTGEN_FEATURES", "")
    names = _feature_names(raw)
    if not names:
        return base
    signed = any(name[0] in "+-" for name in names)
    try:
        chosen = _choose(names, base if signed else None, known)
    except ValueError as exc:
        message = str(exc).removeprefix("fastgen features ").removeprefix("fastgen: ")
        _warn_once(
            "",
            f"FASTGEN_FEATURES={raw.strip()}: {message}. FASTGEN_FEATURES is ignored: running mode "
            f"{mode_name(base)} ({', '.join(f for f in known if f in base)})",
        )
        return base
    if not signed:
        if mode_text:
            _warn_once("", f"FASTGEN_FEATURES lists the features itself: FASTGEN_MODE={mode_text} is not used")
        _alone_hint(chosen, f"FASTGEN_FEATURES={raw.strip()}", environment=True)
    return chosen


# ---------------------------------------------------------------------------- which features run here


def _call_objects(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The objects a call is on: its receiver (``args[0]``) and the models it is handed as a list (fairseq's
    ``SequenceGenerator.generate(models, sample)``; a list, tuple or torch ``ModuleList``)."""
    if not args:
        return ()
    if len(args) > 1 and (isinstance(args[1], list | tuple) or type(args[1]).__name__ == "ModuleList"):
        return (args[0], *args[1])
    return (args[0],)


def _features_for(args: tuple[Any, ...] = ()) -> tuple[frozenset[str], _Layer | None]:
    """The features on for a call with positional ``args`` in this thread/task, and, when they come from a
    model's own mode, the block the call must run in so that the hooks it reaches (which do not see the
    model) use them too. The innermost block wins, then the model's own mode, then :func:`enable`'s choice.
    Read by every dispatcher: without model-specific rules anywhere it is one ``ContextVar`` read."""
    layer = _scope.get()
    if not _state.model_rules:
        return (_state.on if layer is None else layer.features), None
    if _state.pending:
        _commit_pending(threading.get_ident())
    objects = _call_objects(args)
    innermost = layer
    while layer is not None:
        if layer.model is None:
            return layer.features, None
        if any(target is obj for target in layer.model for obj in objects):
            return layer.features, _Layer(layer.features, layer.name, None, innermost)
        layer = layer.parent
    for obj in objects:
        entry = _state.model_modes.get(id(obj))
        if entry is not None and entry[0]() is obj:
            return entry[1], _Layer(entry[1], entry[2], None, innermost)
    return _state.on, None


def feature_enabled(feature: str) -> bool:
    """True while ``feature`` is on for calls made here (this thread/task's block, else the process-wide
    selection): cheap enough to ask per call, outside a model's forward (it reads a ``ContextVar``)."""
    return feature in _features_for()[0]


feature_on = feature_enabled


def active() -> bool:
    """True when some fastgen feature is on here: False inside :func:`unpatched` or with fastgen disabled."""
    return bool(_features_for()[0])


def current_mode(model: Any = None) -> str:
    """The mode calls made here run in (on ``model``, when given): ``exact``, ``fast``, ``int8``, ``off`` (no
    feature: :func:`unpatched`, or fastgen disabled) or ``custom`` (a selection of features that is no mode)."""
    with _lock:
        return mode_name(_features_for(() if model is None else (model,))[0])


# ---------------------------------------------------------------------------- installing


def _problem(feature: str, message: str) -> None:
    """Why some of ``feature``'s patches cannot run: warned now if the feature is on (here or process-wide),
    else when a block first asks for it (an unused opt-in feature stays silent)."""
    known = _state.problems.setdefault(feature, [])
    if message not in known:
        known.append(message)
    if feature in _state.on or feature in _features_for()[0]:
        _warn_once(feature, message)


def _warn_problems(features: Iterable[str]) -> None:
    for feature in features:
        for message in _state.problems.get(feature, ()):
            _warn_once(feature, message)


def _install() -> None:
    """Install the patches of every declared feature (pending where the module is not imported yet)."""
    _state.installed = True
    for patch in declared_patches():
        if patch in _state.applied:
            continue
        problem = version_problem(patch)
        if problem:
            _state.status[patch] = f"skipped: {problem}"
            if installed_version(patch.package) is not None:
                _problem(patch.feature, problem)
        elif patch.module in sys.modules:
            _apply(patch)
        else:
            _state.status[patch] = f"pending: applied when {patch.module} is imported"
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def _uninstall() -> None:
    for patch in reversed(list(_state.applied)):  # stacked patches (_stacks_on) unwind in order
        _restore(patch)
    _state.installed = False
    _state.status.clear()
    _state.problems.clear()
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


def _hold() -> None:
    """A block starts: the patches stay installed until it ends, even if fastgen is disabled meanwhile."""
    with _lock:
        _state.holders += 1
        if not _state.installed:
            _install()


def _release() -> None:
    with _lock:
        _state.holders -= 1
        if _state.installed and not (_state.holders or _state.sticky or _state.enabled_features is not None):
            _uninstall()


# ---------------------------------------------------------------------------- public API


def enable(features: str | Iterable[str] | None = None, *, mode: str | None = None) -> None:
    """Switch fastgen on for the whole process, in a mode or with a selection of features.

    ``mode``: ``"exact"`` (the default: every feature but the opt-in ones; tokens equal upstream's),
    ``"fast"`` (adds ``fast_gemm``) or ``"int8"`` (adds ``int8``); see :data:`MODES`.

    ``features``: a name, a comma-separated string or a list of names (case and spaces ignored), either
    the full selection (``enable(["ngram", "dedup"])``, ``[]`` for none: fastgen stays importable and
    :func:`status` lists every patch as not selected), or changes to the defaults, or to ``mode``'s
    features: ``enable("+int8")``, ``enable("-speculative", mode="int8")``. A lone opt-in name,
    ``enable("int8")``, keeps its old meaning (int8 *alone*, every default feature off) and says so once.

    With neither, ``FASTGEN_MODE`` and ``FASTGEN_FEATURES`` (same syntax) decide, else mode ``exact``; a
    name fastgen does not know there only warns (an import never breaks), but here it raises
    ``ValueError``. Patches of a module not imported yet are applied when it is imported. Calling again
    re-selects (and re-installs every patch: a call of another thread running meanwhile may see upstream's
    code for part of it; to change the mode of some calls, use :func:`mode` instead). Blocks
    (:func:`mode`, :func:`patched`, :func:`unpatched`) and models' own modes take precedence here.

    Args:
        features: the selection (``"ngram,dedup"``, ``["ngram"]``, ``[]``) or changes (``"+int8"``,
            ``"-speculative"``); None: the mode's features.
        mode: ``"exact"``, ``"fast"`` or ``"int8"``; None: ``exact`` (or the environment, with no features).

    Raises:
        ValueError: an unknown feature or mode name.

    Example:
        ```python
        import fastgen

        fastgen.enable(mode="int8")  # every later call in the process, unless a block says otherwise
        ```
    """
    known = known_features()
    if features is None and mode is None:
        chosen = _from_environment(known)
    else:
        base = mode_features(mode) if mode is not None else None
        names = _feature_names(features) if features is not None else []
        chosen = _choose(names, base, known)
        if names and not any(name[0] in "+-" for name in names):
            _alone_hint(chosen, f"fastgen.enable({','.join(names)!r})", environment=False)
    with _lock:
        if _state.installed:
            _uninstall()
        _state.enabled_features = set(chosen)
        _state.on = frozenset(chosen)
        _install()


def disable() -> None:
    """Switch fastgen off for the process: every patch is undone, the exact original objects restored, and
    modules imported later are left alone. A block of another thread still running keeps the patches
    installed until it ends (they run upstream's code for every call outside such a block)."""
    with _lock:
        _state.enabled_features = None
        _state.on = frozenset()
        _state.sticky = False
        if not _state.holders:
            _uninstall()


def is_enabled() -> bool:
    """Whether fastgen is switched on for the process (:func:`enable`, or ``import fastgen``)."""
    return _state.enabled_features is not None


@contextlib.contextmanager
def _block(features: frozenset[str], name: str) -> Iterator[None]:
    _hold()
    try:
        with _lock:
            _warn_problems(features)
        token = _scope.set(_Layer(features, name, None, _scope.get()))
        try:
            yield
        finally:
            _scope.reset(token)
    finally:
        _release()


@contextlib.contextmanager
def unpatched() -> Iterator[None]:
    """Run upstream code inside the block (this thread/task only); patches stay installed.

    The tests' oracle: upstream's result on the same model and inputs, for comparison.

    Example:
        ```python
        with fastgen.unpatched():
            reference = model.generate(**inputs, num_beams=4)
        ```
    """
    token = _scope.set(_Layer(frozenset(), "off", None, _scope.get()))
    try:
        yield
    finally:
        _scope.reset(token)


def patched(
    features: str | Iterable[str] | None = None, *, mode: str | None = None
) -> contextlib.AbstractContextManager[None]:
    """Run fastgen inside the block, this thread/task only: with ``features`` / ``mode`` as :func:`enable`
    takes them, or, with neither, what ``import fastgen`` selects (``FASTGEN_MODE`` / ``FASTGEN_FEATURES``,
    else mode ``exact``). Other threads, and this one after the block, run as before; it works with
    fastgen disabled too (the patches are installed for the block).

    Args:
        features: as :func:`enable`'s ``features``.
        mode: as :func:`enable`'s ``mode``.

    Raises:
        ValueError: an unknown feature or mode name.

    Example:
        ```python
        with fastgen.patched(["dedup", "ngram"]):
            out = model.generate(**inputs, num_beams=4, no_repeat_ngram_size=3)
        ```
    """
    known = known_features()
    if features is None and mode is None:
        chosen = _from_environment(known)
    else:
        chosen = _choose(
            _feature_names(features) if features is not None else [],
            mode_features(mode) if mode is not None else None,
            known,
        )
    return _block(chosen, mode_name(chosen))


@dataclasses.dataclass
class _Pending:
    """A ``mode(name, model=m)`` handle not entered yet: it becomes the models' mode when it is dropped
    without being entered (a plain call), or when its thread next asks which features run."""

    thread: int
    targets: tuple[Any, ...]
    features: frozenset[str] | None
    name: str | None


def _targets(model: Any) -> tuple[Any, ...]:
    """``model`` and the models it holds as ``.models`` (a fairseq hub interface or ensemble), so that a
    mode set on it reaches the calls that receive those."""
    held = getattr(model, "models", None)
    inner = tuple(held) if isinstance(held, list | tuple) or type(held).__name__ == "ModuleList" else ()
    targets = (model, *inner)
    for target in targets:
        try:
            weakref.ref(target)
        except TypeError:
            raise TypeError(f"fastgen.mode(model=...): a {type(target).__name__} cannot carry a mode") from None
    return targets


def _recount() -> None:
    _state.model_rules = len(_state.model_modes) + len(_state.pending) + _state.model_rules_in_blocks


def _commit(pending: _Pending) -> None:
    """``pending`` becomes its models' own mode (under ``_lock``)."""
    for target in pending.targets:
        key = id(target)
        if pending.features is None:
            _state.model_modes.pop(key, None)
            continue

        def forget(ref: Any, key: int = key) -> None:
            with _lock:
                entry = _state.model_modes.get(key)
                if entry is not None and entry[0] is ref:
                    del _state.model_modes[key]
                    _recount()

        _state.model_modes[key] = (weakref.ref(target, forget), pending.features, pending.name or "custom")
    _recount()


def _commit_pending(thread: int) -> None:
    with _lock:
        for key, pending in list(_state.pending.items()):
            if pending.thread == thread and _state.pending.pop(key, None) is not None:
                _commit(pending)


class ModeScope:
    """What :func:`mode` returns: a context manager; with ``model=`` not entered, that model's mode."""

    def __init__(self, name: str | None, model: Any = None) -> None:
        if name is None and model is None:
            raise TypeError("fastgen.mode(None) needs model=: it clears that model's own mode")
        self.name = None if name is None else _mode_key(name)
        self.features = None if self.name is None else mode_features(self.name)
        self.model = model
        self._tokens: list[contextvars.Token[_Layer | None]] = []
        self._entered = False
        if model is None:
            return
        targets = _targets(model)
        with _lock:
            if self.features is not None and not _state.installed:
                _install()  # a model's own mode works with fastgen disabled, as a block does
                _state.sticky = True
            _state.pending[id(self)] = _Pending(threading.get_ident(), targets, self.features, self.name)
            _recount()
        self._targets = targets

    def __enter__(self) -> ModeScope:
        if self.features is None:
            raise TypeError("fastgen.mode(None, model=m) clears m's own mode: call it, don't enter it")
        with _lock:
            if self.model is not None and not self._entered and _state.pending.pop(id(self), None) is None:
                raise RuntimeError(
                    f"fastgen.mode({self.name!r}, model=...) already became the model's own mode (its thread "
                    "ran fastgen since); to confine a mode to a block, enter it where it is made: "
                    f"with fastgen.mode({self.name!r}, model=m): ..."
                )
            self._entered = True
            if self.model is not None:
                _state.model_rules_in_blocks += 1
                _recount()
        _hold()
        with _lock:
            _warn_problems(self.features)
        model = self._targets if self.model is not None else None
        self._tokens.append(_scope.set(_Layer(self.features, self.name or "custom", model, _scope.get())))
        return self

    def __exit__(self, *exc: object) -> None:
        _scope.reset(self._tokens.pop())
        if self.model is not None:
            with _lock:
                _state.model_rules_in_blocks -= 1
                _recount()
        _release()

    def __del__(self) -> None:
        try:
            if self.model is not None:
                with _lock:
                    pending = _state.pending.pop(id(self), None)
                    if pending is not None:
                        _commit(pending)
            elif not self._entered:
                log.warning(
                    "%sfastgen.mode(%r) was never entered, so it changed nothing: `with fastgen.mode(%r): ...` "
                    "runs a block of this thread in it, fastgen.enable(mode=%r) the whole process",
                    origin(),
                    self.name,
                    self.name,
                    self.name,
                )
        except Exception:  # interpreter shutdown: nothing left to set
            pass

    def __repr__(self) -> str:
        where = "" if self.model is None else f", model={type(self.model).__name__}"
        return f"fastgen.mode({self.name!r}{where})"


def mode(name: str | None, *, model: Any = None) -> ModeScope:
    """Run calls in mode ``name`` (``"exact"``, ``"fast"`` or ``"int8"``, see :data:`MODES`): for one block of
    this thread/task, or, with ``model=``, for one model.

    ``with fastgen.mode("int8"): ...`` runs every call in the block in int8, in this thread or asyncio task
    only (other threads keep their mode, even on the same model).

    ``model=m``, two uses:

    * ``fastgen.mode("int8", model=m)`` as a statement sets ``m``'s own mode: every later call on ``m``
      (``m.generate``, ``fastgen.generate_many(m, ...)``, a fairseq ``SequenceGenerator`` handed ``m``), from
      any thread, runs in int8 until changed; ``fastgen.mode(None, model=m)`` clears it. Calls on other
      models keep the process-wide mode.
    * ``with fastgen.mode("int8", model=m): ...`` runs only this thread's calls on ``m`` in int8, for the block
      (``m``'s own mode, if any, is left as it was).

    A block is stronger than a model's own mode, which is stronger than :func:`enable`'s (``FASTGEN_MODE``);
    the innermost block wins (``with fastgen.unpatched():`` runs upstream even on a model with a mode). A
    call's mode holds for the whole call, the models it calls included (an assistant model's drafts). Blocks
    and models' modes work with fastgen disabled as well.

    Args:
        name: ``"exact"``, ``"fast"`` or ``"int8"``; with ``model=`` as a statement, None clears the model's mode.
        model: the model whose calls the mode is for (any ``torch.nn.Module`` fastgen serves).

    Returns:
        A context manager (also effective at once as a statement when ``model`` is given).

    Raises:
        ValueError: an unknown mode name.

    Example:
        ```python
        with fastgen.mode("int8"):
            out = model.generate(**inputs, num_beams=4)
        ```
    """
    return ModeScope(name, model)


class _Frozen:
    """A block that re-enters one fixed choice of features (reusable, e.g. around each step of a lazy result)."""

    def __init__(self, layer: _Layer) -> None:
        self.layer = layer
        self._tokens: list[contextvars.Token[_Layer | None]] = []

    def __enter__(self) -> None:
        self._tokens.append(_scope.set(self.layer))

    def __exit__(self, *exc: object) -> None:
        _scope.reset(self._tokens.pop())


def call_scope(model: Any) -> contextlib.AbstractContextManager[None]:
    """The features in force here for a call on ``model``, decided now, as a block to run the call's parts in
    (for fastgen's own loops, whose hooks do not see the model: see :func:`each_in`)."""
    features = _features_for((model,))[0]
    return _Frozen(_Layer(features, mode_name(features)))


def each_in(scope: contextlib.AbstractContextManager[None], results: Iterable[Any]) -> Iterator[Any]:
    """``results``, each item computed inside ``scope``: a lazy result runs in the mode of its call, wherever
    and whenever it is read (and nothing stays switched on between two items)."""
    iterator = iter(results)
    while True:
        with scope:
            try:
                item = next(iterator)
            except StopIteration:
                return
        yield item


# ---------------------------------------------------------------------------- status


@dataclasses.dataclass(frozen=True)
class PatchStatus:
    feature: str
    target: str
    state: str

    def __str__(self) -> str:
        return f"{self.feature} {self.target} {self.state}"


class StatusTable(list[PatchStatus]):
    """A list of :class:`PatchStatus` that prints as a table 80 columns wide, grouped by module; ``mode`` and
    ``features`` are those of the calls made where it was taken (``source`` says what set them)."""

    WIDTH = 80
    mode: str = "off"
    features: tuple[str, ...] = ()
    source: str = ""
    models_with_a_mode: int = 0

    def __str__(self) -> str:
        lines = textwrap.wrap(f"fastgen mode: {self.mode} ({self.source})", self.WIDTH, subsequent_indent="  ")
        features = f"features on: {', '.join(self.features) or 'none'}"
        lines += textwrap.wrap(features, self.WIDTH, initial_indent="  ", subsequent_indent="    ")
        if self.models_with_a_mode:
            lines.append(f"  {self.models_with_a_mode} model(s) with a mode of their own (fastgen.mode(..., model=))")
        lines += [
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
    """Every declared patch with its state for calls made here (this thread/task, in its block if any):
    applied, pending (module not imported), skipped (why), disabled (feature not on here, or fastgen off);
    and the mode those calls run in."""
    with _lock:
        here = _features_for()[0]
        layer = _scope.get()
        off = not _state.installed or (_state.enabled_features is None and layer is None)
        rows = StatusTable()
        rows.mode = mode_name(here)
        rows.features = tuple(f for f in known_features() if f in here)
        if layer is not None:
            rows.source = "a fastgen.mode() / patched() / unpatched() block"
        elif _state.enabled_features is None:
            rows.source = "fastgen disabled: fastgen.disable() or FASTGEN_DISABLE=1"
        else:
            rows.source = "process-wide: fastgen.enable() or FASTGEN_MODE"
        rows.models_with_a_mode = len({entry[0] for entry in _state.model_modes.values()})
        for patch in declared_patches():
            if off:
                state = "disabled: fastgen.disable() or FASTGEN_DISABLE=1"
            elif patch.feature not in here:
                state = "disabled: feature not selected"
            elif patch in _state.status:
                state = _state.status[patch]
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

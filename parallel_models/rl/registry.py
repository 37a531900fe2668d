"""Registries by name for what users extend in the RL stack, and the loading of a user's own
function from a Python file. One class serves them all:

* advantage estimators (``algorithm.adv_estimator``): ``rl/algorithms/estimators.py``;
* policy losses (``actor.policy_loss``): ``rl/algorithms/losses.py``;
* KL estimators (``algorithm.kl_penalty``, ``actor.kl_loss_type``): ``rl/algorithms/core.py``;
* rule reward functions (``reward.function``): ``rl/rewards/rules.py``;
* rollout backends (``rollout.backend``): ``rl/rollout/registry.py``;
* training backends (``parallel.backend``): ``rl/backends/registry.py``.

A built-in function registers itself with a decorator, with the attributes the caller reads::

    @ADVANTAGE_ESTIMATORS.register("gae", needs_critic=True)
    def gae(token_level_rewards, response_mask, values, group_index, config): ...

Other entries are added directly, as an object or as a lazy reference (``"package.module"``,
``"package.module:name"``) imported on first use, so that listing and checking names imports
nothing heavy::

    TRAINING_BACKENDS.add("mine", "my_package.my_backend")

A config value of a function registry is either a registered name or
``path/to/file.py:function`` (also ``package.module:function``): :meth:`Registry.get` resolves
both. A user's file is loaded once per process (the config check loads it in every rank; later
look-ups reuse it), its function is checked against the call signature of the registry, and every
problem (no such file, the file raises, no such function, a signature that does not take the
arguments) is a :class:`~parallel_models.errors.ConfigError` saying what is wrong. The attributes a
built-in gets at registration (``needs_critic``, ...) a user's function sets itself
(``fn.needs_critic = True``); :meth:`Registry.attribute` reads them with the registry's defaults.
Backend registries (``user_functions=False``) take registered names only.

This module imports nothing heavy (no torch), so config code can import it.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from typing import Any, Callable

from parallel_models.errors import ConfigError

_LOADED: dict[tuple[str, str], Callable] = {}  # (absolute file or module, function) -> function


def is_user_spec(spec: str) -> bool:
    """Whether ``spec`` names a user's function (``file.py:fn`` / ``module:fn``), not a
    registered name."""
    return ":" in spec


class Registry:
    """Entries of one kind by name. ``kind`` names them in messages ("advantage estimator");
    ``params`` are the keyword arguments every function of the kind is called with (None: no
    check); ``defaults`` are the registration attributes and their values for functions that
    do not set them; ``key`` is the config key whose values name entries (messages start with
    ``key=value``); ``home`` is where the registry lives (messages say how to add an entry);
    ``user_functions``: whether ``file.py:function`` specs are accepted besides names."""

    def __init__(self, kind: str, params: tuple[str, ...] | None = None,
                 defaults: dict[str, Any] | None = None, *, key: str | None = None,
                 home: str | None = None, user_functions: bool = True):
        self.kind = kind
        self.params = params
        self.defaults = dict(defaults or {})
        self.key, self.home, self.user_functions = key, home, user_functions
        self._entries: dict[str, Any] = {}
        self._checked: dict[str, Callable] = {}  # users' functions, loaded and checked

    def register(self, name: str, *aliases: str, **attributes: Any) -> Callable:
        """Decorator: register the function under ``name`` (and ``aliases``), setting
        ``attributes`` (only those of ``defaults``) on it."""
        unknown = sorted(set(attributes) - set(self.defaults))
        if unknown:
            raise TypeError(f"{self.kind} registration: unknown attributes {unknown}; known: "
                            f"{sorted(self.defaults)}")

        def decorate(fn: Callable) -> Callable:
            for key, value in attributes.items():
                setattr(fn, key, value)
            for n in (name, *aliases):
                if n in self._entries and self._entries[n] is not fn:
                    raise ValueError(f"{self.kind} {n!r} is already registered")
                self._entries[n] = fn
            return fn

        return decorate

    def add(self, name: str, entry: Any) -> Any:
        """Add ``entry`` (an object, or a lazy ``"module"`` / ``"module:attr"`` reference) under
        ``name``, replacing an earlier entry of that name. Returns ``entry``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} needs a non-empty name, got {name!r}")
        self._entries[name] = entry
        return entry

    def names(self) -> list[str]:
        return sorted(self._entries)

    def problem(self, name: str) -> str | None:
        """Why ``name`` is not a valid value (None when it is registered, or is a user's
        function spec where those are accepted: :meth:`get` checks the file)."""
        if name in self._entries or (self.user_functions and isinstance(name, str)
                                     and is_user_spec(name)):
            return None
        return self.unknown_message(str(name))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def get(self, spec: str) -> Callable:
        """The function ``spec`` names: a registered name or ``file.py:function``; raise
        :class:`ConfigError` (did-you-mean, the registered names) when there is none."""
        if not isinstance(spec, str) or not spec.strip():
            raise ConfigError(f"{self.kind} {spec!r}: expected a name ({', '.join(self.names())})"
                              " or path/to/file.py:function")
        spec = spec.strip()
        if spec in self._entries:
            entry = self._entries[spec]
            if isinstance(entry, str):  # a lazy reference: import it now, once
                entry = self._entries[spec] = _resolve(entry)
            return entry
        if spec in self._checked:
            return self._checked[spec]
        if not (self.user_functions and is_user_spec(spec)):
            where = f"{self.key}={spec!r}: " if self.key else ""
            raise ConfigError(where + self.unknown_message(spec))
        fn = load_function(spec, self.kind)
        if self.params is not None:
            check_signature(fn, self.params, spec, self.kind)
        self._checked[spec] = fn
        return fn

    def attribute(self, fn: Callable, name: str) -> Any:
        """A registration attribute of ``fn`` (the registry's default when it sets none)."""
        return getattr(fn, name, self.defaults[name])

    def unknown_message(self, name: str) -> str:
        close = difflib.get_close_matches(name, self.names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        own = ("or your own as path/to/file.py:function" if self.user_functions else
               f"add your own with {self.home or 'this registry'}.add(name, entry)")
        return (f"unknown {self.kind} {name!r}{hint}; registered: {', '.join(self.names())}; "
                f"{own}")


def _resolve(reference: str) -> Any:
    """``"package.module"`` -> the module, ``"package.module:name"`` -> that attribute."""
    module, _, attr = reference.partition(":")
    value = importlib.import_module(module)
    return getattr(value, attr) if attr else value


def check_signature(fn: Callable, params: tuple[str, ...], spec: str, kind: str) -> None:
    """Raise :class:`ConfigError` unless ``fn`` can be called with ``params`` as keywords."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins / C callables: nothing to check
        return
    try:
        signature.bind(**dict.fromkeys(params))
    except TypeError as err:
        raise ConfigError(f"{kind} {spec!r}: {getattr(fn, '__name__', fn)}{signature} cannot be "
                          f"called as a {kind}: {err}; a {kind} is called with the keyword "
                          f"arguments ({', '.join(params)})") from err


def load_function(spec: str, kind: str) -> Callable:
    """Resolve ``"file.py:function"``, ``"package.module:function"`` or
    ``"package.module.function"`` to a callable, importing a file once per process; raise
    :class:`ConfigError` (starting with ``kind`` and ``spec``) saying what is wrong."""
    if ":" in spec:
        module_name, attr = spec.rsplit(":", 1)
    elif "." in spec:
        module_name, attr = spec.rsplit(".", 1)
    else:
        raise ConfigError(f"{kind} {spec!r}: expected a dotted path like "
                          "'package.module.function' (module and function name)")
    if not module_name or not attr:
        raise ConfigError(f"{kind} {spec!r}: empty module or function name")
    is_file = module_name.endswith(".py")
    key = (os.path.abspath(os.path.expanduser(module_name)) if is_file else module_name, attr)
    if key in _LOADED:
        return _LOADED[key]
    module = _load_file(module_name, spec, kind) if is_file else _import(module_name, spec, kind)
    if not hasattr(module, attr):
        public = sorted(n for n in dir(module) if not n.startswith("_")
                        and callable(getattr(module, n, None))
                        and getattr(getattr(module, n), "__module__", None) == module.__name__)
        raise ConfigError(f"{kind} {spec!r}: module {module_name!r} has no attribute "
                          f"{attr!r}; functions defined there: {', '.join(public) or '(none)'}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise ConfigError(f"{kind} {spec!r}: {attr!r} in {module_name!r} is not callable (it "
                          f"is a {type(fn).__name__})")
    _LOADED[key] = fn
    return fn


def _import(module_name: str, spec: str, kind: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise ConfigError(f"{kind} {spec!r}: module {module_name!r} not found (no module "
                              f"named {err.name!r}; is it installed or on PYTHONPATH?)") from err
        raise ConfigError(f"{kind} {spec!r}: importing module {module_name!r} failed: "
                          f"{type(err).__name__}: {err}") from err
    except Exception as err:  # noqa: BLE001 - anything the module raises while importing
        raise ConfigError(f"{kind} {spec!r}: importing module {module_name!r} failed: "
                          f"{type(err).__name__}: {err}") from err


def _load_file(file: str, spec: str, kind: str):
    file = os.path.abspath(os.path.expanduser(file))
    if not os.path.isfile(file):
        raise ConfigError(f"{kind} {spec!r}: file {file!r} not found")
    # one module per file (two user files may share a base name)
    digest = hashlib.sha1(file.encode()).hexdigest()[:8]
    name = f"_user_{os.path.splitext(os.path.basename(file))[0]}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001
        sys.modules.pop(name, None)
        raise ConfigError(f"{kind} {spec!r}: running {file!r} failed: "
                          f"{type(err).__name__}: {err}") from err
    return module


__all__ = ["Registry", "is_user_spec", "load_function", "check_signature"]

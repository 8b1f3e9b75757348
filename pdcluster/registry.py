"""One lookup mechanism for every pluggable part: `Registry[T]`.

Connectors, model architectures, routing policies, store backends and kernel op sets are each a
`Registry`. A name resolves, in this order:

    "pkg.module:attr"     a dotted path (from an operator's config, never from request data)
    "p2p"                 a built-in registered with `register()` (a lazy "module:attr" string
                          or the object itself; lazy strings keep torch out of light imports)
    "mine"                an entry point named "mine" in the registry's entry-point group
                          (a plugin's pyproject: [project.entry-points."<group>"])

An unknown name is a `ValueError` that lists every name that exists. Loading is lazy and the
loaded object is checked by the registry's `check` callable, so a plugin that resolves to the
wrong kind of object is refused with its name, not used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib import metadata
from typing import Generic, TypeVar

T = TypeVar("T")


def load_dotted(path: str, what: str = "object") -> object:
    """Import "package.module:attr.sub"; ValueError saying what failed."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{what} path {path!r} must look like 'package.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {what} module {module_name!r}: {e}") from e
    obj: object = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


class Registry(Generic[T]):
    """Named objects of one kind (`what`: used in every error message).

    `check(obj)` returns the object as a `T` or raises `TypeError`/`ValueError`; it runs on every
    resolved object, built-in or plugin. `entry_point_group=None` disables plugin discovery;
    `allow_dotted=False` refuses "module:attr" names (closed sets such as routing policies).
    """

    def __init__(self, what: str, *, entry_point_group: str | None = None,
                 check: Callable[[object], T] | None = None, allow_dotted: bool = True,
                 list_sources: bool = False) -> None:
        self.what = what
        self.entry_point_group = entry_point_group
        self.allow_dotted = allow_dotted
        # Unknown-name errors list "name (module:attr)": where plugins can clash, say which is which.
        self.list_sources = list_sources
        self._check = check
        self._builtins: dict[str, str | T] = {}
        self._loaded: dict[str, T] = {}

    def register(self, name: str, target: str | T) -> None:
        """A built-in: `target` is the object or a lazy "module:attr" string."""
        if not name or ":" in name:
            raise ValueError(f"{self.what} name {name!r} must be non-empty and contain no ':'")
        if name in self._builtins:
            raise ValueError(f"{self.what} {name!r} is already registered")
        self._builtins[name] = target

    def _entry_points(self) -> dict[str, metadata.EntryPoint]:
        if self.entry_point_group is None:
            return {}
        return {ep.name: ep for ep in metadata.entry_points(group=self.entry_point_group)}

    def names(self) -> list[str]:
        """Every resolvable name: built-ins and installed plugins (built-ins win a clash)."""
        return sorted(set(self._builtins) | set(self._entry_points()))

    def available(self) -> dict[str, str]:
        """name -> where it comes from ("module:attr" or the object's qualified name)."""
        out = {name: ep.value for name, ep in self._entry_points().items()}
        for name, target in self._builtins.items():
            out[name] = target if isinstance(target, str) else _describe(target)
        return dict(sorted(out.items()))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._builtins or name in self._entry_points())

    def get(self, name: str) -> T:
        """The object `name` stands for; ValueError listing what exists."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.what} must be a non-empty string, got {name!r}")
        if name in self._loaded:
            return self._loaded[name]
        if ":" in name:
            if not self.allow_dotted:
                raise ValueError(f"{self.what} {name!r}: dotted paths are not accepted here; "
                                 f"available: {', '.join(self.names()) or 'none'}")
            obj = load_dotted(name, self.what)
        elif name in self._builtins:
            target = self._builtins[name]
            obj = load_dotted(target, self.what) if isinstance(target, str) else target
        else:
            ep = self._entry_points().get(name)
            if ep is None:
                hint = ""
                if self.entry_point_group:
                    hint = (f"; or install a package with a '{self.entry_point_group}' entry point")
                if self.allow_dotted:
                    hint = f"; or give a dotted path 'package.module:Name'{hint}"
                raise ValueError(f"unknown {self.what} {name!r}; available: {self._listing()}{hint}")
            try:
                obj = ep.load()
            except Exception as e:  # a broken plugin: say which one
                raise ValueError(f"{self.what} entry point {name!r} ({ep.value}) failed to load: {e}") from e
        try:
            checked = self._check(obj) if self._check is not None else obj
        except (TypeError, ValueError) as e:
            raise ValueError(f"{self.what} {name!r} resolved to {obj!r}, which is refused: {e}") from e
        self._loaded[name] = checked  # type: ignore[assignment]
        return checked  # type: ignore[return-value]

    def _listing(self) -> str:
        if self.list_sources:
            return ", ".join(f"{name} ({source})" for name, source in self.available().items()) or "none"
        return ", ".join(self.names()) or "none"


def subclass_of(base: type) -> Callable[[object], type]:
    """A `check` for registries of classes: the object must be a subclass of `base`."""
    def check(obj: object) -> type:
        if not (isinstance(obj, type) and issubclass(obj, base)):
            raise ValueError(f"{obj!r} is not a subclass of {base.__name__}")
        return obj
    return check


def _describe(obj: object) -> str:
    module = getattr(obj, "__module__", None) or type(obj).__module__
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{module}:{name}"


__all__ = ["Registry", "load_dotted", "subclass_of"]

"""The one lookup mechanism: built-ins (lazy or eager), dotted paths, entry points, clear errors."""

from __future__ import annotations

import pytest

from pdcluster.registry import Registry, load_dotted, subclass_of


class Base:
    pass


class Impl(Base):
    pass


def test_builtin_lazy_and_eager() -> None:
    reg: Registry[type] = Registry("widget", check=subclass_of(Base))
    reg.register("lazy", f"{__name__}:Impl")
    reg.register("eager", Impl)
    assert reg.get("lazy").__name__ == "Impl"
    assert reg.get("eager") is Impl
    assert "lazy" in reg and "nope" not in reg
    assert reg.names() == ["eager", "lazy"]
    assert reg.available()["lazy"] == f"{__name__}:Impl"


def test_unknown_name_lists_what_exists() -> None:
    reg: Registry[type] = Registry("widget", entry_point_group="pdcluster.no_such_group")
    reg.register("a", Impl)
    reg.register("b", Impl)
    with pytest.raises(ValueError, match=r"unknown widget 'zzz'; available: a, b"):
        reg.get("zzz")
    with pytest.raises(ValueError, match="non-empty"):
        reg.get("")


def test_check_refuses_wrong_kind_by_name() -> None:
    reg: Registry[type] = Registry("widget", check=subclass_of(Base))
    reg.register("bad", int)
    with pytest.raises(ValueError, match=r"widget 'bad' resolved to .*not a subclass of Base"):
        reg.get("bad")


def test_dotted_paths_and_their_errors() -> None:
    reg: Registry[type] = Registry("widget", check=subclass_of(Base))
    assert reg.get(f"{__name__}:Impl") is Impl
    with pytest.raises(ValueError, match="must look like"):
        load_dotted("nocolon", "widget")
    with pytest.raises(ValueError, match="cannot import widget module"):
        reg.get("no_such_module_xyz:Thing")
    with pytest.raises(ValueError, match="has no attribute"):
        reg.get(f"{__name__}:Missing")
    closed: Registry[type] = Registry("policy", allow_dotted=False)
    with pytest.raises(ValueError, match="dotted paths are not accepted"):
        closed.get(f"{__name__}:Impl")


def test_duplicate_and_bad_names_refused() -> None:
    reg: Registry[type] = Registry("widget")
    reg.register("x", Impl)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("x", Impl)
    with pytest.raises(ValueError, match="contain no ':'"):
        reg.register("a:b", Impl)


def test_entry_point_plugins_are_found() -> None:
    # The example connector plugin is installed in the test venv only when its package is; the
    # kv-connector group always exists in this distribution's metadata through the test below.
    reg: Registry[object] = Registry("console script", entry_point_group="console_scripts")
    assert "pdcluster" in reg.names()
    assert callable(reg.get("pdcluster"))


def test_unknown_name_can_list_each_source() -> None:
    reg: Registry[type] = Registry("widget", list_sources=True, allow_dotted=False)
    reg.register("lazy", f"{__name__}:Impl")
    reg.register("eager", Impl)
    with pytest.raises(ValueError, match=rf"available: eager \({__name__}:Impl\), lazy \({__name__}:Impl\)$"):
        reg.get("zzz")

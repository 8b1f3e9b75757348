"""No code in the project may deserialize with pickle & co or evaluate strings as code.

DESIGN.md section 9: several CVEs in peer projects came from pickle over sockets. Static check
over every Python file of every component folder (not .venv, not tests): imports of pickle-like
modules, builtin eval/exec calls, dynamic imports of those modules, and the known
pickle back doors of common libraries (torch.load without weights_only=True, numpy.load with
allow_pickle=True, yaml.load/unsafe_load/full_load).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCANNED_DIRS = (
    "pdcluster", "router", "cluster", "connectors", "kvstore", "prefill_worker", "decode_worker",
    "kernels", "scripts", "benchmarks", "examples",
)
FORBIDDEN_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "joblib", "jsonpickle"}
FORBIDDEN_BUILTINS = {"eval", "exec"}
# Explicit exceptions: "relative/path.py:line" -> why it is safe. Keep it empty; an entry needs
# review by whoever owns security (DESIGN.md section 9).
ALLOWED: dict[str, str] = {}


def _root_module(name: str | None) -> str:
    return (name or "").split(".")[0]


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _dotted(node: ast.expr) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def find_violations(source: str, filename: str = "<src>") -> list[tuple[int, str]]:
    tree = ast.parse(source, filename)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if _root_module(a.name) in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and _root_module(node.module) in FORBIDDEN_MODULES:
                found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Call):
            found += [(node.lineno, msg) for msg in _call_violations(node)]
    return found


def _call_violations(call: ast.Call) -> list[str]:
    name = _dotted(call.func)
    if isinstance(call.func, ast.Name) and name in FORBIDDEN_BUILTINS:
        return [f"{name}() call"]
    first = call.args[0] if call.args else None
    if name in ("__import__", "importlib.import_module", "import_module") and isinstance(first, ast.Constant):
        if _root_module(str(first.value)) in FORBIDDEN_MODULES:
            return [f"dynamic import of {first.value}"]
    if name == "torch.load" and not _is_true(_kw(call, "weights_only")):
        return ["torch.load without weights_only=True (unpickles)"]
    if name in ("np.load", "numpy.load") and _is_true(_kw(call, "allow_pickle")):
        return [f"{name}(allow_pickle=True)"]
    if name in ("yaml.unsafe_load", "yaml.full_load", "yaml.load"):
        return [f"{name} (use yaml.safe_load)"]
    return []


def project_files() -> list[pathlib.Path]:
    files = []
    for d in SCANNED_DIRS:
        files += sorted((ROOT / d).rglob("*.py")) if (ROOT / d).is_dir() else []
    return files


def test_scanner_catches_the_patterns():
    bad = """
import pickle
import os, cloudpickle as cp
from marshal import loads
from dill.source import x
import shelve
eval("1")
exec("x = 1")
__import__("pickle")
importlib.import_module("joblib")
torch.load(path)
torch.load(path, weights_only=False)
np.load(f, allow_pickle=True)
yaml.load(text, Loader=yaml.Loader)
"""
    assert [line for line, _ in find_violations(bad)] == list(range(2, 15))  # one per line
    good = """
import msgpack, json, pickletools_like
from .pickle_free import thing
obj.eval()
model.eval()
torch.load(path, weights_only=True)
np.load(f)
yaml.safe_load(text)
asyncio.create_subprocess_exec("ls")
re.compile("x")
"""
    assert find_violations(good) == []


def test_project_has_no_unsafe_deserialization():
    files = project_files()
    assert any(p.parts[-2:] == ("security", "envelope.py") for p in files), "scan roots are wrong"
    problems = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        try:
            violations = find_violations(path.read_text(encoding="utf-8"), rel)
        except SyntaxError as e:  # what cannot be parsed cannot be vouched for
            problems.append(f"{rel}: cannot parse ({e.msg}, line {e.lineno})")
            continue
        problems += [f"{rel}:{line}: {what}" for line, what in violations if f"{rel}:{line}" not in ALLOWED]
    assert not problems, "unsafe deserialization / code evaluation:\n" + "\n".join(problems)


@pytest.mark.parametrize("entry", sorted(ALLOWED))
def test_allow_list_entries_still_needed(entry):
    rel, line = entry.rsplit(":", 1)
    lines = [ln for ln, _ in find_violations((ROOT / rel).read_text(), rel)]
    assert int(line) in lines, f"stale allow-list entry {entry}"

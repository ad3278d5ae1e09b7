"""Every Triton kernel reads only globals the GPU compiler accepts.

The CPU interpreter runs a @triton.jit function as Python, so a kernel that reads a plain module-level number
passes every CPU test and then fails to compile on the GPU ("Cannot access global variable ... from within
@jit'ed function"). This walks each kernel's source and checks every global name it loads is a constexpr, another
jitted function, a module, or a builtin.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pkgutil
import textwrap
import types

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import specserve.kernels as kernels  # noqa: E402


def _is_jitted(value) -> bool:
    # triton.jit gives a JITFunction, or under TRITON_INTERPRET an InterpretedFunction; both keep the Python in .fn
    return type(value).__module__.startswith("triton.runtime") and callable(getattr(value, "fn", None))


def _jit_functions():
    for info in pkgutil.iter_modules(kernels.__path__):
        if not info.name.startswith("triton_"):
            continue
        module = importlib.import_module(f"specserve.kernels.{info.name}")
        for name, value in vars(module).items():
            if _is_jitted(value) and value.fn.__module__ == module.__name__:
                yield f"{info.name}.{name}", value


def _bad_globals(jit) -> list[str]:
    fn = jit.fn
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    local = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
    local |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    bad = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)) or node.id in local:
            continue
        if node.id not in fn.__globals__:
            assert hasattr(builtins, node.id), f"{node.id} is not defined"
            continue
        value = fn.__globals__[node.id]
        ok = _is_jitted(value) or isinstance(value, (tl.constexpr, types.ModuleType, type, tl.dtype))
        ok = ok or getattr(value, "__module__", "").startswith("triton")  # tl builtins such as tl.float32's helpers
        if not ok:
            bad.append(f"{node.id}={value!r}")
    return bad


def test_kernels_were_found():
    names = [name for name, _ in _jit_functions()]
    assert any(n.startswith("triton_sample.") for n in names)
    assert len(names) > 20


@pytest.mark.parametrize("name,jit", list(_jit_functions()), ids=lambda v: v if isinstance(v, str) else "")
def test_kernel_globals_are_constexpr(name, jit):
    assert _bad_globals(jit) == [], f"{name} reads non-constexpr globals"

"""The public functions have the seed interface's parameters: names, order and defaults.

The seed (seeds/003_*.txt, a Python file in diff form) lies in shared/seeds beside the
repository: <repo>/../shared/seeds.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import cuflash

PUBLIC_FUNCTIONS = ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_combine")
SEEDS = Path(__file__).resolve().parents[2].parent / "shared" / "seeds"


def seed_functions():
    files = sorted(SEEDS.glob("003_*.txt"))
    if not files:
        pytest.skip(f"seed interface not found: no 003_*.txt in {SEEDS}")
    lines = files[0].read_text().splitlines()
    # Added lines of the diff are the file; the header lines (name, path, hunk) are not.
    source = "\n".join(line[1:] for line in lines if line.startswith("+"))
    tree = ast.parse(source)
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def seed_parameters(node: ast.FunctionDef):
    """[(name, default or inspect.Parameter.empty)] of a seed function."""
    args = node.args
    assert not args.posonlyargs and not args.kwonlyargs and args.vararg is None and args.kwarg is None
    defaults = [inspect.Parameter.empty] * (len(args.args) - len(args.defaults))
    defaults += [ast.literal_eval(d) for d in args.defaults]
    return [(a.arg, d) for a, d in zip(args.args, defaults)]


def our_parameters(function):
    parameters = inspect.signature(function).parameters.values()
    for p in parameters:
        assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, f"{function.__name__}: {p.name} is {p.kind}"
    return [(p.name, p.default) for p in parameters]


@pytest.mark.parametrize("name", PUBLIC_FUNCTIONS)
def test_signature_matches_seed(name):
    seed = seed_functions()
    assert name in seed, f"{name} not in the seed interface"
    expected = seed_parameters(seed[name])
    actual = our_parameters(getattr(cuflash, name))
    assert [n for n, _ in actual] == [n for n, _ in expected], f"{name}: parameter names or order differ"
    for (param, default), (_, seed_default) in zip(actual, expected):
        assert default == seed_default and type(default) is type(seed_default), (
            f"{name}({param}=...): default {default!r} != seed's {seed_default!r}")


def test_shared_options_keep_one_order():
    # flash_attn_func and flash_attn_varlen_func hand q, k, v and the options they share to one
    # helper positionally: its parameters must come in the order that both signatures give them.
    from cuflash import interface

    shared = [p.name for p in inspect.signature(interface._forward).parameters.values()
              if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert shared[:3] == ["q", "k", "v"]
    for name in ("flash_attn_func", "flash_attn_varlen_func"):
        parameters = list(inspect.signature(getattr(cuflash, name)).parameters)
        assert [p for p in parameters if p in shared] == shared, f"{name}: shared options out of order"


@pytest.mark.parametrize("name", PUBLIC_FUNCTIONS)
def test_documented(name):
    function = getattr(cuflash, name)
    doc = inspect.getdoc(function)
    assert doc and "Returns" in doc
    for param in inspect.signature(function).parameters:
        assert param in doc, f"{name}: parameter {param} is not documented"

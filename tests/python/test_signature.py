"""The public functions have the seed interface's parameters: names, order and defaults.

The seed (seeds/003_*.txt, a Python file in diff form) lies in shared/seeds beside the
repository (<repo>/../shared/seeds, or $CUFLASH_SEEDS_DIR). Its signatures are also kept in
seed_signatures.json beside this file, so that a checkout without the seed (a CI clone) still
checks them; where the seed is found, the file is checked against it.

    python3 tests/python/test_signature.py     # rewrite seed_signatures.json from the seed
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import sys
from pathlib import Path

import pytest

PUBLIC_FUNCTIONS = ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_combine")
SEEDS = Path(os.environ.get("CUFLASH_SEEDS_DIR") or Path(__file__).resolve().parents[2].parent / "shared" / "seeds")
FIXTURE = Path(__file__).resolve().parent / "seed_signatures.json"
NO_DEFAULT = {"required": True}  # a parameter without a default, in the JSON file


def seed_functions():
    """{name: ast.FunctionDef} of the seed interface, or None where the seed is not found."""
    files = sorted(SEEDS.glob("003_*.txt"))
    if not files:
        return None
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


def to_json(parameters):
    return [[name, NO_DEFAULT if default is inspect.Parameter.empty else {"repr": repr(default)}]
            for name, default in parameters]


def from_json(entries):
    return [(name, inspect.Parameter.empty if spec == NO_DEFAULT else ast.literal_eval(spec["repr"]))
            for name, spec in entries]


def expected_parameters(name):
    """The seed's parameters of `name`: from the seed where it is found, else from the JSON file."""
    seed = seed_functions()
    if seed is not None:
        assert name in seed, f"{name} not in the seed interface"
        return seed_parameters(seed[name])
    if not FIXTURE.exists():
        pytest.skip(f"seed interface not found (no 003_*.txt in {SEEDS}) and no {FIXTURE.name}")
    return from_json(json.loads(FIXTURE.read_text())[name])


def test_fixture_matches_seed():
    seed = seed_functions()
    if seed is None:
        pytest.skip(f"seed interface not found: no 003_*.txt in {SEEDS}")
    stored = json.loads(FIXTURE.read_text())
    for name in PUBLIC_FUNCTIONS:
        assert stored[name] == to_json(seed_parameters(seed[name])), (
            f"{FIXTURE.name} is out of date for {name}: run python3 {Path(__file__).name}")


def our_parameters(function):
    parameters = inspect.signature(function).parameters.values()
    for p in parameters:
        assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, f"{function.__name__}: {p.name} is {p.kind}"
    return [(p.name, p.default) for p in parameters]


@pytest.mark.parametrize("name", PUBLIC_FUNCTIONS)
def test_signature_matches_seed(name):
    import cuflash

    expected = expected_parameters(name)
    actual = our_parameters(getattr(cuflash, name))
    assert [n for n, _ in actual] == [n for n, _ in expected], f"{name}: parameter names or order differ"
    for (param, default), (_, seed_default) in zip(actual, expected):
        assert default == seed_default and type(default) is type(seed_default), (
            f"{name}({param}=...): default {default!r} != seed's {seed_default!r}")


def test_shared_options_keep_one_order():
    # flash_attn_func and flash_attn_varlen_func hand q, k, v and the options they share to one
    # helper positionally: its parameters must come in the order that both signatures give them.
    import cuflash
    from cuflash import interface

    shared = [p.name for p in inspect.signature(interface._forward).parameters.values()
              if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert shared[:3] == ["q", "k", "v"]
    for name in ("flash_attn_func", "flash_attn_varlen_func"):
        parameters = list(inspect.signature(getattr(cuflash, name)).parameters)
        assert [p for p in parameters if p in shared] == shared, f"{name}: shared options out of order"


@pytest.mark.parametrize("name", PUBLIC_FUNCTIONS)
def test_documented(name):
    import cuflash

    function = getattr(cuflash, name)
    doc = inspect.getdoc(function)
    assert doc and "Returns" in doc
    for param in inspect.signature(function).parameters:
        assert param in doc, f"{name}: parameter {param} is not documented"


if __name__ == "__main__":
    functions = seed_functions()
    if functions is None:
        sys.exit(f"seed interface not found: no 003_*.txt in {SEEDS}")
    table = {name: to_json(seed_parameters(functions[name])) for name in PUBLIC_FUNCTIONS}
    # One parameter a line, so that a change in the seed reads as a one-line diff.
    text = ",\n".join(f" {json.dumps(name)}: [\n" + ",\n".join("  " + json.dumps(entry) for entry in entries) + "\n ]"
                      for name, entries in table.items())
    FIXTURE.write_text("{\n" + text + "\n}\n")
    print(f"wrote {FIXTURE}")

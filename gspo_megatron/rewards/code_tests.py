"""The code-execution reward (``data.reward=code_tests``): the response's program against the prompt's tests, in the
sandbox (``rewards.sandbox``, ``data.sandbox``). Reward = the fraction of tests passed.

The program is the last fenced code block of the response (```python ... ``` or ``` ... ```), else the whole
response. The prompt record carries the tests as its label (``"tests"``, or ``"answer"``/``"label"``), a list of
either
    "assert add(1, 2) == 3"                   statements run after the program, in its namespace (one sandbox run
                                              for all of them; each passes if it raises nothing and its asserts
                                              hold), or
    {"input": "1 2\\n", "output": "3"}       stdin for one run of the program and its expected stdout (compared
                                              with surrounding whitespace stripped; one sandbox run per pair; the
                                              expected output never enters the sandbox).
A program killed by a limit (time, CPU, memory, output) passes no test of that run (statements that passed before
the kill count).

Passes cannot be forged from inside the program's process, where anything (builtins, AssertionError, the harness's
frames) can be replaced: the grader, in this process, splits each top-level ``assert``. What refers to the
program (a call of its function, a name it defines, an attribute of its objects, a comprehension) is evaluated in
the sandbox and comes back as a plain value (None, bool, int, float, str, bytes, list, tuple, set, dict, and
numpy's scalars and arrays as their Python values; anything else fails the test: an object whose ``__eq__`` always
says True is not a value). The rest, the expected values, the arithmetic, comparisons, common builtins (``abs``,
``len``, ``sorted``, ``math.isclose``, ...) and methods of plain values around them, is evaluated here
(``assert abs(area(2) - 12.57) < 0.01`` sends ``area(2)`` only), and so is a test's assignment of expected values
(``expected = sorted([3, 1])``, nothing of the program's in it): ``assert f(1) == expected`` compares with the
grader's ``expected``. A program that takes over the harness can report any values it likes, but without the
expected ones it can only report answers (as hard-coding them would).

So a test's comparisons must be where the grader makes them: a comparison that would run in the program's process
(inside an assert in a block, a comprehension's element, a lambda, a statement that is not an assert:
``all(f(i) == 2 * i for i in range(3))``, ``ok = f(1) == 3``) is refused as a bad label, with the form to write
instead (``assert [f(i) for i in range(3)] == [0, 2, 4]``). Comparisons in a call's arguments or a
comprehension's filter choose the program's input, not the verdict, and are allowed. What a test's own helper
function returns (``def check(x): ...``, then ``assert check(f(1))``) is computed in the program's process too:
keep the expected values in the assert.
"""

from __future__ import annotations

import ast
import copy
import json
import math
import re
import types

from .sandbox import Limits, run_python

_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)

# Runs the program, then each test's steps (statements run, or expressions evaluated and sent back as plain
# values), reporting each test as it finishes (so a test that hangs keeps the earlier ones) as a JSON line on the
# original stdout; the program's own stdout goes to stderr.
_HARNESS = """
import json, os, sys
_report = os.dup(1)
os.dup2(2, 1)

def _plain(v):
    t = type(v)
    if v is None or t in (bool, int, str):
        return v
    if t is float:
        return {{"float": repr(v)}}
    if t is bytes:
        return {{"bytes": v.hex()}}
    if t is list:
        return [_plain(x) for x in v]
    if t is tuple:
        return {{"tuple": [_plain(x) for x in v]}}
    if t in (set, frozenset):
        return {{"set": [_plain(x) for x in v]}}
    if t is dict:
        return {{"dict": [[_plain(k), _plain(x)] for k, x in v.items()]}}
    if t.__module__ == "numpy" and hasattr(v, "tolist"):
        return _plain(v.tolist())
    raise TypeError(f"not a plain value: {{t.__name__}}")

_ns = {{"__name__": "__main__"}}
try:
    exec(compile({program!r}, "solution.py", "exec"), _ns)
except BaseException:
    os._exit(0)
for _i, _steps in enumerate({tests!r}):
    _values = []
    try:
        for _kind, _source in _steps:
            if _kind == "run":
                exec(compile(_source, "test", "exec"), _ns)
            else:
                _values.append([_plain(eval(compile(s, "test", "eval"), _ns)) for s in _source])
        _line = json.dumps({{"test": _i, "values": _values}})
    except BaseException:
        _line = json.dumps({{"test": _i, "error": True}})
    try:
        os.write(_report, (_line + "\\n").encode())
    except OSError:  # past the output limit (a huge value): the tests not reported fail
        break
"""

# What the grader evaluates itself, on the plain values that come back: these builtins and math's functions
# (the real ones, whatever the program rebinds), operators, comparisons, displays, and subscripts and methods of
# values it has (see _local). Any other subtree (a call of the program's functions, a name it defines, an attribute
# of its objects, a comprehension) is evaluated in the sandbox and must come back as a plain value.
_BUILTINS = {f.__name__: f for f in (abs, all, any, bool, bytes, chr, dict, divmod, enumerate, float, frozenset, int,
                                     isinstance, len, list, max, min, ord, pow, range, repr, reversed, round, set,
                                     sorted, str, sum, tuple, type, zip)}
_MATH = {name: getattr(math, name) for name in ("ceil", "e", "exp", "fabs", "floor", "inf", "isclose", "isfinite",
                                                 "isinf", "isnan", "log", "nan", "pi", "sqrt")}
_LOCAL = (ast.Constant, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp, ast.Slice, ast.List, ast.Tuple,
          ast.Set, ast.Dict, ast.Starred)


def extract_program(response: str) -> str:
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def parse_tests(label) -> list:
    tests = json.loads(label) if isinstance(label, str) else label
    if isinstance(tests, dict) and "tests" in tests:
        tests = tests["tests"]
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"code_tests needs a non-empty list of tests as the prompt's label, got {str(label)[:80]!r}")
    for test in tests:
        if isinstance(test, str):
            _plan(test)  # a statement that does not parse, or an assert that cannot be split, is a bad label
        elif not (isinstance(test, dict) and {"input", "output"} <= set(test)):
            raise ValueError(f"a code test is an assert statement or {{input, output}}, got {str(test)[:80]!r}")
    return tests


class _Check:
    """One top-level assert, split: ``expressions`` (the subtrees the sandbox evaluates, as source) and the rest,
    which the grader evaluates on their values. ``assert abs(area(2) - 12.57) < 0.01`` sends ``area(2)`` only.
    ``known``: the test's variables the grader holds (``expected = [1, 2]`` before the assert), by value."""

    def __init__(self, test: ast.expr, known: dict):
        self.known = dict(known)
        self.leaves: list[ast.expr] = []
        tree = ast.fix_missing_locations(ast.Expression(self._split(test)))
        self.expressions = [ast.unparse(leaf) for leaf in self.leaves]
        self.code = compile(tree, "test", "eval")

    def _split(self, node: ast.expr) -> ast.expr:
        if not _local(node, self.known):
            if isinstance(node, ast.GeneratorExp):  # its values, as a list (a generator is not a value)
                node = ast.ListComp(node.elt, node.generators)
            self.leaves.append(node)
            return ast.Name(f"_value{len(self.leaves) - 1}", ast.Load())
        if isinstance(node, (ast.Name, ast.Attribute)):  # a builtin, a known variable, math's, a plain value's method
            return node
        for name, value in ast.iter_fields(node):
            if isinstance(value, ast.expr):
                setattr(node, name, self._split(value))
            elif isinstance(value, list):
                setattr(node, name, [self._split(v) if isinstance(v, ast.expr) else v for v in value])
        for keyword in getattr(node, "keywords", ()):
            keyword.value = self._split(keyword.value)
        return node

    def holds(self, values: list) -> bool:
        names = {f"_value{i}": _decode(value) for i, value in enumerate(values)}
        return bool(_evaluate(self.code, {**copy.deepcopy(self.known), **names}))  # (a method may mutate one)


def _evaluate(code, names: dict):
    """``code`` in the grader: its builtins and math's (the real ones) and ``names``, nothing else."""
    return eval(code, {"__builtins__": {}}, {**_BUILTINS, "math": types.SimpleNamespace(**_MATH), **names})


def _local(node: ast.expr, known=()) -> bool:
    """Whether the grader evaluates ``node`` itself (its subtrees may still be sent); ``known``: the test's
    variables the grader holds."""
    if isinstance(node, ast.Name):
        return node.id in _BUILTINS or node.id in known
    if isinstance(node, ast.Attribute):  # math's, or a method of a value the grader has (``", ".join``)
        if isinstance(node.value, ast.Name) and node.value.id == "math":
            return node.attr in _MATH
        return _pure(node.value, known)
    if isinstance(node, ast.Subscript):  # of a value the program made: sent whole (``s.items[0].name``)
        return _pure(node.value, known)
    if isinstance(node, ast.Call):  # a lambda argument (``sorted(f(x), key=lambda p: p[1])``): the call is sent
        arguments = [*node.args, *(k.value for k in node.keywords)]
        return (_local(node.func, known) and not any(isinstance(a, (ast.Starred, ast.Lambda)) for a in arguments)
                and all(k.arg is not None for k in node.keywords))
    return isinstance(node, _LOCAL)


def _pure(node: ast.expr, known=()) -> bool:
    """Whether the grader evaluates all of ``node`` (nothing in it is the program's)."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "math":
        return node.attr in _MATH
    return _local(node, known) and all(_pure(child, known) for child in ast.iter_child_nodes(node)
                                       if isinstance(child, ast.expr))


def _bound_names(statement: ast.stmt) -> set[str]:
    """Every name ``statement`` mentions or binds (a known variable it might change stops being known)."""
    names = set()
    for node in ast.walk(statement):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            names.update(node.names)
    return names


def _forgeable_comparison(node: ast.AST) -> ast.Compare | None:
    """A comparison in ``node`` that would run in the program's process and make a verdict there: not one in a
    call's arguments or a comprehension's filter, which choose the program's input."""
    if isinstance(node, ast.Compare):
        return node
    if isinstance(node, ast.Call):
        return _forgeable_comparison(node.func)
    if isinstance(node, ast.comprehension):
        return _forgeable_comparison(node.iter)
    for child in ast.iter_child_nodes(node):
        if (found := _forgeable_comparison(child)) is not None:
            return found
    return None


def _plan(test: str) -> tuple[list, list[_Check]]:
    """A test statement as the harness's steps (("run", statement) or ("eval", expressions)) and its checks. An
    assignment of expected values (``expected = sorted([3, 1])``: nothing of the program's) is evaluated here too,
    so an assert comparing with ``expected`` does not take its value from the program's process."""
    try:
        module = ast.parse(test)
    except SyntaxError as e:
        raise ValueError(f"the code test {test[:80]!r} does not parse: {e.msg}") from None
    steps, checks, known = [], [], {}
    for statement in module.body:
        if isinstance(statement, ast.Assert):
            checks.append(_Check(statement.test, known))
            sent = checks[-1].leaves
            steps.append(("eval", checks[-1].expressions))
        else:
            if any(isinstance(node, ast.Assert) for node in ast.walk(statement)):
                raise ValueError(f"the code test {test[:80]!r} has an assert inside a block: write its asserts as "
                                 "top-level statements (the grader compares their values outside the program)")
            if (isinstance(statement, ast.Assign) and len(statement.targets) == 1
                    and isinstance(statement.targets[0], ast.Name) and _pure(statement.value, known)):
                try:
                    value = _evaluate(compile(ast.Expression(statement.value), "test", "eval"), known)
                except Exception as e:
                    raise ValueError(f"the code test {test[:80]!r}: {ast.unparse(statement)[:60]!r} raises "
                                     f"{type(e).__name__}: {e}") from None
                known[statement.targets[0].id], sent = value, []
            else:
                for name in _bound_names(statement):
                    known.pop(name, None)
                sent = [statement]
            steps.append(("run", ast.unparse(statement)))  # (the program's copy, for inputs: f(expected))
        for node in sent:
            if (comparison := _forgeable_comparison(node)) is not None:
                raise ValueError(
                    f"the code test {test[:80]!r} compares {ast.unparse(comparison)[:60]!r} inside "
                    f"{ast.unparse(node)[:60]!r}, which runs in the program's process, where a comparison can be "
                    "forged: compare values in a top-level assert (for example 'assert [f(i) for i in range(3)] == "
                    "[0, 2, 4]' rather than 'assert all(f(i) == 2 * i for i in range(3))')")
    return steps, checks


def _decode(value):
    """A plain value from the harness's JSON (see ``_plain`` in the harness)."""
    if isinstance(value, list):
        return [_decode(x) for x in value]
    if not isinstance(value, dict):
        return value
    (kind, inner), = value.items()
    if kind == "float":
        return float(inner)
    if kind == "bytes":
        return bytes.fromhex(inner)
    if kind == "tuple":
        return tuple(_decode(x) for x in inner)
    if kind == "set":
        return {_decode(x) for x in inner}
    return {_decode(k): _decode(x) for k, x in inner}


def _passes(report: dict, checks: list[_Check]) -> bool:
    values = report.get("values")
    if "error" in report or not isinstance(values, list) or len(values) != len(checks):
        return False
    try:
        return all(check.holds(v) for check, v in zip(checks, values))
    except Exception:  # a malformed report (the program can write to the channel): not a pass
        return False


def passed_tests(program: str, tests: list, limits: Limits = Limits()) -> int:
    """How many of ``tests`` ``program`` passes."""
    statements = [t for t in tests if isinstance(t, str)]
    passed = 0
    if statements:
        plans = [_plan(t) for t in statements]
        result = run_python(_HARNESS.format(program=program, tests=[steps for steps, _ in plans]), limits=limits)
        reports: dict[int, list] = {}
        for line in result.stdout.splitlines():
            try:
                report = json.loads(line)
                reports.setdefault(int(report["test"]), []).append(report)
            except (ValueError, TypeError, KeyError, RecursionError):  # the program can write here too
                continue
        # A test reported twice was reported by the program too: not a pass.
        passed += sum(len(reports.get(i, [])) == 1 and _passes(reports[i][0], checks)
                      for i, (_, checks) in enumerate(plans))
    for test in (t for t in tests if isinstance(t, dict)):
        result = run_python(program, stdin=str(test["input"]), limits=limits)
        passed += result.ok and result.stdout.strip() == str(test["output"]).strip()
    return passed


def code_tests_reward(prompt: str, response: str, label, limits: Limits = Limits()) -> float:
    tests = parse_tests(label)
    return passed_tests(extract_program(response), tests, limits) / len(tests)

"""The language generated kernels are written in: a small subset of Triton, allow-listed exactly.

A generated module is ``import triton`` / ``import triton.language as tl`` and one ``@triton.jit``
function with its operation's fixed parameters (kernels/generated/launch.py). Inside it, only:
- statements: assignment to local names, augmented assignment, ``if``/``else``, ``pass``,
  ``tl.store(...)`` as a statement, and ``for <name> in range(...)`` / ``tl.range(...)`` whose bounds
  are built from integer literals, ``tl.constexpr`` parameters and enclosing loop variables, with a
  step that is a positive literal or a constexpr (so no loop's trip count depends on data or on the
  number of rows);
- expressions: literals (numbers, booleans), local names and non-pointer parameters, arithmetic,
  comparisons, ``x if c else y``, broadcasting subscripts (``x[:, None]``), ``x.to(tl.<dtype>)`` or
  ``x.to(y.dtype)``, ``tl.<dtype>`` and calls of the functions in TL_FUNCS with the keywords listed there;
- pointers: a pointer parameter appears only as ``tl.load(p + offsets, ...)`` or ``tl.store(p + offsets,
  value, ...)`` (stores only to the operation's outputs); the rewrite masks each access with
  ``0 <= offsets < _n_p``, the element count the launcher passes;
- shapes: ``tl.arange``, ``tl.zeros`` and ``tl.full`` take literals up to MAX_TILE or constexpr names.
Everything else is refused, with the line and the reason: other imports, attribute chains, calls,
top-level statements, decorators, defaults, strings, names starting with ``_``, shadowing ``tl``,
``while``, ``return``, lambdas, comprehensions.

Why a grammar rather than a deny-list or a sandboxed interpreter: the kernels run in the serving
process (a forward pass cannot afford a process boundary per operation), so what they can express must
be small enough to enumerate. In a compiled kernel the body is never run as Python; under
``TRITON_INTERPRET=1`` it is, and then this grammar is what keeps it to tensor arithmetic.
"""
from __future__ import annotations

import ast

from engine.errors import VariantError
from kernels.generated.launch import MAX_TILE, SIGNATURES

# tl functions a kernel may call, each with the keywords it may pass
TL_FUNCS = {
    "program_id": set(), "num_programs": set(), "arange": set(), "zeros": {"dtype"}, "full": {"dtype"},
    "load": {"mask", "other", "eviction_policy"}, "store": {"value", "mask", "eviction_policy"},
    "cdiv": set(), "sum": {"axis", "keep_dims"}, "max": {"axis", "keep_dims"}, "min": {"axis", "keep_dims"},
    "argmax": {"axis"}, "argmin": {"axis"}, "exp": set(), "exp2": set(), "log": set(), "log2": set(),
    "sqrt": set(), "rsqrt": set(), "sigmoid": set(), "abs": set(), "cos": set(), "sin": set(), "erf": set(),
    "floor": set(), "ceil": set(), "where": set(), "maximum": set(), "minimum": set(), "clamp": set(),
    "fma": set(), "dot": {"acc", "input_precision", "out_dtype"}, "trans": set(),
}
TL_DTYPES = {"float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "int1"}
STRING_KEYWORDS = {"eviction_policy": {"evict_first", "evict_last"}, "input_precision": {"ieee", "tf32", "tf32x3"}}
RESERVED = {"tl", "triton", "range"}
MAX_LOOP_DEPTH = 3
MAX_SOURCE = 20000  # characters
MAX_INT = 2**31 - 1
_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.BitAnd, ast.BitOr, ast.BitXor,
           ast.LShift, ast.RShift)
_BOUND_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv)
_UNARY = (ast.USub, ast.UAdd, ast.Not, ast.Invert)
_CMP = (ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Eq, ast.NotEq)


def bound_name(pointer: str) -> str:
    """The parameter holding ``pointer``'s element count, appended by the rewrite."""
    return f"_n_{pointer}"


class _Refused(Exception):
    def __init__(self, node: ast.AST | None, reason: str) -> None:
        super().__init__(reason)
        self.line = getattr(node, "lineno", None)


def split_pointer(e: ast.expr, pointers) -> tuple[str | None, ast.expr | None]:
    """``p + a - b + ...`` -> (p, a - b + ...): a sum in which one pointer parameter appears once, added.
    (None, None) when ``e`` is not of that form (the pointer subtracted, twice, or missing)."""
    terms: list[tuple[int, ast.expr]] = []

    def flatten(x, sign):
        if isinstance(x, ast.BinOp) and isinstance(x.op, (ast.Add, ast.Sub)):
            flatten(x.left, sign)
            flatten(x.right, sign if isinstance(x.op, ast.Add) else -sign)
        else:
            terms.append((sign, x))

    flatten(e, 1)
    found = [i for i, (_, t) in enumerate(terms) if isinstance(t, ast.Name) and t.id in pointers]
    if len(found) != 1 or terms[found[0]][0] != 1 or len(terms) < 2:
        return None, None
    ptr = terms.pop(found[0])[1].id
    sign, off = terms[0]
    off = off if sign > 0 else ast.UnaryOp(ast.USub(), off)
    for sign, t in terms[1:]:
        off = ast.BinOp(off, ast.Add() if sign > 0 else ast.Sub(), t)
    return ptr, off


def _is_tl_attr(node: ast.AST, names) -> bool:
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "tl"
            and node.attr in names)


class _Checker:
    def __init__(self, op: str) -> None:
        sig = SIGNATURES[op]
        self.sig = sig
        self.pointers = set(sig.pointers)
        self.outputs = set(sig.outputs)
        self.constexprs = set(sig.constexprs)
        self.params = set(sig.params)
        self.locals: set[str] = set()
        self.loop_vars: list[str] = []

    # ---- statements -----------------------------------------------------------------------------
    def body(self, stmts: list[ast.stmt]) -> None:
        for s in stmts:
            self.stmt(s)

    def stmt(self, s: ast.stmt) -> None:
        if isinstance(s, ast.Assign):
            if len(s.targets) != 1:
                raise _Refused(s, "chained assignment is not allowed")
            self.target(s.targets[0])
            if isinstance(s.value, ast.Tuple):
                for e in s.value.elts:
                    self.expr(e)
            else:
                self.expr(s.value)
        elif isinstance(s, ast.AugAssign):
            if not isinstance(s.op, _BINOPS):
                raise _Refused(s, f"operator {type(s.op).__name__} is not allowed")
            self.shift(s, s.op, s.value)
            self.target(s.target)
            self.expr(s.value)
        elif isinstance(s, ast.For):
            self.loop(s)
        elif isinstance(s, ast.If):
            self.expr(s.test)
            self.body(s.body)
            self.body(s.orelse)
        elif isinstance(s, ast.Pass):
            pass
        elif isinstance(s, ast.Expr):
            if isinstance(s.value, ast.Call) and _is_tl_attr(s.value.func, {"store"}):
                self.expr(s.value)
            elif isinstance(s.value, ast.Constant) and isinstance(s.value.value, str):
                pass  # a docstring or comment string: never evaluated to anything
            else:
                raise _Refused(s, "an expression statement may only be tl.store(...)")
        else:
            raise _Refused(s, f"{type(s).__name__} statements are not allowed in a generated kernel")

    def shift(self, node: ast.AST, op: ast.operator, amount: ast.expr) -> None:
        """A shift by a small literal or a constexpr: ``1 << 2**31`` would build a huge integer while compiling."""
        if isinstance(op, (ast.LShift, ast.RShift)) and not (
                (isinstance(amount, ast.Constant) and type(amount.value) is int and 0 <= amount.value <= 63)
                or (isinstance(amount, ast.Name) and amount.id in self.constexprs)):
            raise _Refused(node, "a shift's amount must be an integer literal from 0 to 63 or a constexpr")

    def target(self, t: ast.expr) -> None:
        names = t.elts if isinstance(t, ast.Tuple) else [t]
        for n in names:
            if not isinstance(n, ast.Name):
                raise _Refused(t, "only local names may be assigned")
            self.new_local(n, n.id)

    def new_local(self, node: ast.AST, name: str) -> None:
        if name.startswith("_"):
            raise _Refused(node, f"name {name!r}: names starting with '_' are reserved")
        if name in RESERVED:
            raise _Refused(node, f"name {name!r} may not be rebound (shadowing {name!r})")
        if name in self.params:
            raise _Refused(node, f"parameter {name!r} may not be reassigned")
        self.locals.add(name)

    def loop(self, s: ast.For) -> None:
        if s.orelse:
            raise _Refused(s, "for ... else is not allowed")
        if len(self.loop_vars) >= MAX_LOOP_DEPTH:
            raise _Refused(s, f"loops may nest at most {MAX_LOOP_DEPTH} deep")
        if not isinstance(s.target, ast.Name):
            raise _Refused(s, "a loop variable must be a single name")
        it = s.iter
        is_range = isinstance(it, ast.Call) and (
            (isinstance(it.func, ast.Name) and it.func.id == "range") or _is_tl_attr(it.func, {"range"}))
        if not is_range or it.keywords or not 1 <= len(it.args) <= 3:
            raise _Refused(s, "a loop must be 'for i in range(start, end, step)' (or tl.range) with 1 to 3 "
                              "positional bounds")
        for a in it.args:
            self.bound(a)
        if len(it.args) == 3:
            step = it.args[2]
            literal = isinstance(step, ast.Constant) and type(step.value) is int and step.value > 0
            if not literal and not (isinstance(step, ast.Name) and step.id in self.constexprs):
                raise _Refused(step, "a loop step must be a positive integer literal or a constexpr parameter")
        self.new_local(s.target, s.target.id)
        self.loop_vars.append(s.target.id)
        self.body(s.body)
        self.loop_vars.pop()

    def bound(self, e: ast.expr) -> None:
        """A loop bound: integer literals, constexpr parameters, enclosing loop variables, + - * // and tl.cdiv."""
        if isinstance(e, ast.Constant) and type(e.value) is int and abs(e.value) <= MAX_INT:
            return
        if isinstance(e, ast.Name) and (e.id in self.constexprs or e.id in self.loop_vars):
            return
        if isinstance(e, ast.BinOp) and isinstance(e.op, _BOUND_BINOPS):
            self.bound(e.left)
            self.bound(e.right)
            return
        if isinstance(e, ast.Call) and _is_tl_attr(e.func, {"cdiv"}) and not e.keywords and len(e.args) == 2:
            self.bound(e.args[0])
            self.bound(e.args[1])
            return
        raise _Refused(e, "a loop bound may use only integer literals, constexpr parameters and enclosing loop "
                          "variables (no loaded values, no row count)")

    # ---- expressions ----------------------------------------------------------------------------
    def expr(self, e: ast.expr) -> None:
        if isinstance(e, ast.Constant):
            v = e.value
            if type(v) is bool or type(v) is float:
                return
            if type(v) is int and abs(v) <= MAX_INT:
                return
            raise _Refused(e, f"literal {v!r:.40} is not allowed (numbers and booleans only)")
        if isinstance(e, ast.Name):
            if e.id in self.pointers:
                raise _Refused(e, f"pointer {e.id!r} may appear only as tl.load({e.id} + offsets) or "
                                  f"tl.store({e.id} + offsets, value)")
            if e.id in self.params or e.id in self.locals:
                return
            if e.id == "tl":
                raise _Refused(e, "'tl' may be used only as tl.<function>(...) or tl.<dtype>")
            raise _Refused(e, f"name {e.id!r} is not a parameter or a local assigned before")
        if isinstance(e, ast.Attribute):
            if _is_tl_attr(e, TL_DTYPES):
                return
            raise _Refused(e, f"attribute {ast.unparse(e)[:60]!r} is not allowed (only tl.<dtype>, tl.<function>"
                              "(...) and x.to(tl.<dtype>))")
        if isinstance(e, ast.BinOp):
            if not isinstance(e.op, _BINOPS):
                raise _Refused(e, f"operator {type(e.op).__name__} is not allowed")
            self.shift(e, e.op, e.right)
            self.expr(e.left)
            self.expr(e.right)
            return
        if isinstance(e, ast.UnaryOp):
            if not isinstance(e.op, _UNARY):
                raise _Refused(e, f"operator {type(e.op).__name__} is not allowed")
            self.expr(e.operand)
            return
        if isinstance(e, ast.Compare):
            if not all(isinstance(o, _CMP) for o in e.ops):
                raise _Refused(e, "only <, <=, >, >=, ==, != comparisons are allowed")
            self.expr(e.left)
            for c in e.comparators:
                self.expr(c)
            return
        if isinstance(e, ast.BoolOp):
            for v in e.values:
                self.expr(v)
            return
        if isinstance(e, ast.IfExp):
            self.expr(e.test)
            self.expr(e.body)
            self.expr(e.orelse)
            return
        if isinstance(e, ast.Subscript):
            self.expr(e.value)
            parts = e.slice.elts if isinstance(e.slice, ast.Tuple) else [e.slice]
            for p in parts:
                full = isinstance(p, ast.Slice) and p.lower is None and p.upper is None and p.step is None
                if not (full or (isinstance(p, ast.Constant) and p.value is None)):
                    raise _Refused(e, "subscripts may only broadcast (x[:, None]), not index or slice")
            return
        if isinstance(e, ast.Call):
            self.call(e)
            return
        raise _Refused(e, f"{type(e).__name__} expressions are not allowed in a generated kernel")

    def call(self, c: ast.Call) -> None:
        f = c.func
        if isinstance(f, ast.Attribute) and f.attr == "to" and not _is_tl_attr(f, {"to"}):
            self.expr(f.value)
            a = c.args[0] if len(c.args) == 1 else None
            local_dtype = (isinstance(a, ast.Attribute) and a.attr == "dtype" and isinstance(a.value, ast.Name)
                           and a.value.id in self.locals)
            if a is None or c.keywords or not (_is_tl_attr(a, TL_DTYPES) or local_dtype):
                raise _Refused(c, "x.to(...) takes exactly one tl.<dtype> or <local>.dtype")
            return
        if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "tl"):
            raise _Refused(c, f"call of {ast.unparse(f)[:60]!r} is not allowed (only tl.<function>(...) and "
                              "x.to(tl.<dtype>))")
        name = f.attr
        if name not in TL_FUNCS:
            raise _Refused(c, f"tl.{name} is not an allowed function")
        if any(isinstance(a, ast.Starred) for a in c.args) or any(k.arg is None for k in c.keywords):
            raise _Refused(c, "*args and **kwargs are not allowed")
        for k in c.keywords:
            if k.arg not in TL_FUNCS[name]:
                raise _Refused(c, f"tl.{name} does not take the keyword {k.arg!r} here")
        if name in ("load", "store"):
            self.memory(c, name)
            return
        if name in ("arange", "zeros", "full"):
            self.shape_call(c, name)
            return
        if name in ("program_id", "num_programs"):
            if len(c.args) != 1 or not (isinstance(c.args[0], ast.Constant) and c.args[0].value in (0, 1, 2)):
                raise _Refused(c, f"tl.{name} takes one axis literal 0, 1 or 2")
            return
        for a in c.args:
            self.expr(a)
        for k in c.keywords:
            self.keyword(c, k)

    def keyword(self, c: ast.Call, k: ast.keyword) -> None:
        if k.arg in STRING_KEYWORDS:
            if not (isinstance(k.value, ast.Constant) and k.value.value in STRING_KEYWORDS[k.arg]):
                raise _Refused(c, f"{k.arg} must be one of {sorted(STRING_KEYWORDS[k.arg])}")
        elif k.arg in ("dtype", "out_dtype"):
            if not _is_tl_attr(k.value, TL_DTYPES):
                raise _Refused(c, f"{k.arg} must be a tl.<dtype>")
        else:
            self.expr(k.value)

    def memory(self, c: ast.Call, name: str) -> None:
        if not c.args or len(c.args) > 3:
            raise _Refused(c, f"tl.{name} takes a pointer expression and at most 2 more positional arguments")
        ptr, off = split_pointer(c.args[0], self.pointers)
        if ptr is None:
            raise _Refused(c, f"tl.{name}'s first argument must be <pointer parameter> + <offsets> (the pointer "
                              "once, added)")
        if name == "store" and ptr not in self.outputs:
            raise _Refused(c, f"tl.store to {ptr!r}: only the outputs ({', '.join(sorted(self.outputs))}) "
                              "may be written")
        if name == "store" and len(c.args) < 2 and not any(k.arg == "value" for k in c.keywords):
            raise _Refused(c, "tl.store needs a value")
        self.expr(off)
        for a in c.args[1:]:
            self.expr(a)
        for k in c.keywords:
            self.keyword(c, k)

    def shape_call(self, c: ast.Call, name: str) -> None:
        def dim(e):
            if isinstance(e, ast.Constant) and type(e.value) is int and 0 <= e.value <= MAX_TILE:
                return
            if isinstance(e, ast.Name) and e.id in self.constexprs:
                return
            raise _Refused(c, f"tl.{name}'s shape must be integer literals up to {MAX_TILE} or constexpr "
                              "parameters")

        if name == "arange":
            if len(c.args) != 2:
                raise _Refused(c, "tl.arange takes (start, end)")
            dim(c.args[0])
            dim(c.args[1])
            return
        want = 2 if name == "zeros" else 3
        dtype = [k for k in c.keywords if k.arg == "dtype"]
        if len(c.args) + len(dtype) != want or (len(c.args) == want and dtype):
            raise _Refused(c, f"tl.{name} takes (shape{', value' if name == 'full' else ''}, dtype)")
        shape = c.args[0]
        if not isinstance(shape, (ast.Tuple, ast.List)) or not 1 <= len(shape.elts) <= 2:
            raise _Refused(c, f"tl.{name}'s shape must be a tuple or list of one or two dimensions")
        for d in shape.elts:
            dim(d)
        if name == "full":
            self.expr(c.args[1])
        dt = c.args[-1] if len(c.args) == want else dtype[0].value
        if not _is_tl_attr(dt, TL_DTYPES):
            raise _Refused(c, f"tl.{name}'s dtype must be a tl.<dtype>")


def _check_module(tree: ast.Module, op: str, function: str) -> ast.FunctionDef:
    sig = SIGNATURES[op]
    fn = None
    seen_imports = set()
    for i, node in enumerate(tree.body):
        if isinstance(node, ast.Import):
            for alias in node.names:
                form = (alias.name, alias.asname)
                if form not in (("triton", None), ("triton.language", "tl")):
                    shown = alias.name + (f" as {alias.asname}" if alias.asname else "")
                    raise _Refused(node, f"import {shown!r} is not allowed (only 'import triton' and "
                                         "'import triton.language as tl')")
                seen_imports.add(form)
        elif isinstance(node, ast.Expr) and i == 0 and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            continue  # the module's docstring
        elif isinstance(node, ast.FunctionDef):
            if fn is not None:
                raise _Refused(node, "a generated module holds exactly one kernel function")
            fn = node
        else:
            raise _Refused(node, f"top-level {type(node).__name__} is not allowed (only the two imports and one "
                                 "@triton.jit function)")
    if fn is None:
        raise _Refused(None, f"no @triton.jit function {function!r}")
    if fn.name != function:
        raise _Refused(fn, f"the kernel is named {fn.name!r}; the variant names {function!r}")
    deco = fn.decorator_list
    if len(deco) != 1 or not (isinstance(deco[0], ast.Attribute) and isinstance(deco[0].value, ast.Name)
                              and deco[0].value.id == "triton" and deco[0].attr == "jit"):
        raise _Refused(fn, "the kernel must have exactly one decorator, @triton.jit (no arguments)")
    a = fn.args
    if a.posonlyargs or a.kwonlyargs or a.vararg or a.kwarg:
        raise _Refused(fn, "the kernel takes plain positional parameters only")
    if a.defaults or a.kw_defaults:
        raise _Refused(fn, "default argument values are not allowed")
    if fn.returns is not None:
        raise _Refused(fn, "a return annotation is not allowed")
    names = tuple(p.arg for p in a.args)
    if names != sig.params:
        raise _Refused(fn, f"a generated {op} kernel takes ({', '.join(sig.params)}), not ({', '.join(names)})")
    for p in a.args:
        want = p.arg in sig.constexprs
        if want and not _is_tl_attr(p.annotation, {"constexpr"}):
            raise _Refused(p, f"parameter {p.arg!r} must be annotated tl.constexpr")
        if not want and p.annotation is not None:
            raise _Refused(p, f"parameter {p.arg!r} takes no annotation")
    _Checker(op).body(fn.body)
    return fn


class _Bounds(ast.NodeTransformer):
    """Masks every tl.load / tl.store with 0 <= offsets < _n_<pointer> (and the kernel's own mask)."""

    def __init__(self, pointers) -> None:
        self.pointers = set(pointers)

    def visit_Call(self, node: ast.Call) -> ast.Call:
        self.generic_visit(node)
        if not _is_tl_attr(node.func, {"load", "store"}):
            return node
        load = node.func.attr == "load"
        pointer, off = split_pointer(node.args[0], {n.id for n in ast.walk(node.args[0]) if isinstance(n, ast.Name)
                                                    and n.id in self.pointers})
        extra = node.args[1:]
        keywords = {k.arg: k.value for k in node.keywords}
        named = ["mask", "other"] if load else ["value", "mask"]
        for name, value in zip(named, extra):
            keywords[name] = value
        inside = ast.BinOp(
            ast.Compare(off, [ast.GtE()], [ast.Constant(0)]), ast.BitAnd(),
            ast.Compare(off, [ast.Lt()], [ast.Name(bound_name(pointer), ast.Load())]))
        mask = keywords.get("mask")
        keywords["mask"] = inside if mask is None else ast.BinOp(mask, ast.BitAnd(), inside)
        args = [ast.BinOp(ast.Name(pointer, ast.Load()), ast.Add(), off)] + ([keywords.pop("value")] if not load else [])
        return ast.Call(node.func, args, [ast.keyword(k, v) for k, v in keywords.items()])


def check_kernel(op: str, module: str, function: str, text: str) -> str:
    """Checks a generated module for ``op`` against the grammar and returns the kernel's bounded source:
    the two imports and the function, its every memory access masked, its pointers' element counts
    appended to its parameters. Raises VariantError with the line and the reason."""
    where = f"generated module {module}"
    if op not in SIGNATURES:
        raise VariantError(f"{where}: {op} cannot be generated; generated kernels exist for "
                           f"{', '.join(SIGNATURES)}")
    if not module.isidentifier() or not function.isidentifier():
        raise VariantError(f"{where}: module and function names must be identifiers")
    if len(text) > MAX_SOURCE:
        raise VariantError(f"{where}: {len(text)} characters; a generated kernel has at most {MAX_SOURCE}")
    try:
        tree = ast.parse(text, filename=f"{module}.py")
    except (SyntaxError, ValueError) as e:
        raise VariantError(f"{where}: not valid Python: {getattr(e, 'msg', e)} "
                           f"(line {getattr(e, 'lineno', '?')})") from None
    except (RecursionError, MemoryError):
        raise VariantError(f"{where}: nested too deeply") from None
    try:
        fn = _check_module(tree, op, function)
    except _Refused as e:
        line = f", line {e.line}" if e.line else ""
        raise VariantError(f"{where}{line}: {e}") from None
    except RecursionError:
        raise VariantError(f"{where}: nested too deeply") from None
    sig = SIGNATURES[op]
    fn = _Bounds(sig.pointers).visit(fn)
    fn.args.args += [ast.arg(bound_name(p)) for p in sig.pointers]
    body = [ast.Import([ast.alias("triton")]), ast.Import([ast.alias("triton.language", "tl")]), fn]
    out = ast.Module(body, [])
    ast.fix_missing_locations(out)
    return ast.unparse(out) + "\n"

"""How far a job travels through the code, and which way the imports point: read from the source
(`ast`), nothing imported or run.

    uv run python -m tests.call_graph            # the walk of `job` from vlm_caption, the imports

**The walk of a job** starts at `flows.caption.vlm_caption`, whose parameter `job` holds the
job, and follows the job down the calls. Its rules:

1. A *stop* is one function or method of a product module (flows/, tasks/, recipes/) the walk
   reaches; each is counted once, however often it is reached, and so is its module.
2. What *holds the job*: the CaptionJob; an object of a class with a field (annotated, or a
   property with a return annotation) that holds it (`RunPlan.job`); an object
   a product class builds from an argument that holds it (`Holder(plan, ...)`); what a
   function returns where its return annotation is such a class, or where it returns the
   parameter it was handed the job in (or that parameter's `model_copy`, alone or in a tuple); a
   name assigned from any of these (`=`, `for`, `with ... as`, `:=`, a comprehension, `a or b`,
   `a if c else b`; every name of a tuple unpacked from one).
3. A call is followed when one of its arguments reads a name that holds the job (the job itself,
   or a field of it: `get_recipe(job.recipe)` is a stop), or when it is a method called on such a
   name of a known class. In the callee, the parameters handed something that holds the job hold
   it (a `*args` or `**kwargs` parameter, anything it collects), and so does `self` where the
   method was reached through such an object or is a constructor.
4. A callee is resolved as Python would bind it in that module: a function or class defined
   there, or imported (followed through re-exports such as `recipes/__init__.py`), a function
   of an imported module (`module.f`), a method through `self`, or through a name whose class
   is known: a parameter annotated with a product class, or a name assigned from a product
   class's constructor or from a call annotated to return one. `task.submit(...)`, `.map`,
   `.fn` call the task's function. Calling a product class reaches its `__init__` and
   `__post_init__` (a stop each, where defined); a plain dataclass or pydantic model runs none
   of our code, so it is no stop. A product function passed as an argument of a followed call
   (a thread's target, a pool's function) is followed too, all its parameters holding the job.
5. Nested functions and lambdas are part of the function they are in: their calls are that
   function's, and they are not stops of their own. A nested function called with a lambda
   (`check(lambda: resolve_source(job))`) returns what the lambda does.
6. Not followed (what `ast` cannot know without running): calls on objects of unknown class,
   properties (reading an attribute is no call), what a framework calls (pydantic's validators,
   Prefect's hooks), `getattr` and other dynamic calls.

**The imports** (`import_edges`) are every import of one product module by another, at the top
of a module or inside a function (a lazy import still ties the two), except those under
`if TYPE_CHECKING:`. `import_cycles` and `upward_imports` look at all of them (a cycle through a
lazy import is a cycle of the design, even where it does not bite at import time): the layers are flows -> tasks ->
recipes, so tasks never imports flows and recipes imports neither. `tool_imports`: a tool beside
the product (TOOLS: bench/, which may import the product) is never imported by it, at the top of
a module or inside a function (the CLI names the bench's functions as strings, flows/cli.py).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("flows", "tasks", "recipes")  # the product's code, top layer first
TOOLS = ("bench",)  # beside the product: they import it, it never imports them
NAMESPACE = "vlm_caption."  # installed, the packages live under it; the repository names them without it
SIZE_CHECKED = ("flows", "tasks", "recipes", "deployments", *TOOLS)  # no module over 300 lines here
TASK_METHODS = {"submit", "map", "fn", "delay"}


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    defs: dict[str, ast.AST] = field(default_factory=dict)  # "f", "Class", "Class.method"
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # local name -> (module, attr)

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    top_level: bool  # run when `source` is imported (not inside a function)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def load_modules(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, Module]:
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            name = module_name(path, root)
            module = Module(name, path, ast.parse(path.read_text(encoding="utf-8"), str(path)))
            for node in module.tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    module.defs[node.name] = node
                if isinstance(node, ast.ClassDef):
                    for item in node.body:
                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            module.defs[f"{node.name}.{item.name}"] = item
            for node, _ in _imports(module):
                for alias in node.names:
                    if isinstance(node, ast.Import):
                        local = alias.asname or alias.name.split(".")[0]
                        module.imports[local] = (alias.name if alias.asname else local, None)
                    else:
                        module.imports[alias.asname or alias.name] = (_absolute(module, node), alias.name)
            modules[name] = module
    return modules


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.name.split(".")
    base = base if module.is_package else base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def _in_repository(node: ast.Import | ast.ImportFrom) -> ast.Import | ast.ImportFrom:
    """The import as the repository names its modules: `vlm_caption.tasks.x` is `tasks.x`."""
    def local(name: str | None) -> str | None:
        return name[len(NAMESPACE):] if name and name.startswith(NAMESPACE) else name

    if isinstance(node, ast.ImportFrom) and node.module == NAMESPACE[:-1]:  # from vlm_caption import flows
        return ast.Import(names=node.names, lineno=node.lineno)
    names = [ast.alias(name=local(alias.name), asname=alias.asname) for alias in node.names]
    if isinstance(node, ast.Import):
        return ast.Import(names=names, lineno=node.lineno)
    return ast.ImportFrom(module=local(node.module), names=node.names, level=node.level, lineno=node.lineno)


def _imports(module: Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement of a module but those under `if TYPE_CHECKING:`, with whether it
    runs at import time."""

    def visit(nodes: list[ast.stmt], top: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield _in_repository(node), top
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                yield from visit(node.orelse, top)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from visit(node.body, False)
            elif isinstance(node, ast.ClassDef):
                yield from visit(node.body, top)
            else:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.stmt):
                        yield from visit([child], top)
                    elif isinstance(child, (ast.excepthandler, ast.match_case)):
                        yield from visit(child.body, top)

    yield from visit(module.tree.body, True)


# ---- the imports -----------------------------------------------------------------------------
def import_edges(modules: dict[str, Module]) -> set[Import]:
    edges = set()
    for module in modules.values():
        for node, top in _imports(module):
            for alias in node.names:
                if isinstance(node, ast.Import):
                    target = alias.name
                else:
                    base = _absolute(module, node)
                    target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                if target in modules and target != module.name:
                    edges.add(Import(module.name, target, top))
    return edges


def import_cycles(modules: dict[str, Module], unit: Callable[[str], str] | None = None) -> list[list[str]]:
    """The groups of modules that import each other, at the top or inside a function (strongly
    connected); with `unit`, of the units it maps each module to (its sub-package, say)."""
    unit = unit or (lambda name: name)
    graph: dict[str, set[str]] = {unit(name): set() for name in modules}
    for edge in import_edges(modules):
        if unit(edge.source) != unit(edge.target):
            graph[unit(edge.source)].add(unit(edge.target))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for after in graph[node]:
            if after not in index:
                connect(after)
                low[node] = min(low[node], low[after])
            elif after in stack:
                low[node] = min(low[node], index[after])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return cycles


def layer(module: str) -> int:
    return len(PACKAGES) - PACKAGES.index(module.split(".")[0])


def upward_imports(modules: dict[str, Module]) -> list[Import]:
    """Imports from a lower layer into a higher one (tasks -> flows, recipes -> tasks or flows)."""
    return sorted((e for e in import_edges(modules) if layer(e.target) > layer(e.source)),
                  key=lambda e: (e.source, e.target))


def tool_imports(modules: dict[str, Module]) -> list[str]:
    """Imports of a tool (TOOLS) by a product module, at the top or inside a function, each as
    "module:line -> imported"."""
    found = []
    for module in modules.values():
        for node, _ in _imports(module):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) \
                else [_absolute(module, node)]
            found += [f"{module.name}:{node.lineno} -> {name}" for name in names if name.split(".")[0] in TOOLS]
    return sorted(found)


def long_modules(limit: int = 300, root: Path = ROOT) -> dict[str, int]:
    """Product modules over `limit` lines."""
    lines = {}
    for package in SIZE_CHECKED:
        for path in sorted((root / package).rglob("*.py")):
            count = len(path.read_text(encoding="utf-8").splitlines())
            if count > limit:
                lines[str(path.relative_to(root))] = count
    return lines


# ---- the walk --------------------------------------------------------------------------------
Key = tuple[str, str]  # (module, "function" or "Class.method")


class Walk:
    """The functions a marked value reaches from a start (the rules: this module's docstring)."""

    def __init__(self, modules: dict[str, Module]):
        self.modules = modules
        self.marked: dict[Key, set[str]] = {}  # each stop and its marked parameters
        self.holders: set[str] = set()  # the classes whose objects hold the job
        self.local_defs: set[str] = set()  # the functions nested in the stop being read

    @property
    def stops(self) -> list[Key]:
        return sorted(self.marked)

    @property
    def module_names(self) -> list[str]:
        return sorted({module for module, _ in self.marked})

    def run(self, start: Key, params: Iterable[str]) -> Walk:
        node = self.modules[start[0]].defs[start[1]]
        self.holders |= {cls for arg in _arguments(node) if arg.arg in params
                         and (cls := self._class_of(start[0], arg.annotation))}
        todo = [(start, set(params))]
        while todo:
            key, params = todo.pop()
            known = self.marked.setdefault(key, set())
            if known and params <= known:
                continue
            known |= params
            todo.extend(self._calls(key, known))
        return self

    # -- resolving names
    def resolve(self, module: str, name: str, seen: frozenset = frozenset()) -> tuple[str, str] | None:
        """What `name` is in `module`: ("def", key), ("module", name), or None (not ours)."""
        if (module, name) in seen or module not in self.modules:
            return None
        mod = self.modules[module]
        if name in mod.defs:
            return "def", f"{module}:{name}"
        if name in mod.imports:
            source, attr = mod.imports[name]
            if attr is None:
                return ("module", source) if source in self.modules else None
            if f"{source}.{attr}" in self.modules:
                return "module", f"{source}.{attr}"
            return self.resolve(source, attr, seen | {(module, name)})
        return None

    def _def(self, ref: str) -> tuple[Key, ast.AST]:
        module, name = ref.split(":")
        return (module, name), self.modules[module].defs[name]

    def _method(self, class_ref: str, name: str) -> Key | None:
        """`name` on the class, or on a product base class of it."""
        (module, cls), node = self._def(class_ref)
        if f"{cls}.{name}" in self.modules[module].defs:
            return module, f"{cls}.{name}"
        for base in node.bases:
            if isinstance(base, ast.Name) and (found := self.resolve(module, base.id)) and found[0] == "def":
                if isinstance(self._def(found[1])[1], ast.ClassDef) and (key := self._method(found[1], name)):
                    return key
        return None

    def _class_of(self, module: str, expr: ast.AST | None) -> str | None:
        """The product class an annotation or constructor call names, if any."""
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            try:
                expr = ast.parse(expr.value, mode="eval").body
            except SyntaxError:
                return None
        if isinstance(expr, ast.BinOp):  # `Spec | None`
            return self._class_of(module, expr.left) or self._class_of(module, expr.right)
        found = None
        if isinstance(expr, ast.Name):
            found = self.resolve(module, expr.id)
        elif isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            outer = self.resolve(module, expr.value.id)
            found = self.resolve(outer[1], expr.attr) if outer and outer[0] == "module" else None
        if found and found[0] == "def" and isinstance(self._def(found[1])[1], ast.ClassDef):
            return found[1]
        return None

    # -- what holds the job
    def _field_class(self, class_ref: str, attr: str) -> str | None:
        """The product class a class's annotated field `attr` holds (or a base class's)."""
        (module, cls), node = self._def(class_ref)
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.target.id == attr:
                return self._class_of(module, item.annotation)
            if isinstance(item, ast.FunctionDef) and item.name == attr and _is_property(item):
                return self._class_of(module, item.returns)
        for base in node.bases:
            if isinstance(base, ast.Name) and (found := self.resolve(module, base.id)) and found[0] == "def":
                if isinstance(self._def(found[1])[1], ast.ClassDef) and (held := self._field_class(found[1], attr)):
                    return held
        return None

    def _passes_back(self, module: str, call: ast.Call, marked: set[str], types: dict[str, str]) -> bool:
        """A call to a function that returns a parameter it was handed the job in (or a pydantic
        copy of it): what `ast` shows where no return annotation says it (tasks cannot name flows'
        CaptionJob)."""
        for (callee_module, name), bound in self._callees(module, call, types, self.local_defs):
            node = self.modules[callee_module].defs[name]
            positional = [a.arg for a in [*node.args.posonlyargs, *node.args.args]][1 if bound else 0:]
            given = dict(zip(positional, call.args)) | {k.arg: k.value for k in call.keywords if k.arg}
            for ret in (n for n in ast.walk(node) if isinstance(n, ast.Return) and n.value is not None):
                for value in ret.value.elts if isinstance(ret.value, ast.Tuple) else [ret.value]:
                    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) \
                            and value.func.attr == "model_copy":
                        value = value.func.value
                    if isinstance(value, ast.Name) and value.id in given \
                            and self._holds_job(module, given[value.id], marked, types):
                        return True
        return False

    def _is_holder(self, class_ref: str, seen: frozenset = frozenset()) -> bool:
        """A class of the job, or one with a field that holds the job (RunPlan's `job`)."""
        if class_ref in self.holders:
            return True
        if class_ref in seen:
            return False
        (module, _), node = self._def(class_ref)
        fields = [self._class_of(module, item.annotation) for item in node.body if isinstance(item, ast.AnnAssign)]
        if any(held and self._is_holder(held, seen | {class_ref}) for held in fields):
            self.holders.add(class_ref)
            return True
        return False

    def _type_of(self, module: str, expr: ast.AST, types: dict[str, str]) -> str | None:
        """The product class of an expression, where the source says it."""
        if isinstance(expr, ast.Name):
            return types.get(expr.id)
        if isinstance(expr, ast.Attribute) and (owner := self._type_of(module, expr.value, types)):
            return self._field_class(owner, expr.attr)
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id in self.local_defs:
            wrapped = [arg.body for arg in expr.args if isinstance(arg, ast.Lambda)]  # check(lambda: f(job))
            return next((cls for part in wrapped if (cls := self._type_of(module, part, types))), None)
        if isinstance(expr, ast.Call):
            if (cls := self._class_of(module, expr.func)) is not None:
                return cls
            for (callee_module, name), _ in self._callees(module, expr, types, set()):
                node = self.modules[callee_module].defs[name]
                if not name.endswith(("__init__", "__post_init__")):
                    return self._class_of(callee_module, getattr(node, "returns", None))
        return None

    def _holds_job(self, module: str, expr: ast.AST, marked: set[str], types: dict[str, str]) -> bool:
        """The job itself, or an object that holds it: a marked name, a field of a job-holding
        class, what a function returns as one, or an object built from one."""
        if isinstance(expr, ast.Name):
            return expr.id in marked
        if isinstance(expr, (ast.IfExp, ast.BoolOp)):
            parts = [expr.body, expr.orelse] if isinstance(expr, ast.IfExp) else expr.values
            return any(self._holds_job(module, part, marked, types) for part in parts)
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "model_copy":
            return self._holds_job(module, expr.func.value, marked, types)  # a pydantic copy of the job
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id in self.local_defs:
            return any(self._holds_job(module, arg.body, marked, types)  # check(lambda: resolve(job))
                       for arg in expr.args if isinstance(arg, ast.Lambda))
        cls = self._type_of(module, expr, types)
        if cls is not None and self._is_holder(cls):
            return True
        if isinstance(expr, ast.Call) and self._passes_back(module, expr, marked, types):
            return True
        if isinstance(expr, ast.Call) and cls is not None and self._class_of(module, expr.func) == cls:
            given = [*expr.args, *(k.value for k in expr.keywords)]
            if any(self._holds_job(module, arg, marked, types) for arg in given):
                self.holders.add(cls)  # built from the job: it holds it
                return True
        return False

    # -- one stop
    def _calls(self, key: Key, params: set[str]) -> list[tuple[Key, set[str]]]:
        module, qualname = key
        node = self.modules[module].defs[qualname]
        marked = set(params)
        types: dict[str, str] = {}
        if "." in qualname:
            types["self"] = f"{module}:{qualname.split('.')[0]}"
        for arg in _arguments(node):
            if (cls := self._class_of(module, arg.annotation)) is not None:
                types[arg.arg] = cls
        inner = list(ast.walk(node))
        local_defs = self.local_defs = {n.name for n in inner[1:] if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for _ in range(len(inner)):  # to a fixed point: an assignment may read a later one's name
            before = len(marked), len(types)
            for target, value in _assignments(inner):
                names = _names(target)
                if isinstance(target, ast.Name) and (cls := self._type_of(module, value, types)) is not None:
                    types[target.id] = cls
                if self._holds_job(module, value, marked, types):
                    marked |= names
            if (len(marked), len(types)) == before:
                break
        found = []
        for call in (n for n in inner if isinstance(n, ast.Call)):
            given = [*call.args, *(k.value for k in call.keywords)]
            receiver = call.func.value if isinstance(call.func, ast.Attribute) else None
            on_marked = isinstance(receiver, ast.Name) and receiver.id in marked and receiver.id in types
            if not on_marked and not any(_reads(arg, marked) for arg in given):
                continue
            for callee, bound in self._callees(module, call, types, local_defs):
                found.append((callee, self._marked_params(module, callee, call, marked, types, bound, on_marked)))
            for arg in call.args:  # a product function handed to a thread or a pool
                if isinstance(arg, ast.Name) and arg.id not in local_defs:
                    ref = self.resolve(module, arg.id)
                    if ref and ref[0] == "def" and not isinstance(self._def(ref[1])[1], ast.ClassDef):
                        callee, target = self._def(ref[1])
                        found.append((callee, {a.arg for a in _arguments(target)}))
        return found

    def _callees(self, module: str, call: ast.Call, types: dict[str, str],
                 local_defs: set[str]) -> list[tuple[Key, bool]]:
        """What a call reaches, each with whether its first parameter is bound (a method)."""
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr in TASK_METHODS:
            func = func.value  # a Prefect task's submit/map: its function
        ref = None
        if isinstance(func, ast.Name):
            if func.id in local_defs:
                return []  # part of this stop
            ref = self.resolve(module, func.id)
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            owner = func.value.id
            if owner in types:
                key = self._method(types[owner], func.attr)
                return [(key, True)] if key else []
            outer = self.resolve(module, owner)
            if outer and outer[0] == "module":
                ref = self.resolve(outer[1], func.attr)
            elif outer and outer[0] == "def" and isinstance(self._def(outer[1])[1], ast.ClassDef):
                key = self._method(outer[1], func.attr)  # Class.method(...) or a classmethod
                return [(key, _is_bound(self.modules[key[0]].defs[key[1]]))] if key else []
        if not ref or ref[0] != "def":
            return []
        key, node = self._def(ref[1])
        if isinstance(node, ast.ClassDef):
            return [(method, True) for name in ("__init__", "__post_init__")
                    if (method := self._method(ref[1], name))]
        return [(key, False)]

    def _marked_params(self, module: str, callee: Key, call: ast.Call, marked: set[str], types: dict[str, str],
                       bound: bool, on_marked: bool) -> set[str]:
        node = self.modules[callee[0]].defs[callee[1]]
        args = node.args
        positional = [a.arg for a in [*args.posonlyargs, *args.args]]
        if bound and positional:
            first, positional = positional[0], positional[1:]
            out = {first} if on_marked or callee[1].endswith(("__init__", "__post_init__")) else set()
        else:
            out = set()
        for i, arg in enumerate(call.args):
            if self._holds_job(module, arg.value if isinstance(arg, ast.Starred) else arg, marked, types):
                if isinstance(arg, ast.Starred) or i >= len(positional):
                    out |= {args.vararg.arg} if args.vararg else set(positional[i:])
                else:
                    out.add(positional[i])
        names = {*positional, *(a.arg for a in args.kwonlyargs)}
        for keyword in call.keywords:
            if self._holds_job(module, keyword.value, marked, types):
                if keyword.arg in names:
                    out.add(keyword.arg)
                elif args.kwarg:
                    out.add(args.kwarg.arg)
        return out


def _is_property(node: ast.FunctionDef) -> bool:
    return any(ast.unparse(d).endswith("property") for d in node.decorator_list)


def _is_bound(node: ast.AST) -> bool:
    decorators = {ast.unparse(d) for d in getattr(node, "decorator_list", [])}
    return "staticmethod" not in decorators


def _arguments(node: ast.AST) -> list[ast.arg]:
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return []
    args = node.args
    return [*args.posonlyargs, *args.args, *([args.vararg] if args.vararg else []), *args.kwonlyargs,
            *([args.kwarg] if args.kwarg else [])]


def _assignments(nodes: list[ast.AST]) -> Iterator[tuple[ast.AST, ast.AST]]:
    for node in nodes:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                yield target, node.value
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and node.value is not None:
            yield node.target, node.value
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            yield node.target, node.iter
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            yield node.optional_vars, node.context_expr


def _names(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _reads(expr: ast.AST, marked: set[str]) -> bool:
    return any(isinstance(n, ast.Name) and n.id in marked for n in ast.walk(expr))


def walk_job(modules: dict[str, Module] | None = None) -> Walk:
    """The walk of `job` from `flows.caption.vlm_caption`."""
    return Walk(modules or load_modules()).run(("flows.caption", "vlm_caption"), {"job"})


def main() -> None:
    modules = load_modules()
    walk = walk_job(modules)
    print(f"walk of job from vlm_caption: {len(walk.stops)} stops in {len(walk.module_names)} modules")
    for module in walk.module_names:
        print(f"  {module}: {', '.join(name for m, name in walk.stops if m == module)}")
    print(f"import cycles: {import_cycles(modules) or 'none'}")
    print("upward imports:", [f"{e.source} -> {e.target}" for e in upward_imports(modules)] or "none")
    print(f"modules over 300 lines: {long_modules() or 'none'}")


if __name__ == "__main__":
    main()

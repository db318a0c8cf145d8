"""The code a stage can execute, found from the project's source without running it.

From a stage's entry points (its body, its input function, and the engine objects a body calls: the
ConfigView it reads the config through), follow every name the code uses: module-level and
function-local imports (`import x`, `from x import y`), module-level values (constants, dicts, tuples:
their assignment statement), functions and classes (with their decorators, default arguments, methods
and class attributes), `module.attr` chains, and strings naming project code (`"stages.train:worker"`).
Each object is hashed by its syntax tree (`ast.dump`), so a change to a comment or to formatting reruns
nothing, and any change to what runs reruns every stage that can reach it.

What cannot be resolved statically falls back to the whole module's source: a project module used as a
value (passed, returned, stored), `getattr(module, computed)`, `importlib`, `__import__`, `globals()`,
`vars()`, `eval`, `exec`, or a name the module does not bind at top level. Each module reached also
contributes its top-level statements that bind no name (`if`, `for`, calls run at import).

Only code under the project packages (`stages`, `flows`) is followed; third-party code is covered by the
library versions in the key.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

PROJECT_PACKAGES = ("stages", "flows")
DYNAMIC_CALLS = {"getattr", "globals", "vars", "eval", "exec", "__import__", "locals"}
CODE_STRING = re.compile(r"^((?:stages|flows)(?:\.\w+)+)[:.](\w+)$")
WHOLE = "<module>"  # object name for a module taken whole
PREAMBLE = "<preamble>"  # object name for a module's top-level statements that bind no name


def is_project(module: str) -> bool:
    return module.split(".")[0] in PROJECT_PACKAGES


@dataclass
class ModuleInfo:
    """One project module's top level: what each name is bound to."""

    name: str
    source: str
    tree: ast.Module
    defs: dict[str, list[ast.stmt]] = field(default_factory=dict)  # name -> def/class/assign statements
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # name -> (module, attr)
    preamble: list[ast.stmt] = field(default_factory=list)


@functools.lru_cache(maxsize=256)
def _parse(source: str) -> ast.Module:
    return ast.parse(source)


def _import_targets(node: ast.Import | ast.ImportFrom, package: str) -> dict[str, tuple[str, str | None]]:
    """Local name -> (module, attribute or None) for one import statement."""
    out: dict[str, tuple[str, str | None]] = {}
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.asname:
                out[a.asname] = (a.name, None)
            else:  # `import a.b.c` binds `a`
                out[a.name.split(".")[0]] = (a.name.split(".")[0], None)
        return out
    base = node.module or ""
    if node.level:
        parts = package.split(".")
        parent = ".".join(parts[: len(parts) - node.level + 1])
        base = f"{parent}.{base}" if base else parent
    for a in node.names:
        if a.name != "*":
            out[a.asname or a.name] = (base, a.name)
    return out


def _bound_names(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [stmt.name]
    targets: list[ast.expr] = []
    if isinstance(stmt, ast.Assign):
        targets = stmt.targets
    elif isinstance(stmt, ast.AnnAssign | ast.AugAssign):
        targets = [stmt.target]
    names = []
    for t in targets:
        for n in ast.walk(t):
            if isinstance(n, ast.Name):
                names.append(n.id)
    return names


class CodeGraph:
    """Project modules read from `root` (a source tree: root/stages/..., root/flows/...). `sources`
    replaces a module's text (mutation tests)."""

    def __init__(self, root: Path, sources: dict[str, str] | None = None):
        self.root = Path(root)
        self.sources = sources or {}
        self._modules: dict[str, ModuleInfo | None] = {}
        self._objects: dict[tuple[str, str], tuple[str, set[tuple[str, str]]]] = {}  # (dump, references)

    # ------------------------------------------------------------ modules
    def path_of(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for p in (base.with_suffix(".py"), base / "__init__.py"):
            if p.is_file():
                return p
        return None

    def _is_package(self, module: str) -> bool:
        return (self.path_of(module) or Path()).name == "__init__.py"

    def is_module(self, module: str) -> bool:
        return is_project(module) and (module in self.sources or self.path_of(module) is not None)

    def module(self, name: str) -> ModuleInfo | None:
        if name not in self._modules:
            self._modules[name] = self._load(name)
        return self._modules[name]

    def _load(self, name: str) -> ModuleInfo | None:
        if name in self.sources:
            source = self.sources[name]
        else:
            path = self.path_of(name)
            if path is None:
                return None
            source = path.read_text()
        tree = _parse(source)
        package = name if self._is_package(name) else name.rpartition(".")[0]
        info = ModuleInfo(name, source, tree)
        for stmt in tree.body:
            if isinstance(stmt, ast.Import | ast.ImportFrom):
                if not (isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__"):
                    info.imports.update(_import_targets(stmt, package))
                continue
            names = _bound_names(stmt)
            if names:
                for n in names:
                    info.defs.setdefault(n, []).append(stmt)
            elif not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):  # docstrings
                info.preamble.append(stmt)
        return info

    # ------------------------------------------------------------ resolving names
    def resolve(self, module: str, name: str) -> tuple[str, str] | None:
        """Where `name`, bound at module level in `module`, is defined: (module, name) of the object,
        (module, WHOLE) for a module, None outside the project."""
        seen = set()
        while (module, name) not in seen:
            seen.add((module, name))
            info = self.module(module)
            if info is None:
                return None
            if name in info.defs:
                return module, name
            if name in info.imports:
                target, attr = info.imports[name]
                if not is_project(target):
                    return None
                if attr is None:
                    return (target, WHOLE) if self.is_module(target) else None
                if self.is_module(f"{target}.{attr}"):
                    return f"{target}.{attr}", WHOLE
                module, name = target, attr
                continue
            if self.is_module(f"{module}.{name}"):  # a submodule reached as a package attribute
                return f"{module}.{name}", WHOLE
            return module, WHOLE  # not bound statically (star import, setattr at import): the whole module
        return module, WHOLE

    # ------------------------------------------------------------ references of one statement
    def references(self, module: str, stmt: ast.AST) -> set[tuple[str, str]]:
        """Objects (module, name) that a top-level statement can reach."""
        info = self.module(module)
        assert info is not None
        local_imports: dict[str, tuple[str, str | None]] = {}
        package = module if self._is_package(module) else module.rpartition(".")[0]
        annotations: set[int] = set()
        for node in ast.walk(stmt):
            if isinstance(node, ast.Import | ast.ImportFrom):
                if not (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
                    local_imports.update(_import_targets(node, package))
            elif isinstance(node, ast.arg) and node.annotation is not None:
                annotations |= {id(n) for n in ast.walk(node.annotation)}
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None:
                annotations |= {id(n) for n in ast.walk(node.returns)}
            elif isinstance(node, ast.AnnAssign) and not isinstance(node.target, ast.Name):
                annotations |= {id(n) for n in ast.walk(node.annotation)}

        def name_ref(ident: str) -> tuple[str, str] | None:
            if ident in local_imports:
                target, attr = local_imports[ident]
                if not is_project(target):
                    return None
                if attr is None:
                    return (target, WHOLE) if self.is_module(target) else None
                if self.is_module(f"{target}.{attr}"):
                    return f"{target}.{attr}", WHOLE
                return self.resolve(target, attr)
            if ident in info.defs or ident in info.imports:
                return self.resolve(module, ident)
            return None  # a local variable, a parameter or a builtin

        def expr_ref(node: ast.expr) -> tuple[str, str] | None:
            if isinstance(node, ast.Name):
                return name_ref(node.id)
            if isinstance(node, ast.Attribute):
                base = expr_ref(node.value)
                if base is None:
                    return None
                if base[1] == WHOLE:  # attribute of a project module
                    sub = f"{base[0]}.{node.attr}"
                    return (sub, WHOLE) if self.is_module(sub) else self.resolve(base[0], node.attr)
                return base  # attribute of a class or value: the object covers it
            return None

        out: set[tuple[str, str]] = set()
        consumed: set[int] = set()  # Name/Attribute nodes resolved as part of a longer chain
        for node in ast.walk(stmt):
            if id(node) in annotations or id(node) in consumed:
                continue
            if isinstance(node, ast.Attribute):
                ref = expr_ref(node)
                if ref is not None:
                    out.add(ref)
                    consumed |= {id(n) for n in ast.walk(node.value)}
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                ref = name_ref(node.id)
                if ref is not None:
                    out.add(ref)  # a module used as a value: (module, WHOLE)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                m = CODE_STRING.match(node.value)
                if m and self.is_module(m.group(1)):
                    ref = self.resolve(m.group(1), m.group(2))
                    if ref:
                        out.add(ref)
            elif isinstance(node, ast.Call):
                fn = node.func
                fname = fn.id if isinstance(fn, ast.Name) else ""  # builtins only: `model.eval()` is no eval
                if fname in DYNAMIC_CALLS or ast.unparse(fn) in ("importlib.import_module", "import_module"):
                    target = node.args[0] if node.args else None
                    ref = expr_ref(target) if isinstance(target, ast.expr) else None
                    if fname == "getattr" and len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                        if ref is not None and ref[1] == WHOLE:
                            out.add(self.resolve(ref[0], str(node.args[1].value)) or ref)
                        continue
                    if fname == "getattr" and ref is None:
                        continue  # getattr on a third-party object or a local value
                    out.add(ref if ref is not None and ref[1] == WHOLE else (module, WHOLE))
        return out

    # ------------------------------------------------------------ closure
    def closure(self, roots: list[tuple[str, str]]) -> dict[str, str]:
        """"module.name" -> ast dump of every object reachable from roots (WHOLE: the whole module)."""
        seen: dict[str, str] = {}
        todo = list(roots)
        modules_done: set[str] = set()
        while todo:
            module, name = todo.pop()
            info = self.module(module)
            if info is None:
                continue
            if module not in modules_done:
                modules_done.add(module)
                if info.preamble:
                    todo.append((module, PREAMBLE))
                parent = module.rpartition(".")[0]
                if parent:  # importing a module runs its packages' __init__ first
                    todo.append((parent, PREAMBLE))
            ident = f"{module}.{name}"
            if ident in seen:
                continue
            found = self._object(module, name)
            if found is None:  # not bound at top level: the whole module
                todo.append((module, WHOLE))
                continue
            seen[ident], refs = found
            todo.extend(refs)
        return dict(sorted(seen.items()))

    def _object(self, module: str, name: str) -> tuple[str, set[tuple[str, str]]] | None:
        """(what is hashed, what it references) for one object; None when the module does not bind it."""
        if (module, name) not in self._objects:
            info = self.module(module)
            assert info is not None
            if name == WHOLE:
                refs = {r for stmt in info.tree.body for r in self.references(module, stmt) if r != (module, WHOLE)}
                self._objects[module, name] = (ast.dump(info.tree), refs)
            else:
                stmts = info.preamble if name == PREAMBLE else info.defs.get(name)
                if stmts is None:
                    return None
                refs = {r for s in stmts for r in self.references(module, s)}
                self._objects[module, name] = ("\n".join(ast.dump(s) for s in stmts), refs)
        return self._objects[module, name]


_SHARED: dict[Path, tuple[tuple, CodeGraph]] = {}


def source_signature(root: Path) -> tuple:
    """(path, inode, size, mtime_ns, ctime_ns) of every source file of the project packages: any edit,
    added or removed file changes it."""
    files = sorted(p for pkg in PROJECT_PACKAGES for p in (root / pkg).rglob("*.py"))
    return tuple((str(p), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) for p in files if (st := p.stat()))


def code_graph(root: Path) -> CodeGraph:
    """The project's code graph, reused within a process while no source file changed."""
    signature = source_signature(root)
    cached = _SHARED.get(root)
    if cached is None or cached[0] != signature:
        cached = (signature, CodeGraph(root))
        _SHARED[root] = cached
    return cached[1]

"""The layering the code promises (docs/architecture.md), checked on the source."""

from __future__ import annotations

import ast
import functools
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "ckptd"
STEP_FIELDS = (
    "state|error|manifest|remote_nodes|peers|pinned|adopted|busy|read_at|local_at|durable_at"
    "|created_unix|handoff_at|milestone|metrics|node_ranks|world_size"
)


@functools.cache
def parse(path: Path) -> ast.Module:
    """``ast.parse`` on a fresh thread: CPython 3.11 (gh-106905) can sometimes
    raise "AST constructor recursion depth mismatch" when the calling thread's
    recursion counter was left off by earlier code (here, other tests)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(ast.parse, path.read_text()).result()


def imports(path: Path) -> set[str]:
    tree = parse(path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


# The daemon's floors (docs/architecture.md, "Floors"): a module imports only from its
# own floor or below. Packages not named here are unplaced (a test fails on them); a
# module directly under daemon/ is on the ground floor, except the entry point.
GROUND, TIERS, LIFECYCLE, API, APP = range(5)
FLOORS = {
    "catalog": GROUND,
    "local": TIERS,
    "remote": TIERS,
    "peer": TIERS,
    "retention": LIFECYCLE,
    "lifecycle": LIFECYCLE,
    "restore": LIFECYCLE,
    "adopt": LIFECYCLE,
    "api": API,
    "app": APP,
    "__main__": APP,
}
FLOOR_NAMES = ("ground", "tiers", "lifecycle", "api", "app")


def module_names(src: Path) -> dict[str, Path]:
    """Every module under ``src`` (the ``ckptd`` package) by dotted name."""
    names = {}
    for path in src.rglob("*.py"):
        parts = ("ckptd", *path.relative_to(src).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


@functools.cache
def import_edges(src: Path) -> dict[str, set[str]]:
    """module -> the modules of the package it imports: every ``import`` and ``from``
    statement anywhere in the file (under ``if TYPE_CHECKING:`` and inside functions
    too), relative ones resolved, ``from pkg import mod`` counted as ``pkg.mod``."""
    names = module_names(src)
    edges: dict[str, set[str]] = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names
                ]
            else:
                continue
            found |= {t for t in targets if t in names and t != name}
        edges[name] = found
    return edges


def floor_of(module: str) -> int | None:
    """The floor of a daemon module (None: a package the table does not place)."""
    parts = module.split(".")[2:]
    if not parts:
        return GROUND  # the daemon package's face
    if len(parts) == 1 and parts[0] not in FLOORS and (SRC / "daemon" / f"{parts[0]}.py").exists():
        return GROUND
    return FLOORS.get(parts[0])


def unit_of(module: str) -> str:
    """The package (or top-level module) of the daemon a module belongs to."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else "daemon"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_daemon_package_stands_on_a_floor() -> None:
    unplaced = [
        p.name
        for p in (SRC / "daemon").iterdir()
        if p.is_dir() and (p / "__init__.py").exists() and p.name not in FLOORS
    ]
    assert unplaced == [], f"add these packages to FLOORS (and docs/architecture.md): {unplaced}"


def test_no_daemon_module_imports_a_floor_above_its_own() -> None:
    upward = [
        f"{a} ({FLOOR_NAMES[fa]}) imports {b} ({FLOOR_NAMES[fb]})"
        for a, targets in sorted(import_edges(SRC).items())
        if a.startswith("ckptd.daemon") and (fa := floor_of(a)) is not None
        for b in sorted(targets)
        if b.startswith("ckptd.daemon") and (fb := floor_of(b)) is not None and fb > fa
    ]
    assert upward == []


def test_no_import_cycle_between_modules() -> None:
    assert cycles(import_edges(SRC)) == []


def test_no_import_cycle_between_daemon_packages() -> None:
    """Lateral imports on one floor are allowed only one way between two packages."""
    units: dict[str, set[str]] = {}
    for a, targets in import_edges(SRC).items():
        if a.startswith("ckptd.daemon."):
            units.setdefault(unit_of(a), set()).update(
                unit_of(b) for b in targets if b.startswith("ckptd.daemon.")
            )
    for unit, targets in units.items():
        targets.discard(unit)
    assert cycles(units) == []


def test_no_daemon_service_takes_an_untyped_configuration() -> None:
    """Each service gets its typed option group (app/options.py) or plain values, never
    the whole configuration as ``Any``."""
    untyped = []
    for p in (SRC / "daemon").rglob("*.py"):
        for node in ast.walk(parse(p)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                untyped += [
                    f"{p.relative_to(SRC)}:{node.lineno}: {node.name}({a.arg})"
                    for a in args
                    if re.fullmatch(r"cfg|conf|config|options|settings", a.arg)
                    and (a.annotation is None or ast.unparse(a.annotation) in ("Any", "object"))
                ]
    assert untyped == []


def test_the_daemon_never_imports_the_client() -> None:
    offenders = [
        str(p.relative_to(REPO))
        for p in (SRC / "daemon").rglob("*.py")
        if any(m == "ckptd.client" or m.startswith("ckptd.client.") for m in imports(p))
    ]
    assert offenders == []


def test_core_imports_neither_side() -> None:
    for p in (SRC / "core").rglob("*.py"):
        assert not {m for m in imports(p) if m.startswith(("ckptd.daemon", "ckptd.client"))}, p


def test_no_step_field_is_assigned_outside_the_catalog() -> None:
    pattern = re.compile(rf"\b(st|step|s|old|again|local)\.({STEP_FIELDS})\s*(=|\+=|-=|\|=)[^=]")
    offenders = []
    for p in (SRC / "daemon").rglob("*.py"):
        if p.parent.name == "catalog":
            continue
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{p.relative_to(REPO)}:{n}: {line.strip()}")
    assert offenders == []


def test_every_daemon_package_says_what_it_is_and_modules_stay_small() -> None:
    for init in (SRC / "daemon").rglob("__init__.py"):
        doc = ast.get_docstring(parse(init))
        assert doc, f"{init.relative_to(REPO)} has no docstring"
    big = [
        f"{p.relative_to(REPO)} ({n})"
        for root in ("core", "daemon", "client")
        for p in (SRC / root).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 450
    ]
    assert big == []


def _assigned_attributes(fn: ast.AST) -> list[ast.Attribute]:
    """Every ``x.attr = ...`` (also augmented, annotated, in tuples) under ``fn``."""
    found: list[ast.Attribute] = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for t in targets:
            found += [e for e in (t.elts if isinstance(t, ast.Tuple) else [t])
                      if isinstance(e, ast.Attribute)]  # fmt: skip
    return found


def _daemon_services() -> set[str]:
    """Classes of the daemon that are not records (dataclasses, enums, named tuples,
    exceptions): the services."""
    services = set()
    for p in (SRC / "daemon").rglob("*.py"):
        for node in ast.walk(parse(p)):
            if not isinstance(node, ast.ClassDef):
                continue
            decorated = {ast.unparse(d).split("(")[0] for d in node.decorator_list}
            bases = {ast.unparse(b) for b in node.bases}
            if decorated & {"dataclass", "dataclasses.dataclass"} or bases & {
                "Enum", "IntEnum", "NamedTuple", "Exception", "Protocol"
            } or node.name.endswith(("Error", "Exception")):  # fmt: skip
                continue
            services.add(node.name)
    return services


def test_no_service_assigns_an_attribute_of_another() -> None:
    """What a service is handed (a constructor argument, kept as ``self.x``) is asked,
    never rewired: ``self.x.attr = ...`` or ``arg.attr = ...`` in a constructor, or a
    function assigning onto a service it was passed, is a loop that neither the floors
    nor the structure drawing can see. Collaborators that need each other are passed
    in at construction as small protocols (local/room.py)."""
    services = _daemon_services()
    offenders = []
    for p in (SRC / "daemon").rglob("*.py"):
        tree = parse(p)
        methods: set[ast.AST] = set()
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            funcs = [f for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
            methods |= set(funcs)
            handed: set[str] = set()
            for init in (f for f in funcs if f.name == "__init__"):
                params = {a.arg for a in init.args.args + init.args.kwonlyargs} - {"self"}
                for node in ast.walk(init):
                    value = node.value if isinstance(node, ast.Assign) else None
                    if isinstance(value, ast.Name) and value.id in params:
                        assert isinstance(node, ast.Assign)
                        handed |= {ast.unparse(t).removeprefix("self.") for t in node.targets}
                for t in _assigned_attributes(init):
                    if isinstance(t.value, ast.Name) and t.value.id in params:
                        offenders.append(f"{p.relative_to(REPO)}:{t.lineno}: {ast.unparse(t)}")
            for f in funcs:
                for t in _assigned_attributes(f):
                    base = ast.unparse(t.value)
                    if base.startswith("self.") and base.removeprefix("self.") in handed:
                        offenders.append(f"{p.relative_to(REPO)}:{t.lineno}: {ast.unparse(t)}")
        for f in ast.walk(tree):
            if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) or f in methods:
                continue
            passed = {
                a.arg
                for a in f.args.args + f.args.kwonlyargs
                if a.annotation is not None and ast.unparse(a.annotation) in services
            }
            for t in _assigned_attributes(f):
                if isinstance(t.value, ast.Name) and t.value.id in passed:
                    offenders.append(f"{p.relative_to(REPO)}:{t.lineno}: {ast.unparse(t)}")
    assert offenders == []


def test_only_the_segment_state_module_moves_a_segment() -> None:
    """Who holds a shared-memory segment (its ``state``, and the ``lease_id`` and
    ``kept`` that go with it) changes only through local/segment_state.move, which
    checks the transition table: no other code assigns those fields."""
    owner = SRC / "daemon" / "local" / "segment_state.py"
    offenders = []
    for p in (SRC / "daemon").rglob("*.py"):
        if p == owner:
            continue
        for t in _assigned_attributes(parse(p)):
            base = ast.unparse(t.value)
            moved = t.attr in ("lease_id", "kept", "lent") or (t.attr == "state" and "seg" in base)
            if moved and (base != "self" or p.name == "lease.py"):
                offenders.append(f"{p.relative_to(REPO)}:{t.lineno}: {ast.unparse(t)}")
    assert offenders == []


CLIENT_FLOORS = {
    # records and plain helpers every room may use
    **dict.fromkeys(
        ("errors", "handle", "save_args", "policies", "window", "rank_files", "shards",
         "goodput"), 0
    ),
    "leaves": 1,  # a framework's leaf kinds (jax arrays, torch tensors, device copies)
    **dict.fromkeys(("tree", "changes", "copying"), 2),  # generic trees, change tokens
    **dict.fromkeys(  # the save and restore machinery
        ("planning", "copy_plan", "mapped_views", "handoff", "ahead", "restore_flow",
         "saver", "low_level"), 3
    ),
    **dict.fromkeys(("client", "distributed", "adopted", "__init__"), 4),  # the Client
    # the framework integrations (and the demo): each imports its framework
    **dict.fromkeys(
        ("torch", "lightning", "lightning_pl", "orbax", "hf", "accelerate", "torchtitan",
         "megatron", "deepspeed", "demo"), 5
    ),
}  # fmt: skip
"""The client's floors (docs/architecture.md, "The client's rooms"): a module imports
only from its own floor or below, so the generic code never imports a framework
room, and nothing below the Client imports it."""
CLIENT_FLOOR_NAMES = ("records", "leaves", "trees", "machinery", "client", "frameworks")


def client_floor(module: str) -> int | None:
    """The floor of a ``ckptd.client`` module: its room (first name under client/)."""
    parts = module.split(".")
    return CLIENT_FLOORS.get(parts[2] if len(parts) > 2 else "__init__")


def test_every_client_room_stands_on_a_floor() -> None:
    unplaced = [
        p.name
        for p in (SRC / "client").iterdir()
        if (p.suffix == ".py" and p.stem not in CLIENT_FLOORS)
        or (p.is_dir() and (p / "__init__.py").exists() and p.name not in CLIENT_FLOORS)
    ]
    assert unplaced == [], f"add these to CLIENT_FLOORS (and docs/architecture.md): {unplaced}"


def test_no_client_module_imports_a_floor_above_its_own() -> None:
    """The generic tree and save code never imports a framework room (leaves/ holds the
    framework leaf kinds it handles), and the machinery never imports the Client."""
    upward = [
        f"{a} ({CLIENT_FLOOR_NAMES[fa]}) imports {b} ({CLIENT_FLOOR_NAMES[fb]})"
        for a, targets in sorted(import_edges(SRC).items())
        if a.startswith("ckptd.client") and (fa := client_floor(a)) is not None
        for b in sorted(targets)
        if b.startswith("ckptd.client") and (fb := client_floor(b)) is not None and fb > fa
    ]
    assert upward == []


def test_the_unit_tier_is_laid_out_as_the_source_is() -> None:
    """tests/unit/<package>/ tests src/ckptd/<package>/: a folder of the unit tier
    that names no package of the source is a test nobody will find."""
    unit = REPO / "tests" / "unit"
    strays = [
        str(d.relative_to(REPO))
        for d in unit.rglob("*")
        if d.is_dir() and d.name != "__pycache__" and not (SRC / d.relative_to(unit)).is_dir()
    ]
    assert strays == []

"""Rules of the package's shape, checked on its syntax trees (no import of the package needed)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "hpc_rlhf"
COLLECTIVES_MODULE = PACKAGE / "distributed" / "collectives.py"

# torch.distributed's collectives, and the ProcessGroup methods that run one
DIST_COLLECTIVES = {
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_object", "all_gather_into_tensor",
    "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list", "send", "recv",
    "isend", "irecv", "all_to_all", "all_to_all_single", "batch_isend_irecv", "send_object_list",
    "recv_object_list",
}
GROUP_METHODS = {"allreduce", "allgather", "allgather_coalesced", "allreduce_coalesced", "alltoall",
                 "alltoall_base", "reduce_scatter", "_allgather_base", "_reduce_scatter_base"}


def modules():
    return sorted(p for p in PACKAGE.rglob("*.py"))


def _dist_aliases(tree: ast.AST) -> tuple[set[str], set[str]]:
    """Names bound to torch.distributed, and names imported from it that are collectives."""
    aliases, direct = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    aliases.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if node.module == "torch" and a.name == "distributed":
                    aliases.add(a.asname or a.name)
                if node.module.startswith("torch.distributed") and a.name in DIST_COLLECTIVES:
                    direct.add(a.asname or a.name)
    return aliases, direct


def _is_torch_distributed(expr: ast.expr, aliases: set[str]) -> bool:
    if isinstance(expr, ast.Name):
        return expr.id in aliases
    return (isinstance(expr, ast.Attribute) and expr.attr == "distributed" and isinstance(expr.value, ast.Name)
            and expr.value.id == "torch")


def collective_calls(path: Path) -> list[str]:
    """``line call`` for every collective the module at ``path`` calls, in line order."""
    tree = ast.parse(path.read_text(), str(path))
    aliases, direct = _dist_aliases(tree)
    found = []
    for node in sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)), key=lambda n: n.lineno):
        f = node.func
        if isinstance(f, ast.Name) and f.id in direct:
            found.append(f"{node.lineno} {f.id}")
        elif isinstance(f, ast.Attribute) and (
                (f.attr in DIST_COLLECTIVES and _is_torch_distributed(f.value, aliases)) or f.attr in GROUP_METHODS):
            found.append(f"{node.lineno} {ast.unparse(f)}")
    return found


def test_only_the_collectives_module_calls_collectives():
    offenders = [f"{p.relative_to(PACKAGE.parent)}:{hit}" for p in modules() if p != COLLECTIVES_MODULE
                 for hit in collective_calls(p)]
    assert offenders == [], "collectives outside distributed/collectives.py:\n" + "\n".join(offenders)


def test_the_walk_finds_collectives_in_every_spelling(tmp_path):
    # the check itself must see each way a module can reach a collective, and not the bridges' own methods
    src = tmp_path / "m.py"
    src.write_text("import torch\nimport torch.distributed as dist\nfrom torch import distributed as d2\n"
                   "from torch.distributed import all_reduce as ar\n"
                   "dist.all_reduce(t)\nd2.barrier()\ntorch.distributed.broadcast(t, 0)\nar(t)\n"
                   "pg.allgather([o], [t])\nbridge.broadcast(t, 0)\ndist.get_rank()\n")
    assert collective_calls(src) == ["5 dist.all_reduce", "6 d2.barrier", "7 torch.distributed.broadcast",
                                     "8 ar", "9 pg.allgather"]
    assert collective_calls(COLLECTIVES_MODULE)  # the module itself does call them


# -- layers: the subpackage import graph ------------------------------------------------------------------

# Third-party packages that a function may import, each for a reason: everything else is imported at the
# top of its module, and no module of the package is imported inside a function.
LAZY_THIRD_PARTY = {
    "vllm": "the optional rollout engine (rollout.engine=vllm): its own environment, absent from the default one",
    "deepspeed": "must come after configure_deepspeed_env (it prints to stdout when it guesses the accelerator); "
                 "only the ranks that train need it",
    "peft": "LoRA only (model.lora_rank > 0); 19 s to import on the 2-core test machine, after torch and "
            "transformers",
    "bitsandbytes": "QLoRA only (model.load_in_4bit); 8 s to import on the same machine",
    "matplotlib": "`hpc-rlhf report` only (reports/plots.py); 1.2 s to import on the same machine, which every "
                  "other command would pay at start-up",
    "wandb": "the optional W&B logger (log.use_wandb; the `wandb` extra): absent unless installed",
}
# One module may import a package inside a function for a reason of its own: the module (relative to the
# repository) and the package, with the reason.
LAZY_IN_MODULE = {
    ("hpc_rlhf/distributed/openmp.py", "torch"): "load_torch is what loads torch, after it has set the OpenMP "
                                                 "wait policy that libgomp reads as it loads",
    ("hpc_rlhf/models/shape.py", "torch"): "only an architecture it does not count is built on the meta device: "
                                           "`hpc-rlhf plan` of the others loads no torch",
    ("hpc_rlhf/models/shape.py", "transformers"): "the same",
}
# The entry points import what a subcommand runs inside the subcommand's functions, anything of the package or
# outside it: `hpc-rlhf --help`, `options`, `plan`, `status`, `report` and `sweep` load no torch, and a configured
# command reports a config error before it loads torch (hpc_rlhf/entrypoints/__init__.py).
LAZY_ENTRY_POINTS = ("hpc_rlhf/cli.py", "hpc_rlhf/entrypoints/")
# The top layer: a node may be imported by the listed nodes only (library code never imports entry points).
TOP_LAYER = {"cli": set(), "entrypoints": {"cli"}, "commands": {"cli", "entrypoints", "launch"}}
TABLE_REFERENCE = re.compile(r"^(hpc_rlhf(?:\.\w+)+):\w+$")  # "module:attribute", resolved with importlib


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def node_of(dotted: str) -> str | None:
    """The graph node of a module: its subpackage, or the top-level module itself (cli, commands)."""
    parts = dotted.split(".")
    return parts[1] if parts[0] == PACKAGE.name and len(parts) > 1 else None


def _imported(node: ast.AST, name: str, is_package: bool) -> list[str]:
    """Dotted names an import statement imports (for ``from m import a``: ``m.a``, a module or an attribute)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        parts = name.split(".")[:len(name.split(".")) + is_package - node.level]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [f"{base}.{a.name}" for a in node.names]


def imports(path: Path, package: Path = PACKAGE) -> list[tuple[int, str, bool]]:
    """(line, dotted name, inside a function) of every import of the module at ``path``, and of every
    "hpc_rlhf.module:attribute" string (what a command table resolves with importlib), as imports."""
    tree = ast.parse(path.read_text(), str(path))
    name, is_package = module_name(path, package), path.name == "__init__.py"
    in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    found = [(n.lineno, target, id(n) in in_function) for n in ast.walk(tree)
             if isinstance(n, (ast.Import, ast.ImportFrom)) for target in _imported(n, name, is_package)]
    found += [(n.lineno, m.group(1), False) for n in ast.walk(tree) if isinstance(n, ast.Constant)
              and isinstance(n.value, str) and (m := TABLE_REFERENCE.match(n.value))]
    return sorted(found)


def import_graph(package: Path = PACKAGE) -> dict[str, dict[str, list[str]]]:
    """node -> imported node -> ``file:line`` of each import, between different nodes only."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(package.rglob("*.py")):
        here = node_of(module_name(path, package))
        if here is None:
            continue
        graph.setdefault(here, {})
        for line, target, _ in imports(path, package):
            there = node_of(target)
            where = f"{path.relative_to(package.parent)}:{line}"
            if there not in (None, here) and where not in graph[here].setdefault(there, []):
                graph[here][there].append(where)
    return graph


def find_cycle(graph: dict[str, dict]) -> list[str]:
    """One cycle of the graph as [a, b, ..., a], or [] when there is none (depth-first search)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return []
    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return []


def layers(graph: dict[str, dict]) -> list[list[str]]:
    """Nodes by layer, bottom first: a node's layer is one above the highest layer it imports."""
    level: dict[str, int] = {}

    def height(node: str) -> int:
        if node not in level:
            level[node] = -1  # cycles are find_cycle's to report; here they only must not recurse forever
            level[node] = 1 + max((height(n) for n in graph.get(node, {})), default=-1)
        return level[node]
    for node in graph:
        height(node)
    return [sorted(n for n in level if level[n] == k) for k in range(max(level.values(), default=-1) + 1)]


def describe_layers(graph: dict[str, dict]) -> str:
    return "\n".join(f"  {k}: {' '.join(nodes)}" for k, nodes in enumerate(layers(graph)))


def test_no_import_cycle_between_subpackages():
    graph = import_graph()
    cycle = find_cycle(graph)
    steps = [f"  {a} -> {b}  ({', '.join(graph[a][b][:3])})" for a, b in zip(cycle, cycle[1:])]
    assert not cycle, ("import cycle between subpackages:\n" + "\n".join(steps)
                       + "\nlayers (bottom first):\n" + describe_layers(graph))


def test_entry_points_are_imported_by_entry_points_only():
    graph = import_graph()
    offenders = [f"{a} imports {b} ({', '.join(graph[a][b])})" for a in sorted(graph) for b in graph[a]
                 if b in TOP_LAYER and a not in TOP_LAYER[b]]
    assert offenders == [], "library code imports an entry point:\n" + "\n".join(offenders)


def function_level_imports(package: Path = PACKAGE) -> list[str]:
    """``file:line name`` of every import inside a function that is not of a LAZY_THIRD_PARTY package (nor
    one that LAZY_IN_MODULE allows in its module)."""
    found: dict[str, str] = {}  # file:line -> the first name its import statement imports
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package.parent).as_posix()
        for line, target, lazy in imports(path, package):
            top = target.split(".")[0]
            if lazy and top not in LAZY_THIRD_PARTY and (where, top) not in LAZY_IN_MODULE \
                    and not where.startswith(LAZY_ENTRY_POINTS):
                found.setdefault(f"{path.relative_to(package.parent)}:{line}", target)
    return [f"{where} {target}" for where, target in found.items()]


def test_functions_import_only_heavy_optional_packages():
    offenders = function_level_imports()
    assert offenders == [], ("imports inside functions (move them to the top of the module; only "
                             f"{', '.join(LAZY_THIRD_PARTY)} may be imported lazily):\n" + "\n".join(offenders))


# the two tables of "module:attribute" strings that importlib resolves: the commands and the generation engines
RESOLVERS = (PACKAGE / "commands.py", PACKAGE / "generation" / "factory.py")


def test_only_the_command_table_resolves_modules_by_name():
    # importlib.import_module / __import__ would be lazy imports that the AST walk above cannot see
    offenders = [f"{p.relative_to(PACKAGE.parent)}:{n.lineno}" for p in modules() if p not in RESOLVERS
                 for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Call)
                 and ast.unparse(n.func) in ("importlib.import_module", "import_module", "__import__")]
    assert offenders == [], ("modules imported by name outside the command table and the engine registry:\n"
                             + "\n".join(offenders))


def test_the_graph_walk_sees_every_kind_of_import(tmp_path):
    pkg = tmp_path / PACKAGE.name
    for rel, text in {"__init__.py": "", "cli.py": "from .b import x\n",
                      "a/__init__.py": "from . import m\n", "a/m.py": "def f():\n    from ..b.n import y\n",
                      "b/__init__.py": "", "b/n.py": "import vllm\nT = {'x': 'hpc_rlhf.a.m:f'}\n"
                      "def g():\n    import peft\n    import yaml\n"}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    graph = import_graph(pkg)
    assert graph == {"a": {"b": ["hpc_rlhf/a/m.py:2"]}, "b": {"a": ["hpc_rlhf/b/n.py:2"]},
                     "cli": {"b": ["hpc_rlhf/cli.py:1"]}}
    assert find_cycle(graph) == ["a", "b", "a"]
    assert function_level_imports(pkg) == ["hpc_rlhf/a/m.py:2 hpc_rlhf.b.n.y", "hpc_rlhf/b/n.py:5 yaml"]
    del graph["b"]["a"]
    assert find_cycle(graph) == [] and layers(graph) == [["b"], ["a", "cli"]]



def test_a_lazy_import_is_allowed_only_in_the_module_named_for_it(tmp_path):
    pkg = tmp_path / PACKAGE.name
    for rel, text in {"__init__.py": "", "distributed/__init__.py": "",
                      "distributed/openmp.py": "def f():\n    import torch\n",
                      "distributed/other.py": "def f():\n    import torch\n"}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    assert function_level_imports(pkg) == ["hpc_rlhf/distributed/other.py:2 torch"]


# -- the generation port: the engine interface, the engines' declarations and the factory are what the rest of the
# package sees
GENERATION_PORT = {"hpc_rlhf.generation.engine", "hpc_rlhf.generation.specs", "hpc_rlhf.generation.factory"}


def port_breaches(package: Path = PACKAGE) -> list[str]:
    """``file:line module`` of every import that reaches past the generation port: of ``generation/lean/`` from
    anywhere but ``generation/factory.py`` and ``generation/lean/`` itself, and of another ``generation`` module
    than the port from outside ``generation/``."""
    gen, lean = f"{package.name}.generation", f"{package.name}.generation.lean"
    port = {m.replace("hpc_rlhf", package.name, 1) for m in GENERATION_PORT}
    found = []
    for path in sorted(package.rglob("*.py")):
        here = module_name(path, package)
        for line, target, _ in imports(path, package):
            where = f"{path.relative_to(package.parent)}:{line} {target}"
            if (target == lean or target.startswith(lean + ".")) and here != f"{gen}.factory" \
                    and not here.startswith(lean):
                found.append(where)
            elif target.startswith(gen + ".") and not here.startswith(gen) \
                    and not any(target == m or target.startswith(m + ".") for m in port):
                found.append(where)
    return found


def test_generation_is_reached_through_its_port_only():
    assert port_breaches() == []


def test_the_port_check_sees_each_kind_of_breach(tmp_path):
    pkg = tmp_path / PACKAGE.name
    for rel, text in {"__init__.py": "", "generation/__init__.py": "", "generation/engine.py": "",
                      "generation/hf.py": "from .lean.decoder import D\n",
                      "generation/factory.py": "from .lean.engine import L\nfrom .hf import H\n",
                      "generation/lean/__init__.py": "", "generation/lean/engine.py": "from .decoder import D\n",
                      "roles/__init__.py": "", "roles/rollout.py": "from ..generation.engine import E\n"
                      "from ..generation.factory import make\nfrom ..generation.hf import H\n"}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    assert port_breaches(pkg) == ["hpc_rlhf/generation/hf.py:1 hpc_rlhf.generation.lean.decoder.D",
                                  "hpc_rlhf/roles/rollout.py:3 hpc_rlhf.generation.hf.H"]


if __name__ == "__main__":  # python tests/unit/package/test_architecture.py: the layers of the package, bottom first
    print(describe_layers(import_graph()))

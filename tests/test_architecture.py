"""Rules of the package's shape, checked on its syntax trees (no import of the package needed)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hpc_rlhf"
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

"""The project's modules import each other without a cycle (a module never imports itself back through others)."""

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGES = ("engine", "methods", "datamodules", "backbones", "analysis", "interop")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports at its top level, `if TYPE_CHECKING:` blocks included (a cycle of
    type-only imports still ties the two modules together); imports inside functions are left out."""
    modules = {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        top_level = tree.body + [inner for node in tree.body if isinstance(node, ast.If) for inner in node.body]
        statements = [node for node in top_level if isinstance(node, (ast.Import, ast.ImportFrom))]
        targets = set()
        for node in statements:
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif node.module:
                targets |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        # an import of a.b.c also imports its packages a and a.b
        expanded = {".".join(target.split(".")[:i]) for target in targets for i in range(1, target.count(".") + 2)}
        graph[name] = {target for target in expanded if target in modules and target != name}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open" and not node.startswith(f"{target}."):  # a package's own submodules are not a cycle
                return stack[stack.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_of_the_project_has_no_cycle():
    assert cycle(import_graph()) is None, " -> ".join(cycle(import_graph()))


def test_the_check_finds_a_cycle_of_two_modules():
    assert cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]

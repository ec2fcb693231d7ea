"""The project's packages form layers, each importing only its own package and the layers below it, and its modules
import each other without a cycle (a module never imports itself back through others).

The layers, from the bottom (docs/architecture.md):

1. `engine` (the run plumbing the rest builds on: optimizers, checkpoint files and records, signals, tracking,
   compat), except its command line;
2. `backbones`, `datamodules`;
3. `interop.official` (reading the official releases' layouts);
4. `methods`;
5. `analysis`, the representation metrics, figures and callbacks;
6. `engine.cli`, the command line;
7. the tools on top: `interop.export` and the analysis commands (`python -m analysis`, its checkpoint loading, the
   few-shot probe, the key distribution).

An import is any `import` statement, at the top of a module or inside a function, and any string that names a
project module for `importlib` (e.g. "methods.longtail.paco.PaCo" in a table of class paths).
"""

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

import methods.checkpoints
from methods.checkpoints import trainable_classes

ROOT = Path(__file__).parents[1]
# the packages pyproject.toml installs (`include = ["engine*", ...]`; tomllib is not in Python 3.10)
PACKAGES = tuple(re.findall(r'"(\w+)\*"', re.search(r"^\[tool\.setuptools\.packages\.find\]\ninclude = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)[1]))
# the layers, bottom first: a module belongs to the most specific prefix listed
LAYERS = (
    ("engine",),
    ("backbones", "datamodules"),
    ("interop", "interop.official"),
    ("methods",),
    ("analysis",),
    ("engine.cli",),
    ("interop.export", "analysis.__main__", "analysis.loading", "analysis.features", "analysis.few_shot", "analysis.knn", "analysis.key_distribution"),
)
MODULE_STRING = re.compile(rf"({'|'.join(PACKAGES)})(\.\w+)+")


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


def layer_of(module: str) -> int:
    """The layer of a module: that of the longest prefix in LAYERS."""
    prefixes = [(len(prefix), index) for index, layer in enumerate(LAYERS) for prefix in layer if module == prefix or module.startswith(f"{prefix}.")]
    return max(prefixes)[1]


def imported_modules(source: str, modules: set[str]) -> set[str]:
    """Every project module (of `modules`) a module's source imports: import statements anywhere, and module paths in
    strings (a class path names the module that holds the class)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_STRING.fullmatch(node.value):
            found.add(node.value)
    # each name as the longest project module it starts with (`methods.base.MethodBase` -> `methods.base`)
    return {max((module for module in modules if name == module or name.startswith(f"{module}.")), key=len) for name in found
            if name.split(".")[0] in PACKAGES}


def forbidden_edges(sources: dict[str, str]) -> list[str]:
    """'module -> imported (layer a -> layer b)' for each import of a higher layer, or of another package of the same
    layer; a module's own package is always allowed."""
    edges = []
    for module, source in sorted(sources.items()):
        own = layer_of(module)
        for target in sorted(imported_modules(source, set(sources))):
            same_package = target.split(".")[0] == module.split(".")[0]
            if layer_of(target) > own or (layer_of(target) == own and not same_package):
                edges.append(f"{module} -> {target} (layer {own + 1} -> layer {layer_of(target) + 1})")
    return edges


def project_sources() -> dict[str, str]:
    return {module_name(path): path.read_text() for package in PACKAGES for path in (ROOT / package).rglob("*.py")}


def test_every_package_imports_only_its_own_layer_and_those_below():
    assert forbidden_edges(project_sources()) == []


@pytest.mark.parametrize(
    "module, added, edge",
    [
        ("engine.optim", "from methods.base import MethodBase", "engine.optim -> methods.base (layer 1 -> layer 4)"),
        ("methods.base", "from interop.export import export", "methods.base -> interop.export (layer 4 -> layer 7)"),
        ("backbones.factory", "import datamodules", "backbones.factory -> datamodules (layer 2 -> layer 2)"),
        ("methods.linear", "def f():\n    from engine.cli import ContrastlabCLI", "methods.linear -> engine.cli (layer 4 -> layer 6)"),
        ("analysis.monitors", "from analysis.loading import load_method", "analysis.monitors -> analysis.loading (layer 5 -> layer 7)"),
        ("engine.files", "MOVED = {'old': 'methods.longtail.paco.PaCo'}", "engine.files -> methods.longtail.paco (layer 1 -> layer 4)"),
    ],
)
def test_the_layer_check_finds_one_forbidden_import(module, added, edge):
    sources = project_sources()
    sources[module] += f"\n{added}\n"
    assert forbidden_edges(sources) == [edge]


def test_the_import_graph_of_the_project_has_no_cycle():
    assert cycle(import_graph()) is None, " -> ".join(cycle(import_graph()))


def test_the_check_finds_a_cycle_of_two_modules():
    assert cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def lines_over(limit: int, paths) -> dict[str, int]:
    return {str(path): lines for path in paths if (lines := len(path.read_text().splitlines())) > limit}


def test_no_module_of_engine_or_methods_is_over_300_lines():
    """One job per file (issue 31): a module that grows past 300 lines holds more than one and is split by job."""
    assert lines_over(300, [path for package in ("engine", "methods") for path in (ROOT / package).rglob("*.py")]) == {}


def test_every_method_reads_in_one_file_of_at_most_150_lines():
    """A method's file shows its idea (which view goes where, which loss, what is enqueued); the generic parts live in
    the base, the mixins and the loss library."""
    import methods

    trained = [getattr(methods, name) for base in (methods.PretrainMethod, methods.LongTailClassifier) for name in trainable_classes(base)]
    files = {Path(inspect.getsourcefile(cls)) for cls in trained}  # the linear probe and fine-tuning are evaluations
    assert len(files) >= 19  # every method of the papers and the baselines
    assert lines_over(150, files) == {}


def test_every_model_class_of_the_methods_package_is_exported():
    """`methods.__all__` is what a config's `class_path: methods.<Class>`, `--help` and the method tests (contract, size,
    two processes) see: a class defined in `methods/` and left out of it runs but escapes them."""
    import methods

    defined = {cls.__name__ for path in (ROOT / "methods").rglob("*.py")
               for _, cls in inspect.getmembers(importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")), inspect.isclass)
               if issubclass(cls, methods.MethodBase) and cls.__module__.startswith("methods")}
    assert sorted(defined - set(methods.__all__)) == []


def test_the_size_check_finds_a_file_over_its_limit(tmp_path):
    (tmp_path / "long.py").write_text("x = 1\n" * 151)
    (tmp_path / "short.py").write_text("x = 1\n" * 150)
    assert {Path(name).name: lines for name, lines in lines_over(150, tmp_path.glob("*.py")).items()} == {"long.py": 151}


def test_the_checkpoint_reader_knows_the_packages_pyproject_installs():
    """`methods.checkpoints.PACKAGES` tells a class of the project (a moved or renamed one) from one of the user's."""
    assert sorted(methods.checkpoints.PACKAGES) == sorted(PACKAGES) == ["analysis", "backbones", "datamodules", "engine", "interop", "methods"]

"""The layers of the code base: no import runs back up them.

    commands (cli)  ->  recommend  ->  bench, training  ->  runtime  ->  drafts  ->  modeling  ->  kernels
                                                                       (the base modules: errors, config, files,
                                                                        chat, models, hub, fetch, roofline ...)

A module may import its own layer and the layers below it. Among the middle layers, bench and
training are siblings that do not import each other (the workloads both read live below them).
The test walks every ``import`` in the package's source (at any depth, lazy ones included).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (module prefix, layer): the longest matching prefix decides; higher layers may import lower ones
LAYERS = [
    ("specctl.kernels", 0),
    ("specctl", 1),  # the base: errors, config, files, chat, models, hub, fetch, roofline, vllm_compat
    ("specctl.modeling", 2),
    ("specctl.drafts", 3),
    ("specctl.runtime", 4),
    ("specctl.workloads", 1),
    ("specctl.bench", 5),
    ("specctl.training", 5),
    ("specctl.testing", 5),
    ("specctl.recommend", 6),
    ("specctl.commands", 7),
    ("specctl.cli", 7),
]
SIBLINGS = {"specctl.bench", "specctl.training"}  # same layer, and neither imports the other


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("specctl",):
        for p in (ROOT / top).rglob("*.py"):
            parts = p.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = p
    return out


def _layer(module: str) -> tuple[str, int]:
    best = max((p for p in LAYERS if module == p[0] or module.startswith(p[0] + ".")), key=lambda p: len(p[0]))
    return best


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found.update(n for n in names if n in modules)
    return found


def test_no_import_runs_up_the_layers():
    modules = _modules()
    upward = []
    for name, path in sorted(modules.items()):
        (own, level) = _layer(name)
        for target in sorted(_imports(path, modules)):
            (theirs, tlevel) = _layer(target)
            if tlevel > level or (own in SIBLINGS and theirs in SIBLINGS and own != theirs):
                upward.append(f"{name} ({own}) imports {target} ({theirs})")
    assert not upward, "imports up the layers:\n" + "\n".join(upward)


def test_the_walk_sees_lazy_imports():
    """The check would catch an import inside a function (most heavy imports are lazy)."""
    modules = _modules()
    found = _imports(modules["specctl.commands.bench"], modules)
    assert any(m.startswith("specctl.bench") for m in found)


def test_the_cli_imports_no_torch():
    import subprocess
    import sys

    code = "import specctl.cli, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_module_graph_has_no_cycle():
    """No module imports, directly or through others, a module that imports it back (lazy imports
    included): each module can be read, and tested, above the ones it uses."""
    import graphlib

    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    try:
        list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        raise AssertionError("an import cycle: " + " -> ".join(e.args[1])) from None


MAX_LINES = 500


def test_no_module_is_over_500_lines():
    """A module that grows past this holds more than one job: split it by job."""
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"

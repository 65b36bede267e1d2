"""The import graph of ``src/openmla`` and ``src/openmla_tools``, read from the source (nothing is imported; no timing).

Run: ``.venv/bin/python bench/import_graph.py [REPO]``

Counts modules, internal run-time imports (``if TYPE_CHECKING:`` blocks left out; imports inside
functions counted), import circles (strongly connected modules), and imports that point up a
band of the layer order (bottom to top: 0 core modules, 1 backends, 2 planning / dispatch / ops /
kept plans / v4, 3 layer, 4 distributed, 5 hf / integrations / compat, 6 tools still inside
``openmla``, 7 the package's ``__init__``, 8 the ``openmla_tools`` package). Also lists which modules
outside ``openmla.backends`` import it, and which library modules (``openmla.*``) import the tools
package or the tools' own dependencies (rich, matplotlib).
"""

from __future__ import annotations

import ast
import itertools
import pathlib
import sys

# Tools inside openmla (band 6): what was there before openmla_tools (an older checkout reads the same), and the compile report.
TOOLS = ("openmla.cli", "openmla.cli_options", "openmla.demo", "openmla.benchmarks", "openmla.check", "openmla.accuracy",
         "openmla.testing", "openmla.__main__", "openmla.distributed.demo", "openmla.hf.cli", "openmla.hf.demo",
         "openmla.timing", "openmla.flops", "openmla.backends.triton.aot")


TOOLS_ONLY = ("rich", "matplotlib")  # the tools extra's dependencies: no library module may import them


def band(m: str) -> int:
    if m.startswith("openmla_tools"):
        return 8
    if m == "openmla":
        return 7
    if m.startswith(TOOLS):
        return 6
    if m.startswith(("openmla.hf", "openmla.integrations", "openmla.compat")):
        return 5
    if m.startswith("openmla.distributed"):
        return 4
    if m == "openmla.layer":
        return 3
    if m in ("openmla.planning", "openmla.dispatch", "openmla.ops", "openmla.kept_plans") or m.startswith("openmla.v4"):
        return 2
    if m.startswith("openmla.backends"):
        return 1
    return 0


def graph(*roots: pathlib.Path) -> tuple[dict[str, pathlib.Path], set[tuple[str, str]], set[tuple[str, str]]]:
    """The modules under ``roots``, the imports between them, and (module, package) for each import of ``TOOLS_ONLY``."""
    mods = {}
    for root in roots:
        for p in root.rglob("*.py"):
            rel = p.relative_to(root.parent).with_suffix("")
            mods[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = p
    edges, external = set(), set()
    for name, p in mods.items():
        tree = ast.parse(p.read_text())
        skip = {id(x) for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
                for x in ast.walk(n)}
        for n in ast.walk(tree):
            if not isinstance(n, (ast.Import, ast.ImportFrom)) or id(n) in skip:
                continue
            if isinstance(n, ast.Import):
                targets = [a.name for a in n.names]
            else:
                base = name if p.name == "__init__.py" else name.rpartition(".")[0]
                for _ in range(max(n.level - 1, 0)):
                    base = base.rpartition(".")[0]
                mod = (base + "." + n.module if n.module else base) if n.level else n.module
                targets = [mod] + [mod + "." + a.name for a in n.names]
            for t in targets:
                if t and t.split(".")[0] in TOOLS_ONLY:
                    external.add((name, t.split(".")[0]))
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith("openmla") and not name.startswith(t + "."):
                    edges.add((name, t))
    return mods, edges, external


def circles(mods, edges) -> list[list[str]]:
    out = {m: sorted(b for a, b in edges if a == m) for m in mods}
    index, low, stack, on, found, count = {}, {}, [], set(), [], itertools.count()

    def visit(v):
        index[v] = low[v] = next(count)
        stack.append(v)
        on.add(v)
        for w in out[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(mods):
        if v not in index:
            visit(v)
    return found


def main() -> None:
    repo = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parents[1])
    mods, edges, external = graph(*[r for r in (repo / "src" / "openmla", repo / "src" / "openmla_tools") if r.is_dir()])
    up = sorted((a, b) for a, b in edges if band(a) < band(b))
    found = circles(mods, edges)
    print(f"modules {len(mods)}, internal imports {len(edges)}, circles {len(found)}, imports pointing up a band {len(up)}")
    for c in found:
        print("  circle:", " <-> ".join(c))
    for a, b in up:
        print(f"  up: {a} -> {b}")
    users = sorted({a for a, b in edges if b.startswith("openmla.backends") and not a.startswith("openmla.backends")})
    print("outside openmla.backends, importing it:", ", ".join(users))
    library = [m for m in mods if not m.startswith("openmla_tools")]
    print(f"library modules {len(library)} ({sum(len(mods[m].read_text().splitlines()) for m in library)} lines), "
          f"tools package modules {len(mods) - len(library)}")
    print("library modules importing openmla_tools:", ", ".join(sorted({a for a, b in edges if b.startswith("openmla_tools")
                                                                      and not a.startswith("openmla_tools")})) or "none")
    for pkg in TOOLS_ONLY:
        print(f"library modules importing {pkg}:", ", ".join(sorted(a for a, b in external if b == pkg and a in library)) or "none")


if __name__ == "__main__":
    main()

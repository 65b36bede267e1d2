"""The library does not lean on its tools: every ``openmla`` module imports with the tools extra's
packages (``rich``, ``matplotlib``) missing, no ``openmla`` source file imports ``openmla_tools``,
no ``openmla`` module is a command (the front ends live in ``openmla_tools``), and the ``openmla``
command, without ``rich``, says which extra to install."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
TOOLS_ONLY = ("rich", "matplotlib")

# A meta-path finder, first in line, that refuses the tools extra's packages as if not installed.
BLOCK = textwrap.dedent(f"""
    import importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {TOOLS_ONLY!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
            return None

    sys.meta_path.insert(0, Block())
    for name in [m for m in sys.modules if m.split(".")[0] in {TOOLS_ONLY!r}]:
        del sys.modules[name]
""")


def _library_modules() -> list[str]:
    out = []
    for p in sorted((SRC / "openmla").rglob("*.py")):
        rel = p.relative_to(SRC).with_suffix("")
        if rel.name != "__main__":  # importing a __main__ runs its command (the AST check below still reads it)
            out.append(".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts))
    return out


def _optional(module: str) -> bool:
    """Modules that need an optional dependency other than the tools extra (triton, transformers, vllm)."""
    return module.startswith(("openmla.backends.triton", "openmla.integrations.vllm", "openmla.hf"))


def _run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + textwrap.dedent(script)], capture_output=True, text=True, timeout=600)


def test_every_library_module_imports_without_the_tools_extra():
    modules = _library_modules()
    assert "openmla.dispatch" in modules and "openmla.hf.attach" in modules and not any(m.startswith("openmla_tools") for m in modules)
    optional = [m for m in modules if _optional(m)]
    res = _run(f"""
        import importlib, sys
        failed, skipped = [], []
        for name in {modules!r}:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as e:
                if name in {optional!r} and (e.name or "").split(".")[0] not in {TOOLS_ONLY!r}:
                    skipped.append(f"{{name}}: {{e.name}}")  # triton, transformers or vllm not installed here
                else:
                    failed.append(f"{{name}}: {{e!r}}")
            except Exception as e:
                failed.append(f"{{name}}: {{e!r}}")
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in {TOOLS_ONLY!r} + ("openmla_tools",))
        print("FAILED", failed)
        print("SKIPPED", skipped)
        print("LOADED", loaded)
        print("COUNT", len({modules!r}) - len(failed) - len(skipped))
    """)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in res.stdout.splitlines() if " " in line}
    assert lines["FAILED"] == "[]", lines["FAILED"]
    assert lines["LOADED"] == "[]", f"the library loaded a tools module: {lines['LOADED']}"
    assert int(lines["COUNT"]) >= len(modules) // 2, res.stdout  # optional dependencies missing may skip a few, not most


def test_no_library_source_imports_the_tools_package():
    offenders = []
    for p in sorted((SRC / "openmla").rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value]  # importlib.import_module("openmla_tools..."), a "module:function" path
            else:
                continue
            offenders += [f"{p.relative_to(SRC)}:{node.lineno}: {n}" for n in names if n.split(".")[0].split(":")[0] == "openmla_tools"]
    assert not offenders, offenders


def test_no_library_module_is_a_command():
    """No ``__main__`` and no argument parsing in ``openmla``: ``python -m openmla_tools`` and
    ``python -m openmla_tools.compile_report`` are the commands."""
    mains = sorted(str(p.relative_to(SRC)) for p in (SRC / "openmla").rglob("__main__.py"))
    parsers = sorted(str(p.relative_to(SRC)) for p in (SRC / "openmla").rglob("*.py")
                     if any(isinstance(n, (ast.Import, ast.ImportFrom)) and "argparse" in
                            ([a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""])
                            for n in ast.walk(ast.parse(p.read_text(), str(p)))))
    assert not mains and not parsers, (mains, parsers)


def test_the_command_without_rich_names_the_extra():
    res = _run("""
        from openmla_tools.cli import main
        main(["check"])
    """)
    assert res.returncode != 0
    assert "tools" in res.stderr and "pip install" in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]

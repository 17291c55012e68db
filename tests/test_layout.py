"""The repository keeps the layout the README documents, and the tests mirror it."""

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_top_level_layout():
    for name in ("protos", "services/router", "services/drafter", "services/verifier", "common", "deploy", "tests",
                 "docker-compose.yml", "pyproject.toml", "README.md", "Makefile", ".ci/run"):
        assert (ROOT / name).exists(), name


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme.split("##")[0]
    assert "make test" in (ROOT / ".ci/run").read_text()


def test_no_generated_stubs_are_committed():
    assert not list((ROOT / "protos").glob("*_pb2*.py"))


def test_every_package_is_installed():
    """pyproject lists packages explicitly: a new package directory must be added there, or a
    non-editable install (the Docker image) ships without it."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"blockspec." + ".".join(p.parent.relative_to(ROOT).parts)
             for top in ("common", "protos", "services") for p in (ROOT / top).rglob("__init__.py")}
    assert found == listed


def test_every_cpp_source_is_installed():
    """The C++ kernels are read from .cpp files next to their module at run time: each such package
    must ship them as package data."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for top in ("common", "services"):
        for source in (ROOT / top).rglob("*.cpp"):
            package = "blockspec." + ".".join(source.parent.relative_to(ROOT).parts)
            assert "*.cpp" in data.get(package, []), f"{source.relative_to(ROOT)} is not package data"


def test_tests_mirror_the_source_tree():
    """A test module under tests/common or tests/services sits in the directory of the package it tests:
    tests/common/<pkg>/ for common/<pkg>/, tests/services/<pkg>/ (or a subpackage) for services/<pkg>/. Loose in
    tests/common only test_<module>.py of a top-level module common/<module>.py; none loose in tests/services."""
    misplaced = []
    for top in ("common", "services"):
        for test in sorted((ROOT / "tests" / top).rglob("test_*.py")):
            where = test.parent.relative_to(ROOT / "tests")
            if where == Path("common"):
                placed = (ROOT / "common" / test.name.removeprefix("test_")).is_file()
            else:
                placed = where != Path("services") and (ROOT / where / "__init__.py").is_file()
            if not placed:
                misplaced.append(str(test.relative_to(ROOT)))
    assert misplaced == [], "each should move to the tests/ directory of the source package it tests"


def test_test_modules_share_helpers_only_through_tests_helpers():
    """What test modules share lives in tests/helpers.py (fixtures in conftest.py): no module under tests/ imports
    another test module or conftest, at the top or inside a function."""
    found = []
    for module in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(module.read_text(), str(module))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == "tests"]
            elif isinstance(node, ast.ImportFrom) and node.level:
                names = ["." * node.level + (node.module or "")]  # relative: tests.helpers is imported by name
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tests":
                names = [node.module] if node.module != "tests" else [f"tests.{a.name}" for a in node.names]
            else:
                continue
            found += [f"{module.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n != "tests.helpers"]
    assert found == []

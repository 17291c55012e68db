"""The repository keeps the layout the README documents."""

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

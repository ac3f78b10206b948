"""Install metadata: ranges in pyproject.toml (installable next to other versions), exact pins in constraints.txt
for set-up and CI, and every pin inside its range."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirements(extra: str | None = None) -> dict[str, Requirement]:
    lines = project()["dependencies"] if extra is None else project()["optional-dependencies"][extra]
    return {Requirement(line).name.lower().replace("_", "-"): Requirement(line) for line in lines}


def constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def test_runtime_requirements_are_ranges_not_exact_pins():
    for name, requirement in {**requirements(), **requirements("gpu"), **requirements("eval")}.items():
        assert not any(spec.operator in ("==", "===") for spec in requirement.specifier), requirement
    runtime = requirements()
    assert "2.6" in runtime["torch"].specifier and "2.14.1" in runtime["torch"].specifier
    assert "5.24.0" in runtime["transformers"].specifier and "5.30" in runtime["transformers"].specifier
    assert "6.0" not in runtime["transformers"].specifier and "0.22.0" not in runtime["peft"].specifier


def test_the_gpu_extra_is_the_fla_with_the_state_v_first_keyword():
    fla = requirements("gpu")["flash-linear-attention"]
    assert "0.5.1" in fla.specifier and "0.5.2" in fla.specifier and "0.5.0" not in fla.specifier


def test_constraints_pin_the_tested_set_inside_the_declared_ranges():
    pins = constraints()
    assert pins["torch"] == "2.13.0" and pins["transformers"] == "5.24.0" and pins["peft"] == "0.21.2"
    declared = {**requirements(), **requirements("gpu"), **requirements("dev")}
    for name, requirement in declared.items():
        assert name in pins, f"{name} has no pin in constraints.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (name, pins[name], str(requirement))


def test_setup_installs_torch_first_then_the_project_with_the_constraints():
    script = (ROOT / "scripts" / "setup.sh").read_text()
    torch_line = script.index("pip install -q --disable-pip-version-check torch==2.13.0")
    project_line = re.search(r"pip install .*-c constraints\.txt .*-e \"\.\[dev\]\"", script)
    assert project_line and torch_line < project_line.start()

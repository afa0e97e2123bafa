"""Installing torchacco claims no global `models` or `data` module, and every model folder ships."""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.integration
def test_models_and_data_install_under_torchacco_only(tmp_path):
    code = (
        "import importlib.util as u; import torchacco.models, torchacco.data; "
        "print(u.find_spec('models'), u.find_spec('data'), torchacco.models.__path__[0])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True)
    found_models, found_data, path = out.stdout.split()
    assert (found_models, found_data) == ("None", "None")
    assert Path(path) == ROOT / "models"  # the editable install maps the top-level folder


def test_every_model_folder_is_listed_for_wheels():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {f"torchacco.models.{p.parent.name}" for p in (ROOT / "models").glob("*/__init__.py")}
    folders |= {f"torchacco.{p.parent.name}" for p in (ROOT / "torchacco").glob("*/__init__.py")}
    assert folders <= listed, f"add {sorted(folders - listed)} to [tool.setuptools] packages in pyproject.toml"
    shipped_benchmarks = sorted(p for p in listed if p.split(".")[0] == "benchmarks" or ".bench" in p)
    assert not shipped_benchmarks, f"benchmarks/ runs from the repository and is not installed: {shipped_benchmarks}"


def test_the_measured_token_efficiency_table_ships_in_the_wheel():
    from torchacco.planning.cost_model import TOKEN_EFFICIENCY

    shipped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert TOKEN_EFFICIENCY.name in shipped["torchacco.planning"]
    assert TOKEN_EFFICIENCY.parent == ROOT / "torchacco" / "planning"
    assert TOKEN_EFFICIENCY.is_file()

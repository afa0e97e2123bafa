"""Installing torchacco claims no global `models` or `data` module, and every model folder ships."""

import importlib
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


def test_the_console_script_is_python_m_torchacco(capfd):
    from torchacco.__main__ import COMMANDS, main

    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"] == {
        "torchacco": "torchacco.__main__:run"
    }
    assert main(["--help"]) == 0
    listed = capfd.readouterr().out
    assert all(f"    {name} " in listed for name in COMMANDS)
    assert main(["trian"]) == 1
    assert "unknown command 'trian'; did you mean 'train'? the commands:" in capfd.readouterr().err
    for name, (module, _) in COMMANDS.items():
        assert callable(importlib.import_module(module).main), name


def test_only_the_torchrun_entries_keep_a_main_block_beside_the_dispatcher():
    # torchrun starts each rank, and the launcher each replica's agent, by module (torchacco/__main__.py says why)
    library = [p for folder in ("torchacco", "models", "data") for p in (ROOT / folder).rglob("*.py")]
    entries = sorted(str(p.relative_to(ROOT)) for p in library if 'if __name__ == "__main__"' in p.read_text())
    assert entries == ["torchacco/__main__.py", "torchacco/launch.py", "torchacco/train.py"]

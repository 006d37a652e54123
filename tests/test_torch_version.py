"""labkit refuses, at import, a torch older than the newest API the course uses."""
import subprocess
import sys

import pytest
import torch

import labkit
from labkit import torch_version


@pytest.mark.parametrize("version, release", [
    ("2.13.0+cpu", (2, 13, 0)), ("2.7.1+cu126", (2, 7, 1)), ("2.8.0a0+git1234", (2, 8, 0)),
    ("2.13.0.dev20260101", (2, 13, 0)), ("3.0", (3, 0)), ("nonsense", ()),
])
def test_release_is_read_from_every_kind_of_version_string(version, release):
    assert torch_version.release(version) == release


def test_minimum_is_the_newest_api_the_course_uses():
    assert labkit.MIN_TORCH == max(labkit.TORCH_APIS.values())


@pytest.mark.parametrize("version", ["2.6.0", "2.4.1+cu121", "1.13.1"])
def test_an_older_torch_is_refused_with_what_it_lacks_and_how_to_upgrade(version):
    with pytest.raises(ImportError) as info:
        torch_version.check_torch_version(version)
    text = str(info.value)
    assert f"torch {version}" in text and "torch>=2.7" in text and "_scaled_mm" in text


@pytest.mark.parametrize("version", ["2.7.0", "2.14.1", torch.__version__])
def test_a_recent_enough_torch_is_accepted(version):
    torch_version.check_torch_version(version)


def test_the_installed_torch_passes_and_pyproject_declares_the_same_minimum():
    from pathlib import Path

    assert torch_version.release(torch.__version__) >= labkit.MIN_TORCH
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert f'"torch>={".".join(map(str, labkit.MIN_TORCH))}"' in pyproject


def test_import_labkit_fails_cleanly_on_an_old_torch(tmp_path):
    """A fake torch 2.4.1 distribution in front of the real one: `import labkit` must say why."""
    dist = tmp_path / "torch-2.4.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.4.1\n")
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import labkit"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0
    assert "labkit needs torch >= 2.7" in result.stderr and "torch 2.4.1" in result.stderr

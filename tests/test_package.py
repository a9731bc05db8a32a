"""The package: a lazy import that touches no GPU, its metadata, its wheel and sdist as users install them."""

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import time
import venv
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_import_is_lazy_touches_no_gpu_and_every_public_name_resolves():
    # A fresh interpreter: `import llm_speed` loads no torch; each public name is loaded on first use, and
    # none of that initialises CUDA.
    code = (
        "import sys, llm_speed\n"
        "assert 'torch' not in sys.modules\n"
        "missing = [name for name in llm_speed.__all__ if getattr(llm_speed, name, None) is None]\n"
        "assert not missing, missing\n"
        "from llm_speed import flash_attention, gemm\n"
        "assert flash_attention is llm_speed.attention.flash_attention and callable(gemm)\n"
        "assert set(llm_speed.__all__) <= set(dir(llm_speed))\n"
        "public = {name for name in dir(llm_speed) if not name.startswith('__')}\n"
        "assert public == set(llm_speed.__all__) - {'__version__'}, public ^ set(llm_speed.__all__)\n"
        "import torch\n"
        "assert not torch.cuda.is_initialized()\n"
        "print(llm_speed.__version__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0 and result.stdout.strip(), result.stderr[-2000:]


def test_unknown_attribute_is_an_attribute_error():
    import llm_speed

    with pytest.raises(AttributeError, match="no_such_name"):
        llm_speed.no_such_name  # noqa: B018


def test_pyproject_license_is_an_spdx_string_and_package_data_exists():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "MIT"  # PEP 639 form: no setuptools deprecation banner
    package_data = project.get("tool", {}).get("setuptools", {}).get("package-data", {})
    assert package_data, "pyproject declares no package-data"
    for package, patterns in package_data.items():
        folder = ROOT / "src" / package.replace(".", "/")
        for pattern in patterns:
            assert list(folder.glob(pattern)), f"{package}: {pattern} matches no file"


def test_the_version_is_written_in_one_place():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "llm_speed.__version__"}


# --- the package as users install it ---------------------------------------------------------------------
#
# The sdist is built from a copy of the source, the wheel from the unpacked sdist (as `python -m build` does),
# both with this environment's setuptools (no download). The wheel is installed into a fresh virtual
# environment that sees this environment's third-party packages through a .pth line (torch is not installed
# again); a .pth line only appends a directory, so the editable install's own .pth there is not processed and
# llm_speed can only come from the wheel. Everything runs from a directory outside the source tree.

PACKAGES = ("llm_speed", "cuda_llm_ops")
# Files other than modules that the package reads at run time; every other non-Python file under a package
# folder must be in the wheel too (test_wheel_and_sdist_hold_every_module_and_data_file).
WHEEL_DATA = ("llm_speed/perf/calibration.json",)
_JUNK = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
# The GPU machine's environment is not the dev one (its setuptools may predate 77) and its minutes are few:
# the package is CPU CI's to check.
cpu_ci_only = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the wheel is built and installed by CPU CI (make test); GPU minutes go to the GPU tests",
)


def _source_files() -> list[str]:
    """Every file under the package folders, relative to src/ (POSIX), without bytecode."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / "src" / package).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                found.append(path.relative_to(ROOT / "src").as_posix())
    return found


def _build(hook: str, source: Path, out: Path) -> Path:
    code = f"from setuptools import build_meta; print(build_meta.{hook}({str(out)!r}))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=source, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, f"{hook} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return out / result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def distributions(tmp_path_factory):
    """(sdist, wheel): the sdist of a copy of the source tree, the wheel built from the unpacked sdist."""
    import setuptools

    assert int(setuptools.__version__.split(".")[0]) >= 77, (
        f"setuptools {setuptools.__version__}: the build needs >= 77 (pyproject's build-system; in .[dev])"
    )
    work = tmp_path_factory.mktemp("dist")
    source = work / "source"
    shutil.copytree(ROOT / "src", source / "src", ignore=_JUNK)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    out = work / "out"
    out.mkdir()
    sdist = _build("build_sdist", source, out)
    with tarfile.open(sdist) as archive:  # the "data" filter: Python 3.10.12, 3.11.4 and later
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        archive.extractall(work / "unpacked", **safe)
    (unpacked,) = (work / "unpacked").iterdir()
    wheel = _build("build_wheel", unpacked, out)
    return sdist, wheel


@cpu_ci_only
@pytest.mark.xdist_group("package")
def test_wheel_and_sdist_hold_every_module_and_data_file(distributions):
    sdist, wheel = distributions
    from llm_speed import __version__

    assert wheel.name == f"llm_speed-{__version__}-py3-none-any.whl", wheel.name
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = set(archive.namelist())
        entry_points = archive.read(f"llm_speed-{__version__}.dist-info/entry_points.txt").decode()
    source = _source_files()
    assert set(WHEEL_DATA) <= set(source), "WHEEL_DATA names a file that is not in src/"
    missing = [name for name in dict.fromkeys((*WHEEL_DATA, *source)) if name not in in_wheel]
    assert not missing, f"not in the wheel (declare data files in pyproject's package-data): {missing}"
    assert "llm-speed = llm_speed.cli:main" in entry_points
    with tarfile.open(sdist) as archive:
        in_sdist = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    missing = [f"src/{name}" for name in source if f"src/{name}" not in in_sdist]
    missing += [name for name in ("pyproject.toml", "README.md") if name not in in_sdist]
    assert not missing, f"not in the sdist: {missing}"


def _fresh_environment(where: Path) -> Path:
    """A virtual environment without pip whose site-packages ends with this environment's (a .pth line)."""
    venv.EnvBuilder(with_pip=False, symlinks=os.name != "nt").create(where)
    python = where / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (Path(purelib) / "dev-environment.pth").write_text("".join(f"{path}\n" for path in ours))
    return python


# Run by the fresh environment's python under TRITON_INTERPRET=1: where llm_speed comes from, its version and
# dependencies, and three ops through their Triton kernels, each against a float64 reference.
_INSTALLED_CHECK = textwrap.dedent(
    """
    import importlib.metadata, sys, sysconfig
    from pathlib import Path
    from packaging.requirements import Requirement
    import llm_speed

    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    assert Path(llm_speed.__file__).resolve().parent == site / "llm_speed", llm_speed.__file__
    assert importlib.metadata.version("llm-speed") == llm_speed.__version__
    for text in importlib.metadata.requires("llm-speed") or []:
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            installed = importlib.metadata.version(requirement.name)
            assert requirement.specifier.contains(installed, prereleases=True), (text, installed)

    import torch
    from llm_speed.core import runtime

    torch.manual_seed(0)
    before = runtime.launch_counts()
    a, b = torch.randn(48, 40), torch.randn(40, 24)
    torch.testing.assert_close(llm_speed.gemm(a, b).double(), a.double() @ b.double(), atol=1e-4, rtol=1e-4)
    q, k, v = torch.randn(1, 2, 33, 16), torch.randn(1, 1, 40, 16), torch.randn(1, 1, 40, 16)
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().expand(1, 2, 40, 16), v.double().expand(1, 2, 40, 16)
    )
    torch.testing.assert_close(llm_speed.flash_attention(q, k, v).double(), reference, atol=1e-4, rtol=1e-4)
    x, w = torch.randn(5, 64), torch.randn(64)
    reference = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(llm_speed.rms_norm(x, w).double(), reference, atol=1e-5, rtol=1e-5)
    ran = runtime.launch_counts() - before
    assert len(ran) >= 3, ran  # three Triton kernels ran, not the PyTorch fallbacks
    print("ok", llm_speed.__version__, sorted(ran))
    """
)


@cpu_ci_only
@pytest.mark.xdist_group("package")
def test_the_wheel_installed_in_a_fresh_environment_runs_the_commands_and_the_ops(distributions, tmp_path):
    _, wheel = distributions
    from llm_speed import __version__

    python = _fresh_environment(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET", "PYTHONHOME")}
    env.pop("LLM_SPEED_TRITON_GPU", None)  # the installed Triton, as a user has it
    work = tmp_path / "elsewhere"  # outside the source tree: nothing can be imported from src/
    work.mkdir()
    timings = {}

    def run(*argv: str, extra_env: dict | None = None) -> subprocess.CompletedProcess:
        started = time.perf_counter()
        result = subprocess.run(
            argv, cwd=work, env={**env, **(extra_env or {})}, capture_output=True, text=True, timeout=300,
            check=False,
        )  # fmt: skip
        timings[" ".join(Path(a).name if i == 0 else a for i, a in enumerate(argv))[:50]] = (
            time.perf_counter() - started
        )
        assert result.returncode == 0, f"{argv}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        return result

    run(str(python), "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--ignore-installed",
        "--disable-pip-version-check", str(wheel))  # fmt: skip
    command = str(python.parent / ("llm-speed.exe" if os.name == "nt" else "llm-speed"))
    assert run(command, "--version").stdout.strip() == f"llm-speed {__version__}"
    assert "ok" in run(str(python), "-c", _INSTALLED_CHECK, extra_env={"TRITON_INTERPRET": "1"}).stdout
    predicted = run(command, "predict", "gemm", "m=4096", "n=4096", "k=4096").stdout
    assert "gemm on " in predicted and "predicted" in predicted, predicted
    kernels = run(command, "kernels", "--op", "gemm", "--workers", "1")
    assert "matmul.gemm" in kernels.stdout and "kernels compiled" in kernels.stderr, kernels.stderr
    demo = run(command, "demo", "--output-dir", "demo")
    assert (work / "demo" / "roofline.png").is_file() and (work / "demo" / "demo.json").is_file(), demo.stdout
    print("seconds per step:", {name: round(seconds, 1) for name, seconds in timings.items()})

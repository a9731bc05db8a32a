import subprocess
import sys


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
        "import torch\n"
        "assert not torch.cuda.is_initialized()\n"
        "print(llm_speed.__version__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0 and result.stdout.strip(), result.stderr[-2000:]


def test_unknown_attribute_is_an_attribute_error():
    import pytest

    import llm_speed

    with pytest.raises(AttributeError, match="no_such_name"):
        llm_speed.no_such_name  # noqa: B018


def test_pyproject_license_is_an_spdx_string_and_package_data_exists():
    from pathlib import Path

    import pytest

    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())
    assert project["project"]["license"] == "MIT"  # PEP 639 form: no setuptools deprecation banner
    package_data = project.get("tool", {}).get("setuptools", {}).get("package-data", {})
    for package, patterns in package_data.items():
        folder = root / "src" / package.replace(".", "/")
        for pattern in patterns:
            assert list(folder.glob(pattern)), f"{package}: {pattern} matches no file"

import subprocess
import sys


def test_import_touches_no_gpu():
    # A fresh interpreter: importing the package must not initialise CUDA.
    code = "import torch, llm_speed; assert not torch.cuda.is_initialized(); print(llm_speed.__version__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip()

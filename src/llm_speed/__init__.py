"""llm-speed: fast LLM kernels in Triton, a performance model that explains them, and benchmarks.

Importing the package never touches a GPU.
"""

__version__ = "0.1.0"

"""The one place where the Gluon kernels meet differences between Triton releases: the GPU machine's Triton
3.6 (torch 2.11's pin, what runs on the GPU) and the development pin (3.9).

- TMA copies: 3.6 names them ``tma.async_copy_global_to_shared`` / ``async_copy_shared_to_global``; 3.9
  renamed them ``tma.async_load`` / ``async_store`` (same arguments for what the kernels pass) and made
  the old names raise. The kernels call :data:`tma_load` and :data:`tma_store`, bound here to whichever
  this Triton has.
"""

from __future__ import annotations

from triton.experimental.gluon.language.nvidia.hopper import tma

tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

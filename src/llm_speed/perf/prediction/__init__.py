"""The parts of :mod:`llm_speed.perf.predict` by role: the names and result types (``names``), the
calibration data (``calibration_data``), the shared building blocks (``terms``), one cost model per op family
(``gemm``, ``attention``, ``elementwise``, ``moe``, ``collectives``). Import the public API from
:mod:`llm_speed.perf.predict`."""

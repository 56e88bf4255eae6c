"""Engine arguments, with vLLM's names: EngineConfig, dtype names and the CPU memory budget.

They are defined in models.engine_config (below runtime, so that ir.dump's flags are everyone's
flags); this module is where the runtime and users import them from.
"""

from models.engine_config import (AUTO_DTYPE, CPU_DEVICE_MEMORY, DTYPE_ALIASES, KERNEL_BACKENDS, EngineConfig,
                                  resolve_dtype)

__all__ = ["AUTO_DTYPE", "CPU_DEVICE_MEMORY", "DTYPE_ALIASES", "KERNEL_BACKENDS", "EngineConfig", "resolve_dtype"]

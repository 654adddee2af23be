"""llamem: plan and manage GPU memory for LLaMA-family models.

The core (specs, presets, the analytic engine) imports no torch; `llamem.trace` does.
"""

from llamem.analytic import estimate
from llamem.errors import ConfigError, DoesNotFit, InvalidWorkload, LlamemError, UnknownModel
from llamem.model import ModelSpec, load_model
from llamem.report import MemoryReport
from llamem.workload import Workload, build_workload

__version__ = "0.1.0"

__all__ = ["estimate", "load_model", "build_workload", "ModelSpec", "Workload", "MemoryReport",
           "LlamemError", "UnknownModel", "ConfigError", "InvalidWorkload", "DoesNotFit", "__version__"]

"""fedvl: federated virtual learning on one message-based core.

Importing the package registers every built-in method, add-on, benchmark, model and
virtual-data generator: each subpackage's `__init__` imports its modules, whose decorators
fill the tables of `fedvl.registry` (which itself imports nothing of fedvl).
"""

__version__ = "0.1.0"

from fedvl import algorithms, data, models, virtual  # noqa: E402, F401  (registers built-ins)

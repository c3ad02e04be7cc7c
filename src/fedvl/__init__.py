"""fedvl: federated virtual learning on one message-based core."""

__version__ = "0.1.0"

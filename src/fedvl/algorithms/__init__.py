"""Federated algorithms, one module per method."""

from fedvl.algorithms import fedavg, fednova, fedopt, fedprox, local, moon, scaffold  # noqa: F401
from fedvl.algorithms.base import Algorithm, ClientContext, Env, make_algorithm

__all__ = ["Algorithm", "ClientContext", "Env", "make_algorithm"]

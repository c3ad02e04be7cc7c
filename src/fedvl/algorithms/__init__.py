"""Federated algorithms, one module per method."""

from fedvl.algorithms import (  # noqa: F401  (registers the methods and add-ons)
    centralised,
    coboosting,
    compose,
    dense,
    desa,
    dfrd,
    dynafed,
    fccl,
    fedaf,
    fedavg,
    fedbn,
    fedd3,
    feddf,
    feddm,
    feddyn,
    fedgan,
    fedgen,
    fedhe,
    fedlapdp,
    fedlgd,
    fedmix,
    fednova,
    fedopt,
    fedproto,
    fedprox,
    fedvck,
    local,
    moon,
    scaffold,
    vftl,
    vhl,
)
from fedvl.algorithms.base import Algorithm, ClientContext, Env, make_algorithm

__all__ = ["Algorithm", "ClientContext", "Env", "make_algorithm"]

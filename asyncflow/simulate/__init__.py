"""``asyncflow simulate``: a compiled plan executed in virtual time (README, "Simulate").

:func:`simulate` runs the runtime's scheduling code (store, workers' leases, gate, windows,
versions) with device times from the cost hints; :mod:`asyncflow.simulate.core` says exactly what
is shared with ``asyncflow run`` and what is not modelled.
"""
from asyncflow.simulate.core import Device, SimResult, Simulation, device, simulate

__all__ = ["Device", "SimResult", "Simulation", "device", "simulate"]

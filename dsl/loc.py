"""Source locations: :mod:`asyncflow.loc`, re-exported here for the front ends."""
from asyncflow.loc import SourceLoc, Sources

__all__ = ["SourceLoc", "Sources"]

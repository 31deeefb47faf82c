"""AF6xx: user errors found when a plan runs (data that cannot be read, a bad resume directory)."""
from asyncflow.diagnostics import Code

CODES = [
    Code("AF601", "data-unreadable", "data source '{name}' ({source}) cannot be read: {reason}"),
    Code("AF602", "data-empty", "data source '{name}' ({source}) gave no rows"),
    Code("AF603", "data-fields", "data source '{name}' ({source}): row {row} has no field '{field}'"),
    Code("AF604", "cluster-lacks-resources",
         "pool '{pool}' needs {need:g} {resource} in one bundle but no node of the Ray cluster has "
         "that much (the largest has {have:g}; the cluster: {cluster})"),
]

"""Run options: the knobs of one run, one frozen object handed down from the CLI."""
from __future__ import annotations

#: the longest any call to a runtime actor (store shard, control, weight board) may take, plus
#: the call's own wait, before the actor counts as lost
DEFAULT_CALL_TIMEOUT_S = 120.0

"""asyncflow: a dataflow-graph language and compiler for asynchronous, streaming RL post-training."""
__version__ = "0.1.0"

import time as _time

STARTED = _time.time()  # first import of asyncflow: the start-up breakdown's "imports" begin here

"""asyncflow: a dataflow-graph language and compiler for asynchronous, streaming RL post-training."""
__version__ = "0.1.0"

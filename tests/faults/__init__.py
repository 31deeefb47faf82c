"""Fault tests: every run either finishes with every sample trained exactly once or ends with a
clear, coded error; none hangs, none leaves a process behind (``asyncflow run --inject``)."""

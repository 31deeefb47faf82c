"""AF5xx: command-line ``--set key.path=value`` overrides."""
from asyncflow.diagnostics.code import Code
from asyncflow.diagnostics.examples import BASE, Example

CODES = [
    Code("AF501", "bad-override", "'--set {text}' is not of the form key.path=value",
         (Example(BASE, at="tasks", sets=("tasks.update.args.lr",), in_set=True),)),
    Code("AF502", "override-no-such-name", "--set: there is no '{seg}' in {prefix}",
         (Example(BASE, at="updat", sets=("tasks.updat.args.lr=1e-3",), in_set=True),)),
    Code("AF503", "override-index", "--set: {prefix} has {size} items, there is no item {index}",
         (Example(BASE, at="3", sets=("sync.3.max_staleness=0",), in_set=True),)),
    Code("AF504", "override-not-container", "--set: {prefix} is {got}, it has no '{seg}'",
         (Example(BASE, at="x", sets=("step.steps.x=1",), in_set=True),)),
    Code("AF505", "override-value", "--set: cannot read the value '{value}'",
         (Example(BASE, at="[1,", sets=("tasks.update.inputs=[1,",), in_set=True),)),
]

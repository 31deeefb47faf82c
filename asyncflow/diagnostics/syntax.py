"""AF1xx: the source cannot be read or does not parse."""
from asyncflow.diagnostics import Code, Example

CODES = [
    Code("AF100", "unreadable-file", "cannot read '{path}': {reason}"),
    Code("AF101", "yaml-syntax", "YAML syntax error: {problem}",
         (Example("pipeline: x\ntasks: [a\n", at="", ),)),
    Code("AF102", "empty-file", "the file is empty: a pipeline needs at least `pipeline:` and `tasks:`",
         (Example("# nothing here\n", at="#"),)),
    Code("AF103", "duplicate-key", "duplicate key '{key}' (first given on line {first})",
         (Example("pipeline: a\npipeline: b\n", at="pipeline: b"),)),
    Code("AF104", "complex-key", "a key must be a plain name, not a list or mapping",
         (Example("pipeline: a\n? [x, y]\n: 1\n", at="[x, y]"),)),
    Code("AF105", "merge-key", "YAML merge keys (<<) are not supported: write the keys out",
         (Example("pipeline: a\n<<: {b: 1}\n", at="<<"),)),
    Code("AF106", "unknown-suffix", "unknown file type '{suffix}': use .yaml, .yml or .af"),
]

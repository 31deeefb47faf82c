"""AF2xx: keys and values of one section (unknown, missing, wrong type)."""
from asyncflow.diagnostics import Code
from asyncflow.diagnostics.examples import mutate

CODES = [
    Code("AF201", "unknown-key", "unknown key '{key}' in {where}",
         (mutate("    estimator: grpo", "    estimater: grpo", at="estimater"),
          mutate("  prompts_per_step: 4", "  prompt_per_step: 4\n  prompts_per_step: 4",
                 at="prompt_per_step"))),
    Code("AF202", "wrong-type", "'{key}' must be {expected}, not {got}",
         (mutate("  steps: 2", "  steps: two", at="two"),
          mutate("    inputs: [reward]", "    inputs: reward", at="reward\n    outputs: [advantages]"),
          mutate("    frozen: true", "    frozen: 3", at="3"))),
    Code("AF203", "missing-key", "{where} needs the key '{key}'",
         (mutate("    kind: advantage\n", "", at="advantage:"),
          mutate("  steps: 2\n", "", at="step:"))),
    Code("AF204", "bad-name", "'{value}' is not a valid name: use letters, digits and _, not starting with a digit",
         (mutate("  score:", "  2score:", at="2score"),)),
    Code("AF205", "bad-choice", "'{value}' is not a valid {key}: choose one of {choices}",
         (mutate("    kind: reward", "    kind: rewrd", at="rewrd"),)),
    Code("AF206", "out-of-range", "'{key}' must be {bound}, not {value}",
         (mutate("  rollout: {devices: 1}", "  rollout: {devices: 0}", at="0}\n  train"),
          mutate("max_staleness: 1", "max_staleness: -1", at="-1"))),
    Code("AF207", "bad-reference", "'{key}' must be a \"module:function\" reference, not '{value}'",
         (mutate("fn: asyncflow.rewards:digits_match", "fn: digits_match", at="digits_match"),)),
    Code("AF208", "duplicate-field", "'{value}' is listed twice in '{key}'",
         (mutate("    inputs: [prompt, answer, response]", "    inputs: [prompt, answer, prompt]",
                 at="prompt]\n    outputs: [reward]"),)),
    Code("AF209", "wrong-section-type", "{what} must be a mapping of keys, not {got}",
         (mutate("  rollout: {devices: 1}", "  rollout: 1", at="1\n"),)),
]

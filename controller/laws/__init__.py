"""Control laws: pure functions from (state, measurements, dt) to a batch token budget.

`pi` (velocity-form PI per output, min-selected), `mpc` (condensed LP over the identified
model), `slack` (Heracles-style thresholds) and `feedforward` (interactive rate forecast).
"""

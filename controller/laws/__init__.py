"""Control laws behind the `Law` protocol (`base`), registered by name in `registry`.

`pi` (velocity-form PI per output, min-selected), `mpc` (condensed LP over the identified
model), `slack` (Heracles-style thresholds); `smoothing` and `wrappers` (feed-forward from
the interactive rate forecast in `feedforward`, gain scheduling) wrap any of them.
"""

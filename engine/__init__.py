"""prefixscore.engine: a request from validation to the device and back, in four rooms.

requests/ (the kinds: validation, templates, each kind's rows and answer) -> loop/ (the
device loop: its input record, the queue of work units that carry their replies, the
batcher that plans calls, admission, page pins, failure isolation and recovery, metrics)
-> runtime/ (the planner's typed call inputs, the scoring engine's compiled call shapes,
the prefix pool's page book, mesh, buckets, compile cache); hosts/ runs one engine over
several hosts. `scorer.Scorer` (the in-process API) and `build` (an engine from its
options, engine/options.py) wire them. lint-imports holds the layers and keeps the loop
from importing a kind.
"""

"""prefixscore.engine: a request from validation to the device and back.

validation (and templates) -> batcher (the queue of work_unit's WorkUnits, which carry
their replies) -> planner (one device call's typed inputs) -> executables (compiled per
call shape) -> device_loop (the one thread that plans, launches and reads back; beside it
admission, page_pins, recovery and loop_metrics), over the prefix pool's page book
(prefix_cache). `scorer.Scorer` is the in-process API on top.
"""

"""The runtime: the scoring engine (its compiled call shapes, the prefix pool and the mesh), the
planner that lays a call out, the prefix cache's book of pages, the buckets, the compile cache
and what a leader sends the other hosts of a group (call_broadcast); beside the engine, its staged
warm-up (warmup), the pool's size (pool_size) and the packed baseline's call (packed_call)."""

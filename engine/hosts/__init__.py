"""Several hosts as one engine: the host group (JAX's multi-controller runtime) and the step
channel on which the leader sends each call to the followers."""

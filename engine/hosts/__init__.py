"""Several hosts as one engine: the host group (JAX's multi-controller runtime), the step channel
on which the leader sends each call to the followers, and a follower's run of each call it is
sent (follower_steps)."""

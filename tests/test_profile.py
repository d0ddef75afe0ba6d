"""bench --profile's summary: kernels of a real trace attributed to the named scopes that made them."""

import jax
import jax.numpy as jnp

from prefixscore.bench import profile


def test_trace_time_is_attributed_to_named_scopes(tmp_path):
    @jax.jit
    def f(x):
        with jax.named_scope("mlp"):
            y = jnp.sort(x @ x, axis=-1)  # a sort: a kernel of its own, not fused into the head
        with jax.named_scope("head"):
            return jnp.sum(jnp.exp(y @ x), axis=-1)

    x = jax.random.normal(jax.random.key(0), (256, 256))
    f(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        f(x).block_until_ready()
    hlo = f.lower(x).compile().as_text()
    scopes = profile.scopes_by_instruction([hlo])
    assert any(op.endswith("mlp/dot_general") for op in scopes.values())

    s = profile.summarize(profile.latest_xplane(tmp_path), [hlo], wall_s=10.0)
    assert s["kernels"] > 0 and set(s["parts_ms"]) >= {"mlp", "head"}
    assert 0 < s["device_busy_ms"] <= s["wall_ms"] and s["host_and_gaps_ms"] > 0
    assert "mlp" in profile.format_summary(s)


def test_parts_follow_the_innermost_known_scope():
    assert profile.part_of("jit(call)/shard_map/while/body/attention/prefix_part/dot_general") == "prefix_part"
    assert profile.part_of("jit(call)/while/body/attention/dot_general") == "attention_other"
    assert profile.part_of("jit(call)/head/while/body/exp") == "head"
    assert profile.part_of(None) == profile.OTHER and profile.part_of("jit(call)/gather") == profile.OTHER

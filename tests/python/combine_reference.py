"""flash_attn_combine written directly in JAX (logsumexp / softmax over the splits), and the loss
through which the gradient tests compare it with the library's combine (CPU and GPU tests)."""

from __future__ import annotations


def jax_combine_direct(jax, merged):
    """combine(out_partial, lse_partial) -> (out, lse) in jax.numpy: rows outside `merged` or
    with no split give 0 (and no gradient)."""
    jnp = jax.numpy

    def direct(o, l):
        empty = ~jnp.isfinite(l).any(0)
        l = jnp.where(empty, 0.0, l)
        out = jnp.sum(jax.nn.softmax(l, axis=0)[..., None] * jnp.where(jnp.isfinite(o), o, 0.0), axis=0)
        keep = merged & ~empty
        return jnp.where(keep[..., None], out, 0.0), jnp.where(keep, jax.nn.logsumexp(l, axis=0), 0.0)

    return direct


def jax_combine_loss(jax, combine, weights, merged):
    """A scalar of both outputs of `combine`: out weighted, plus lse over the merged finite rows."""
    jnp = jax.numpy

    def loss(o, l):
        out, lse = combine(o, l)
        return jnp.sum(out * weights) + jnp.sum(jnp.where(jnp.isfinite(lse) & merged, lse, 0.0))

    return loss

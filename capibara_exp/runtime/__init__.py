"""The local engine: T5X's train contract on jax/flax/optax/orbax (see docs/design.md)."""

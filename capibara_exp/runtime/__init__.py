"""The local engine: T5X's train contract on jax/flax/optax/orbax (see DESIGN.md)."""

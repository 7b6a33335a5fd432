"""Compose time: the config's schema, checks and resolvers, the merge-method table and the
pure conf -> gin bridge. Nothing here imports JAX, TensorFlow, SeqIO or the runtime, so a
bad key fails before any heavy import."""

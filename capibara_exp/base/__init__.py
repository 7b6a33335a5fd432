"""The ground floor: modules that import nothing of the project outside this package
(errors, paths, process environment, phases, slice and mesh tables, model facts, file
writing and locks, metrics files, and the Optuna and private-API wrappers)."""

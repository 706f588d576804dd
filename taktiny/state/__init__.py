"""Naming, reading and loading the leaves of any tree: flat names, name patterns, the two
views of a tree, resolution of names to leaves, value checks, other representations,
the load itself, and the problem records with `StateDictError`. The design note is
`_state.md` beside this file. The public names are re-exported by ``taktiny``; nothing
is imported here, so that a process reading only safetensors headers never imports JAX."""

"""Sharding: PartitionSpecs and the ambient mesh (`_specs`), placing a tree by rules over
its names (`_plan`: ``tt.shard``, ``tt.sharding_plan``) and abstract trees that keep their
shardings (`_eval_shape`: ``tt.eval_shape``). The public names are re-exported by
``taktiny``; this package's ``__init__`` imports nothing."""

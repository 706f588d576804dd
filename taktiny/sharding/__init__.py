"""Placing a tree on devices by ordered rules over its leaves' flat names (`_shard.py`:
``tt.shard``, ``tt.sharding_plan``, `ShardingPlan`). The specs, meshes and abstract arrays
it builds on are `taktiny.arrays`'. Other packages import through this face; the public
names are re-exported by ``taktiny``. Each name is imported when first used."""

from .. import _lazy

__getattr__, __dir__, __all__ = _lazy.face(__name__, __file__, globals())

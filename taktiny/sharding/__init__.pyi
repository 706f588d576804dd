"""Placing a tree on devices by ordered rules over its leaves' flat names (`_shard.py`:
``tt.shard``, ``tt.sharding_plan``, `ShardingPlan`). The specs, meshes and abstract arrays
it builds on are `taktiny.arrays`'. Other packages import through this face; the public
names are re-exported by ``taktiny``. Each name is imported when first used."""

from ._shard import ShardingPlan as ShardingPlan
from ._shard import shard as shard
from ._shard import sharding_plan as sharding_plan

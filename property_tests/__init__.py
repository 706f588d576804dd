"""Hypothesis properties of Taktiny's state API, on random modules and sharded arrays.

Every property draws modules from `strategies.models` (random classes, up to four levels
deep, arrays mostly sharded over a random mesh) and runs once per platform (``cpu``; ``gpu``
and ``tpu`` report as skipped where absent). Examples per property, with the ``ci`` profile
(the default, derandomized; ``make test``) and ``thorough`` (``make property``):

=====================================================================  ====  ========
property                                                                ci   thorough
=====================================================================  ====  ========
test_round_trip  own state loads back to an equal module (3)            150   1500
test_round_trip  nested and flat states describe the same leaves (4)    150   1500
test_partial     a partial load changes exactly the supplied leaves (5)  150   1500
test_errors      strict fails exactly when a leaf is missing (6)        100   1000
test_errors      unknown keys always fail and are all listed (6)        120   1200
test_errors      bad values are all listed, nothing is loaded (6)       120   1200
test_transforms  loading inside jit equals loading outside (7)           40    400
test_transforms  gradients through a load equal the model's (7)          30    300
test_orbax       Orbax round trip, bitwise, target's shardings (8)       40    400
test_orbax       Orbax onto a tt.shard target on another mesh (8)        25    250
test_sharding    loading onto another placement reshards (9)            100   1000
test_sharding    tt.shard gives each leaf its first matching rule        80    800
test_sharding    tt.shard between meshes of any device order             30    300
test_sharding    host (NumPy) values load onto the leaves' shardings     50    500
test_sharding    tt.eval_shape(optimizer.init): moments as params        40    400
=====================================================================  ====  ========

(The numbers in brackets are the invariants of issue 4.) The ``accelerator`` profile (``make
test-accelerator``) runs half the ``ci`` counts, and a GPU's or TPU's variant draws its arrays
from a few fixed shapes and dtypes (`property_tests.arrays`). With ``-n 2`` on two shared cores
the ``ci`` suite takes about 40-70 s. `mutants.py` runs deliberately broken variants of the
state walk against the properties that are expected to catch them:
``python -m property_tests.mutants``.
"""

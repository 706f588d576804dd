#!/usr/bin/env bash
# Copies the package and the suites into FOLDER and plants five one-line faults in the copy
# (docs/testing.md, "On an accelerator host"): loaded leaves written as zeros (ones under a
# trace), an error keeping only its first problem, the flat state sorted, tt.shard
# replicating every leaf, tt.eval_shape blind to the arguments' mesh. Every property fails
# on one of them; run the suite from FOLDER to see each fail (python -c 'import taktiny'
# there imports the copy). Prints how many of the five lines it changed.
#     bash property_tests/plant_faults.sh /tmp/broken && cd /tmp/broken && python -m pytest -q property_tests -k tpu ...
set -euo pipefail
B=${1:?usage: plant_faults.sh FOLDER}
rm -rf "$B"; mkdir -p "$B"; cp -r taktiny tests property_tests conftest.py pyproject.toml "$B"
cd "$B"; s=taktiny/state/_state.py
sed -i '$ s/return view.write(new)/return view.write(jax.tree.map(lambda x: (jnp.ones_like if isinstance(x, Tracer) else jnp.zeros_like)(x), new))/' $s
sed -i 's/in_order(problems), matched/list(in_order(problems))[:1], matched/' $s
sed -i 's/dict(zip(spec.names, leaves, strict=True))/dict(sorted(zip(spec.names, leaves, strict=True)))/' taktiny/state/_tree.py
sed -i 's/NamedSharding(mesh, spec)) for/NamedSharding(mesh, PartitionSpec())) for/' taktiny/sharding/_shard.py
sed -i '0,/^    return found$/ s//    return []/' taktiny/arrays/_eval_shape.py
echo "lines broken: $(diff -r ~-/taktiny taktiny | grep -c '^>') of 5"

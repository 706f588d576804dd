export PIP_CONFIG_FILE=/dev/null
[ -d /tmp/site-idx/orbax ] || python3 -m pip install --isolated -q --only-binary=:all: --index-url file:///opt/pypi/simple --target /tmp/site-idx orbax-checkpoint safetensors tqdm pytest hypothesis pytest-timeout optax
[ -d /tmp/site-torch/torch ] || python3 -m pip install --isolated -q --only-binary=:all: --index-url file:///opt/pypi/simple --find-links /opt/wheels --target /tmp/site-torch torch==2.13.0
rm -rf /tmp/site; python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl-tpu/*.whl
export PYTHONPATH=$PYTHONPATH:/tmp/site:/tmp/site-idx:/tmp/site-torch
P="python -m pytest -q property_tests -k tpu --hypothesis-profile=accelerator -W ignore::DeprecationWarning -p no:cacheprovider"; I='import taktiny; print("taktiny from", taktiny.__file__)'
python -c "$I"; S=$SECONDS; JAX_PLATFORM_NAME=cpu $P --durations=0 --tb=short -p property_tests.compiles 2>&1 | tail -75; echo "== run: $((SECONDS-S)) s"
B=/tmp/broken; rm -rf $B; mkdir $B; cp -r taktiny tests property_tests conftest.py pyproject.toml $B; (cd $B && s=taktiny/state/_state.py &&
sed -i '$ s/return view.write(new)/return view.write(jax.tree.map(lambda x: (jnp.ones_like if isinstance(x, Tracer) else jnp.zeros_like)(x), new))/' $s &&
sed -i 's/in_order(problems), matched/list(in_order(problems))[:1], matched/' $s &&
sed -i 's/dict(zip(spec.names, leaves, strict=True))/dict(sorted(zip(spec.names, leaves, strict=True)))/' taktiny/state/_tree.py &&
sed -i 's/NamedSharding(mesh, spec)) for/NamedSharding(mesh, PartitionSpec())) for/' taktiny/sharding/_shard.py &&
sed -i '0,/^    return found$/ s//    return []/' taktiny/arrays/_eval_shape.py &&
echo "lines broken: $(diff -r ~-/taktiny taktiny | grep -c '^>') of 5" && python -c "$I" && S=$SECONDS &&
JAX_PLATFORM_NAME=cpu timeout 150 $P --tb=line -rfEp 2>&1 | grep -E '^(/|FAILED|PASSED|ERROR|[0-9]+ [a-z])' | cut -c1-200; echo "== broken run: $((SECONDS-S)) s"); rm -rf $B
S=$SECONDS; JAX_PLATFORM_NAME=cpu timeout 120 python -m pytest -q -p no:cacheprovider --tb=short tests/loading/test_ways.py tests/loading/test_load.py tests/io/test_save.py tests/io/test_background.py tests/nn/test_quantized.py -k "tpu or callers_default" 2>&1 | tail -30; echo "== unit tpu: $((SECONDS-S)) s"

"""Checkpoints in object storage, against a real S3-compatible server (moto's, started on
127.0.0.1 by the fixtures in conftest.py; tests/_s3.py): saves and loads by URL, bitwise as
local files; the commit without rename (what each save leaves in the bucket, what a load
that a save overtakes reads); faults through the real HTTP path (a proxy that answers 503
or 403, drops connections, stalls); hostile objects refused as files are; the command.

The races, kills and multi-process loads are in tests/io/test_object_store_races.py.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import _loopback
import jax.numpy as jnp
import numpy as np
import obstore
import pytest
from _s3 import kept
from _s3_saver import version
from obstore.store import from_url
from test_hostile import FILES, INDEXES, framed, js

import taktiny as tt
from taktiny import _cli
from taktiny.io import (
    SafetensorsError,
    load_safetensors,
    open_safetensors,
    plan_load,
    save_safetensors,
)
from taktiny.io import _object_store as objects
from taktiny.io._object_store import Replaced

pytestmark = pytest.mark.program  # (a server process; too slow to repeat for each mutant)


def values(number: int) -> dict[str, np.ndarray]:
    """A flat checkpoint whose every value says its version: 3 tensors, ~390 KB."""
    return version(number)


def target() -> dict[str, jnp.ndarray]:
    return {k: jnp.zeros(v.shape, v.dtype) for k, v in values(0).items()}


def names(bucket: str, prefix: str = "") -> list[str]:
    """The objects in the bucket, under `prefix`."""
    found = obstore.list(from_url(bucket), prefix or None).collect()
    return sorted(m["path"] for m in found)


def put(url: str, data: bytes) -> None:
    where = objects.Url(url)
    obstore.put(objects.store(where), where.key, data)


def drop(metadata: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in metadata.items() if k != "taktiny_header_checksums"}


def same(loaded, expected) -> bool:
    return all(np.asarray(loaded[k]).tobytes() == v.tobytes() for k, v in expected.items())


@pytest.mark.parametrize("shard", [None, "150KB"], ids=["one object", "shards"])
def test_a_save_to_a_url_loads_bitwise_as_the_local_file(s3, tmp_path, shard):
    url = f"{s3}/run/model.safetensors"
    written = save_safetensors(url, values(1), max_shard_size=shard)
    local = save_safetensors(tmp_path / "model.safetensors", values(1), max_shard_size=shard)
    assert [str(w) for w in written] == (
        [f"{s3}/run/model.safetensors"]
        if shard is None
        else [*(str(w) for w in written[:-1]), f"{url}.index.json"]
    )
    assert len(written) == len(local)
    assert names(s3) == sorted(objects.Url(str(w)).key for w in written)
    remote, disk = open_safetensors(url), open_safetensors(local[-1])
    assert list(remote) == list(disk)
    # (the header's own digest differs: safetensors writes the metadata in hash-map order)
    assert drop(remote.metadata) == drop(disk.metadata)
    for name in disk:
        assert remote[name].read().tobytes() == disk[name].read().tobytes()
        assert remote[name].checksum == disk[name].checksum is not None
    assert same(load_safetensors(target(), url, progress=False), values(1))
    assert same(load_safetensors(target(), f"{s3}/run/", progress=False), values(1))  # a prefix


def test_a_model_round_trips_with_its_schema(s3):
    model = tt.nn.Linear(16, 8, rngs=tt.nn.Rngs(0))
    save_safetensors(f"{s3}/m.safetensors", model)
    assert open_safetensors(f"{s3}/m.safetensors").schema == tt.schema(model)
    loaded = load_safetensors(tt.eval_shape(lambda: model), f"{s3}/m.safetensors")
    assert tt.flat_state_dict(loaded).keys() == tt.flat_state_dict(model).keys()
    for (_, a), (_, b) in zip(
        tt.flat_state_dict(loaded).items(), tt.flat_state_dict(model).items(), strict=True
    ):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_each_save_leaves_its_own_objects_and_keeps_the_previous_checkpoints(s3):
    """One object over shards, shards over one object, shards over shards, one object over
    one object: after each save the bucket holds the new checkpoint's objects, the
    previous checkpoint's kept for its readers (its shards as they were, or a copy of its
    one object under `previous_copy`'s name) and the record naming them, and nothing
    else; it loads the new version, and a checkpoint opened before the save reads the
    previous one, bitwise, through the kept objects."""
    url = f"{s3}/ck/model.safetensors"
    record = "ck/.model.safetensors.previous.json"
    previous: list[str] = []  # the keys the last checkpoint is kept under by the next save
    opened = None
    for number, shard in enumerate([None, "150KB", "200KB", None, None, "150KB"], start=1):
        written = save_safetensors(url, values(number), max_shard_size=shard)
        expected = [w.key for w in written] + previous + ([record] if previous else [])
        assert names(s3) == sorted(expected), number
        assert same(load_safetensors(target(), url, progress=False), values(number))
        if opened is not None:
            assert same({k: t.read() for k, t in opened.items()}, values(number - 1)), number
        opened = open_safetensors(url)
        if shard is None:
            etag = obstore.head(objects.store(objects.Url(url)), "ck/model.safetensors")["e_tag"]
            previous = [objects.previous_copy(objects.Url(url), etag).key]
        else:
            previous = [w.key for w in written if not w.name.endswith(".json")]


def test_a_save_removes_what_a_failed_save_left(s3):
    url = f"{s3}/ck/model.safetensors"
    first = save_safetensors(url, values(1), max_shard_size="150KB")
    put(f"{s3}/ck/model-00001-of-00002-0123abcd.safetensors", b"left by a killed save")
    put(f"{s3}/ck/.model.safetensors.0123456789abcdef.previous", b"a copy a killed save made")
    put(f"{s3}/ck/notes.txt", b"the user's own")  # not the checkpoint's: stays
    assert same(load_safetensors(target(), url, progress=False), values(1))  # ignored
    written = save_safetensors(url, values(2))
    kept = sorted(w.key for w in first if not w.name.endswith(".json"))  # (for its readers)
    assert names(s3) == sorted(["ck/.model.safetensors.previous.json", *kept,
                                "ck/model.safetensors", "ck/notes.txt"])  # fmt: skip
    assert [str(w) for w in written] == [url]


def test_an_opened_checkpoint_reads_its_version_through_one_save_and_says_so_after_two(s3):
    """An `open_safetensors` handle on a URL reads the version it opened while one later
    save commits (as a handle on a local file does), from the copy that save kept of the
    object it wrote over; once a second save has removed that copy too, its reads raise
    `Replaced`, and a load of it does (it is not opened again behind the caller's back)."""
    url = f"{s3}/model.safetensors"
    save_safetensors(url, values(1))
    opened = open_safetensors(url)
    save_safetensors(url, values(2))
    assert opened["embed"].read().tobytes() == values(1)["embed"].tobytes()
    assert same(load_safetensors(target(), opened, progress=False), values(1))
    save_safetensors(url, values(3))
    with pytest.raises(Replaced, match=rf"^{re.escape(url)}: the object was replaced or removed"):
        opened["head.kernel"].read()
    with pytest.raises(Replaced, match="open the checkpoint again"):
        load_safetensors(target(), opened, progress=False)  # an opened checkpoint: not reopened
    assert same(load_safetensors(target(), url, progress=False), values(3))


def test_every_part_of_a_read_asks_for_the_version_opened(s3_proxy, monkeypatch):
    """A read of an object in several ranged GETs (64 KiB parts here) sends the ETag it
    opened with every one (If-Match): a save that commits between the first part and the
    others (held back by the proxy until it has) leaves the read whole: the later parts
    fail their If-Match, and the read is made again from the copy the save kept, bitwise
    the version opened. Planted: If-Match on the first part only (`offset == start` in
    `_part`): the later parts read the new version, and the tensor reads as damaged."""
    import threading

    bucket, proxy = s3_proxy
    monkeypatch.setattr(objects, "PART", 64 << 10)
    url = f"{bucket}/model.safetensors"
    save_safetensors(url, values(1))
    embed = open_safetensors(url)["embed"]  # 256 KiB: 4 parts
    saved = threading.Event()

    def hold(method: str, path: str, headers: dict[str, str]) -> float | threading.Event:
        start = int(headers.get("range", "bytes=0-").split("=")[1].split("-")[0])
        first = method == "GET" and path.endswith("/model.safetensors")
        return saved if first and start >= embed.offset + (64 << 10) else 0.0

    proxy.hold = hold
    seen = len(proxy.requests)
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1)
    reading = pool.submit(embed.read)
    deadline = time.monotonic() + 30
    while proxy.served < 64 << 10 and time.monotonic() < deadline:
        time.sleep(0.01)  # until the first part has come back (the others are held)
    save_safetensors(url, values(2))  # commits meanwhile
    saved.set()
    assert reading.result(timeout=60).tobytes() == values(1)["embed"].tobytes()
    pool.shutdown()
    parts = [h for (m, p), h in zip(proxy.requests[seen:], proxy.headers[seen:], strict=True)
             if m == "GET" and p.endswith("/model.safetensors")]  # fmt: skip
    assert len(parts) == 4 and all(h.get("if-match") for h in parts), parts


def test_an_opening_that_a_save_switching_layouts_overtakes_finds_what_it_saved(s3_proxy):
    """Between an opening's HEAD of the object (none: the checkpoint is sharded) and its
    HEAD of the index (held back by the proxy meanwhile), a save commits one object and
    removes the shards' index: neither was there when asked, and one listing of the
    folder, which sees it at one instant, shows the object: the opening asks again and
    opens it. (It said "no such object": a load racing saves in
    tests/io/test_object_store_races.py met it.) Planted: no look at the folder (the old
    message)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    bucket, proxy = s3_proxy
    url = f"{bucket}/model.safetensors"
    save_safetensors(url, values(1), max_shard_size="150KB")
    saved, first = threading.Event(), iter([True])
    index = "/model.safetensors.index.json"
    proxy.hold = lambda m, p, h: saved if m == "HEAD" and p.endswith(index) and next(first, False) else 0.0  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        opening = pool.submit(open_safetensors, url)
        deadline = time.monotonic() + 30
        while (
            "HEAD",
            f"/{bucket[5:]}{index}",
        ) not in proxy.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        save_safetensors(url, values(2))  # one object over the shards: their index removed
        saved.set()
        opened = opening.result(timeout=60)
    assert str(opened.path) == url
    assert same({k: t.read() for k, t in opened.items()}, values(2))


@pytest.mark.parametrize("saves", [1, 2])
@pytest.mark.parametrize("shard", [None, "150KB"], ids=["one object", "shards"])
def test_a_load_that_saves_overtake_reads_one_whole_version(s3, monkeypatch, shard, saves):
    """Saves commit after the load opened the checkpoint and before it reads: one save,
    and the load reads the version it opened, whole, from the objects that save kept;
    two, and those are gone too: the load opens the checkpoint again and reads the newest
    version whole."""
    import taktiny.loading._record as record

    url = f"{s3}/model.safetensors"
    save_safetensors(url, values(1), max_shard_size=shard)
    opened = record.open_load
    opens = []

    def overtaken(*args, **kwargs):
        load = opened(*args, **kwargs)
        opens.append(load)
        if len(opens) == 1:
            for number in range(2, 2 + saves):
                save_safetensors(url, values(number), max_shard_size=shard)
        return load

    monkeypatch.setattr("taktiny.loading._load.open_load", overtaken)
    loaded = load_safetensors(target(), url, progress=False)
    assert same(loaded, values(1 if saves == 1 else 1 + saves))
    assert len(opens) == saves


def test_a_damaged_object_is_caught_naming_the_tensor(s3, tmp_path):
    local = save_safetensors(tmp_path / "m.safetensors", values(1))[0]
    data = bytearray(local.read_bytes())
    data[-5] ^= 0x01  # a bit of the last tensor's bytes
    put(f"{s3}/m.safetensors", bytes(data))
    with pytest.raises(
        SafetensorsError, match=r"m\.safetensors: the bytes of 'head\.kernel' are dam"
    ):
        load_safetensors(target(), f"{s3}/m.safetensors", progress=False)


BYTES = [(n, c, m) for n, c, m in FILES if isinstance(c, bytes)]
# the index cases whose files exist in a bucket as they do on disk (no links, no names the
# file system refuses): the shards of tests/io/test_hostile.py's `shards`
REMOTE_INDEXES = [
    (n, c, m) for n, c, m in INDEXES if isinstance(c, bytes) and n not in ("shard name too long",)
]


@pytest.mark.parametrize(("content", "message"), [pytest.param(c, m, id=n) for n, c, m in BYTES])
def test_a_hostile_object_is_refused_as_the_file_is(s3, content, message):
    url = f"{s3}/bad.safetensors"
    put(url, content)
    with pytest.raises(SafetensorsError, match=f"^{re.escape(url)}: .*{message}"):
        load_safetensors({"a": jnp.zeros((4, 4))}, url, progress=False)


@pytest.mark.parametrize(
    ("content", "message"), [pytest.param(c, m, id=n) for n, c, m in REMOTE_INDEXES]
)
def test_a_hostile_index_is_refused_as_the_file_is(s3, content, message):
    from test_hostile import DATA, A, B

    put(f"{s3}/ck/one.safetensors", framed(js({"a": A}), DATA[:64]))
    put(f"{s3}/ck/two.safetensors", framed(js({"b": dict(B, data_offsets=[0, 12])}), DATA[64:]))
    url = f"{s3}/ck/model.safetensors.index.json"
    put(url, content)
    with pytest.raises(SafetensorsError, match=f"^{re.escape(url)}: .*{message}"):
        open_safetensors(url)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", ".", "a/b.safetensors"])
def test_an_index_may_name_only_objects_beside_it(s3, shard):
    url = f"{s3}/ck/model.safetensors.index.json"
    put(url, js({"weight_map": {"b": shard}}))
    with pytest.raises(SafetensorsError, match=r"is outside the index's folder .*; an index may"):
        open_safetensors(url)


def test_missing_objects_and_unknown_schemes_are_named(s3):
    with pytest.raises(SafetensorsError, match=rf"^{re.escape(s3)}/none\.safetensors: no such"):
        open_safetensors(f"{s3}/none.safetensors")
    with pytest.raises(ValueError, match=r"'ftp://x/y': the scheme 'ftp' is not one Taktiny"):
        open_safetensors("ftp://x/y")
    with pytest.raises(ValueError, match=r"the path must name a '\*\.safetensors' file"):
        save_safetensors(f"{s3}/model.bin", values(1))


def test_without_the_cloud_extra_each_entry_point_names_the_install_command(tmp_path):
    """With obstore not importable (blocked in the child processes by a sitecustomize
    module, as if it were not installed), a save, a load, `open_safetensors` and the
    command given a URL each name the URL and ``pip install 'taktiny[cloud]'``, before
    doing anything else; the command in one line on stderr, with status 2, as its --help
    promises. (A save raised a bare ModuleNotFoundError, and the command printed its
    traceback and exited 1.) With obstore there and safetensors not, a save names the
    extra that brings it: ``taktiny[safetensors]``, or for a URL ``taktiny[cloud]``. Planted: `locate` not asking `obstore_for` and `_head`
    importing obstore itself (the save named the folder, not the URL; the load raised
    ModuleNotFoundError); the command not catching MissingExtra (a traceback, status 1)."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['obstore'] = None\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    url = "s3://models/run/model.safetensors"
    message = (
        f"{url}: reading and writing object storage needs obstore, which is not installed: "
        f"pip install 'taktiny[cloud]'"
    )
    script = (
        "import json, numpy as np, jax.numpy as jnp\n"
        "from taktiny.io import save_safetensors, load_safetensors, open_safetensors\n"
        "seen = []\n"
        f"for call in (lambda: save_safetensors({url!r}, {{'a': np.ones(3, np.float32)}}),\n"
        f"             lambda: load_safetensors({{'a': jnp.zeros(3)}}, {url!r}),\n"
        f"             lambda: open_safetensors({url!r})):\n"
        "    try:\n"
        "        call()\n"
        "    except ImportError as error:\n"
        "        seen.append([type(error).__name__, error.name, str(error)])\n"
        "import sys\n"  # then obstore there and safetensors not: a save names the extra to add
        "del sys.modules['obstore']\n"
        "sys.modules['safetensors'] = sys.modules['safetensors.numpy'] = None\n"
        f"for path in ({str(tmp_path / 'model.safetensors')!r}, {url!r}):\n"
        "    try:\n"
        "        save_safetensors(path, {'a': np.ones(3, np.float32)})\n"
        "    except ImportError as error:\n"
        "        seen.append([type(error).__name__, error.name, str(error)])\n"
        "print(json.dumps(seen))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    needs = "taktiny.io.save_safetensors needs the safetensors package: pip install '{}'."
    assert json.loads(run.stdout) == [["MissingExtra", "obstore", message]] * 3 + [
        ["MissingExtra", "safetensors", needs.format("taktiny[safetensors]")],
        ["MissingExtra", "safetensors", needs.format("taktiny[cloud]")],
    ]
    run = subprocess.run([sys.executable, "-m", "taktiny", "inspect", url], capture_output=True,
                         text=True, env=env, timeout=120)  # fmt: skip
    assert (run.returncode, run.stdout, run.stderr) == (2, "", f"taktiny: {message}\n")


def test_a_missing_bucket_or_object_is_named_at_once(s3_proxy):
    """A bucket that does not exist is "no such bucket", naming it and the endpoint asked,
    and an object that does not exist "no such object", each after the few requests that
    tell (no retries: a 404 is final). A missing bucket was retried 6 times and reported as
    "The server keeps failing; try again later". Planted: a listing's 404 left to the
    retries (6 LISTs and the old message)."""
    bucket, proxy = s3_proxy
    missing = f"s3://b-missing-{os.urandom(4).hex()}"
    endpoint = re.escape(proxy.url)

    def asked(run) -> list[str]:
        seen = len(proxy.requests)
        started = time.monotonic()
        run()
        assert time.monotonic() - started < 2
        return ["LIST" if "list-type=" in p else m for m, p in proxy.requests[seen:]]

    def failing(error, pattern, run) -> list[str]:
        def raising() -> None:
            with pytest.raises(error, match=pattern):
                run()

        return asked(raising)

    bucket_named = rf"^{missing}/run/.*: no such bucket '{missing[5:]}' at {endpoint}; create it"
    assert failing(FileNotFoundError, bucket_named, lambda: save_safetensors(
        f"{missing}/run/model.safetensors", values(1))) == ["LIST"]  # fmt: skip
    assert failing(SafetensorsError, bucket_named + r".*AWS_ENDPOINT_URL", lambda: open_safetensors(
        f"{missing}/run/model.safetensors")) == ["HEAD", "HEAD", "LIST"]  # fmt: skip
    assert failing(SafetensorsError, bucket_named, lambda: load_safetensors(
        target(), f"{missing}/run/", progress=False)) == ["LIST"]  # fmt: skip
    absent = rf"^{bucket}/run/model\.safetensors: no such object\.$"
    assert failing(SafetensorsError, absent, lambda: load_safetensors(
        target(), f"{bucket}/run/model.safetensors", progress=False)) == ["HEAD", "HEAD", "LIST"]  # fmt: skip
    main = _cli.main(["inspect", f"{missing}/run/model.safetensors"])
    assert main == 2


def test_a_wrong_endpoint_is_named_with_the_variable_that_sets_it(s3, monkeypatch, capsys):
    """A store that cannot be connected to (nothing listens at AWS_ENDPOINT_URL) is named
    by the endpoint tried and the variable, promptly: obstore's own retries, not 6 tries
    more of Taktiny's. It said "error sending request ... try again later". Planted: the
    connection failure left to the retries (the old message, after some 10 s)."""
    from _s3 import free_port

    wrong = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", wrong)
    said = (
        rf"^{re.escape(s3)}/m\.safetensors: HEAD could not connect to {re.escape(wrong)} "
        rf"\(Connection refused, after obstore's retries\); check AWS_ENDPOINT_URL \(it is "
        rf"'{re.escape(wrong)}'; an S3-compatible server needs it\), AWS_REGION and the network\.$"
    )
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=said):
        open_safetensors(f"{s3}/m.safetensors")
    with pytest.raises(ConnectionError, match=r"LIST could not connect to .*AWS_ENDPOINT_URL"):
        save_safetensors(f"{s3}/run/model.safetensors", values(1))
    assert time.monotonic() - started < 10
    assert _cli.main(["verify", f"{s3}/m.safetensors"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"taktiny: {s3}/m.safetensors: HEAD could not connect to {wrong}")
    assert err.count("\n") == 1


@pytest.mark.parametrize("shard", [None, "150KB"], ids=["one object", "shards"])
def test_a_prefix_named_without_its_slash_reads_as_a_local_folder_does(
    s3, tmp_path, shard, monkeypatch, capsys
):
    """``s3://bucket/models/llama``, whose ``llama/`` holds a checkpoint, loads, opens,
    plans and is inspected and verified as the local folder ``models/llama`` (no slash)
    is; a prefix holding two checkpoints is refused as the folder is. It said "no such
    object". Planted: `_find_object` without its look under ``url/`` (the old message)."""
    (tmp_path / "models" / "llama").mkdir(parents=True)
    (tmp_path / "flat_model.py").write_text(
        "import jax.numpy as jnp\n"
        f"def model():\n    return {{k: jnp.zeros(s) for k, s in {dict((k, v.shape) for k, v in values(0).items())!r}.items()}}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    local = tmp_path / "models" / "llama"
    written = save_safetensors(local / "model.safetensors", values(1), max_shard_size=shard)
    save_safetensors(f"{s3}/models/llama/model.safetensors", values(1), max_shard_size=shard)
    for where in (str(local), f"{s3}/models/llama"):
        assert same(load_safetensors(target(), where, progress=False), values(1))
        opened = open_safetensors(where)
        assert opened.path.name == written[-1].name and sorted(opened) == sorted(values(1))
        assert plan_load(target(), where).ok
        assert _cli.main(["inspect", where]) == 0
        assert "embed" in capsys.readouterr().out
        assert _cli.main(["verify", where]) == 0
        assert "3 tensors match their checksums" in capsys.readouterr().out
        assert _cli.main(["plan", where, "--model", "flat_model:model"]) == 0
        assert "the load would succeed" in capsys.readouterr().out
    save_safetensors(local / "other.safetensors", values(2))
    save_safetensors(f"{s3}/models/llama/other.safetensors", values(2))
    for where in (str(local), f"{s3}/models/llama"):
        with pytest.raises(SafetensorsError, match=r"holding one checkpoint .* holds 2: \['model"):
            open_safetensors(where)
    with pytest.raises(SafetensorsError, match=rf"^{re.escape(s3)}/models/llam: no such object\.$"):
        open_safetensors(f"{s3}/models/llam")  # (a prefix of the name is no folder)


def test_throttling_errors_and_dropped_connections_are_retried(s3_proxy):
    bucket, proxy = s3_proxy
    url = f"{bucket}/model.safetensors"
    proxy.busy = 3  # the first requests of the save answered 503 SlowDown
    save_safetensors(url, values(1), max_shard_size="150KB")
    assert proxy.busy == 0
    proxy.busy, proxy.drop = 2, 2
    assert same(load_safetensors(target(), url, progress=False), values(1))
    assert proxy.busy == proxy.drop == 0


def test_a_denied_request_names_the_url_and_the_credentials(s3_proxy):
    bucket, proxy = s3_proxy
    proxy.deny = True
    with pytest.raises(
        PermissionError,
        match=rf"^{re.escape(bucket)}/m\.safetensors: HEAD was refused .*AWS_ACCESS_KEY_ID",
    ):
        open_safetensors(f"{bucket}/m.safetensors")


def test_a_server_that_keeps_failing_is_named_after_the_retries(s3_proxy, monkeypatch):
    bucket, proxy = s3_proxy
    url = f"{bucket}/model.safetensors"
    save_safetensors(url, values(1))
    monkeypatch.setattr(objects, "BACKOFF", (0.01, 0.02))
    opened = open_safetensors(url)
    proxy.busy = 10**6
    started = time.monotonic()
    with pytest.raises(
        ConnectionError, match=rf"^{re.escape(url)}: GET failed 6 times, .*keeps failing"
    ):
        opened["embed"].read()
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("failing", ["a shard", "the index"])
def test_a_save_whose_upload_fails_leaves_the_previous_checkpoint(s3_proxy, failing):
    """A refused upload of a new shard, or of the index (the commit): the save raises, and
    the bucket holds the previous checkpoint's objects (the new shards removed)."""
    bucket, proxy = s3_proxy
    url = f"{bucket}/ck/model.safetensors"
    first = save_safetensors(url, values(1), max_shard_size="150KB")
    shard = re.compile(r"/ck/model-00002-of-0000\d-[0-9a-f]{8}\.safetensors")
    if failing == "a shard":  # the second new shard refused
        proxy.only = lambda method, path: method == "PUT" and shard.search(path) is not None
    else:
        proxy.only = lambda method, path: method == "PUT" and path.endswith("index.json")
    proxy.deny = True
    with pytest.raises(PermissionError, match=rf"^{re.escape(bucket)}/ck/model.* PUT was refused"):
        save_safetensors(url, values(2), max_shard_size="200KB")
    # (and, when the save got as far as its commit, its record of the objects to keep)
    assert names(bucket) == sorted({*(w.key for w in first), *kept(url)})
    assert same(load_safetensors(target(), url, progress=False), values(1))


def test_a_save_that_cannot_read_the_committed_index_removes_no_shard_before_its_commit(
    s3_proxy,
):
    """A save over a sharded checkpoint whose index it cannot read (its GET refused) cannot
    tell the committed shards from a failed save's: it removes none of them before its
    commit, so a save whose commit then fails leaves the checkpoint whole. Planted:
    `_tidy` taking every shard that the unreadable index does not name (all of them) for
    a failed save's (the committed shards removed first: the checkpoint lost)."""
    bucket, proxy = s3_proxy
    url = f"{bucket}/ck/model.safetensors"
    first = save_safetensors(url, values(1), max_shard_size="150KB")
    proxy.only = lambda method, path: (
        path.endswith("/ck/model.safetensors.index.json") and method in ("GET", "PUT")
    )
    proxy.deny = True  # the index cannot be read, and the commit (its PUT) is refused
    with pytest.raises(PermissionError, match=r"index\.json: PUT was refused"):
        save_safetensors(url, values(2), max_shard_size="200KB")
    proxy.deny = False
    assert {w.key for w in first} <= set(names(bucket))
    assert same(load_safetensors(target(), url, progress=False), values(1))


def test_a_changed_endpoint_or_key_makes_a_new_client(s3_server, s3_proxy, monkeypatch):
    """The client made for a bucket is made again when the environment names another
    endpoint or other credentials: the same bucket, reached directly, then through the
    proxy (AWS_ENDPOINT_URL changed), is asked through the proxy only the second time, and
    requests are signed with the AWS_ACCESS_KEY_ID set last. Planted: the store cached by
    bucket alone (the second load went to the first endpoint, the proxy saw nothing)."""
    bucket, proxy = s3_proxy
    url = f"{bucket}/model.safetensors"
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.url)  # the server itself
    save_safetensors(url, values(1))
    assert proxy.requests == []
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    assert same(load_safetensors(target(), url, progress=False), values(1))
    assert proxy.requests
    seen = len(proxy.requests)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "another-key")  # (moto takes any)
    assert same(load_safetensors(target(), url, progress=False), values(1))
    signed = [h.get("authorization", "") for h in proxy.headers[seen:]]
    assert signed and all("Credential=another-key/" in a for a in signed), signed


def test_nothing_imports_obstore_for_local_paths(tmp_path):
    script = (
        "import sys, numpy as np, jax.numpy as jnp\n"
        "from taktiny.io import save_safetensors, load_safetensors\n"
        f"p = {str(tmp_path / 'm.safetensors')!r}\n"
        "save_safetensors(p, {'a': np.ones(3, np.float32)})\n"
        "load_safetensors({'a': jnp.zeros(3)}, p)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'obstore'))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def _signal_thread(pid: int, thread: int, number: int) -> None:
    """Sends signal `number` to one thread of process `pid` (Linux's tgkill)."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).tgkill(pid, thread, number) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill({pid}, {thread}, {number}) failed")


@pytest.mark.skipif(sys.platform != "linux", reason="tgkill: a signal to one thread is Linux's")
@pytest.mark.parametrize(
    ("stalled", "to"),
    [
        ("the HEAD", "the process"),
        ("the tensor reads", "another thread"),
        pytest.param("the HEAD", "another thread", marks=pytest.mark.thorough),
        pytest.param("the tensor reads", "the process", marks=pytest.mark.thorough),
    ],
)
def test_ctrl_c_stops_a_load_promptly(s3_proxy, stalled, to):
    """Ctrl-C stops a load whose requests the store holds back (30 s) within 5 s, whether
    it waits on the object's HEAD (its opening, on the main thread) or on its tensors'
    reads (the reader threads'), and whichever thread the kernel hands SIGINT to.

    A process's SIGINT may be taken by any of its threads (here, deterministically, by a
    thread of the HTTP client); Python's handler then only marks it for the main thread,
    which slept in ``Future.result()`` until the stalled request came back, 30 s later.
    Planted: `_waits.waited` waiting without its time slices (both "another thread"
    cases took 29 s)."""
    bucket, proxy = s3_proxy
    url = f"{bucket}/model.safetensors"
    save_safetensors(url, values(1))
    gets = iter(range(10**6))  # (the header's two GETs pass; the tensors' are held)
    proxy.only = (lambda m, p: True) if stalled == "the HEAD" else lambda m, p: m == "GET" and next(gets) >= 2  # fmt: skip
    proxy.stall = 30.0
    shapes = {k: v.shape for k, v in values(1).items()}
    script = (
        "import faulthandler, signal\n"  # (SIGUSR1: every thread's stack, for a failure)
        "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
        # Ctrl-C raises KeyboardInterrupt, as in a terminal, though the suite may run as a
        # background job, whose SIGINT the shell ignores (and Python then leaves ignored)
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "import jax.numpy as jnp, numpy as np, sys\n"
        "from taktiny.io import load_safetensors\n"
        "print('loading', flush=True)\n"
        f"load_safetensors({{k: jnp.zeros(s) for k, s in {shapes!r}.items()}}, {url!r})\n"
    )
    seen = len(proxy.requests)
    job = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=os.environ)  # fmt: skip
    try:
        assert job.stdout.readline() == "loading\n"

        def waiting() -> bool:  # whether the load has asked for what the store holds back
            asked = proxy.requests[seen:]
            return bool(asked) if stalled == "the HEAD" else sum(m == "GET" for m, _ in asked) > 2

        deadline = time.monotonic() + 60  # (the child imports JAX first: slow on a busy machine)
        while not waiting() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert waiting(), proxy.requests[seen:]
        time.sleep(1)  # (waiting on its stalled requests now)
        if to == "the process":
            job.send_signal(signal.SIGINT)
        else:
            threads = [int(t) for t in os.listdir(f"/proc/{job.pid}/task")]
            names = {t: Path(f"/proc/{job.pid}/task/{t}/comm").read_text().strip() for t in threads}
            client = [t for t in threads if names[t].startswith("tokio")]
            assert client, names
            _signal_thread(job.pid, client[0], signal.SIGINT)
        started = time.monotonic()
        try:
            _, err = job.communicate(timeout=40)
        except subprocess.TimeoutExpired:
            job.send_signal(signal.SIGUSR1)  # what each of its threads waits on, shown
            time.sleep(1)
            job.kill()
            _, err = job.communicate()
            pytest.fail(f"the load did not stop within 40 s of Ctrl-C; its threads:\n{err[-8000:]}")
    finally:
        if job.poll() is None:
            job.kill()  # (never left running: its pipes would leak into the next test)
            job.communicate()
    # well before the stalled requests (30 s) would have come back
    assert time.monotonic() - started < 5, err
    assert job.returncode != 0 and "KeyboardInterrupt" in err, err


def test_stopping_a_load_stops_the_reads_its_readers_begin_after(s3_proxy):
    """`stop_reads`, a load's way out on an error or Ctrl-C, interrupts the storages until
    the readers' tasks have ended: a reader that sends its request just after the first
    interrupt (here 0.3 s after) is stopped too, not waited for while the store holds it
    back (30 s) by the pool's join, or the interpreter's at exit. Planted: one interrupt,
    then a wait for the tasks, as the load did before (30 s)."""
    from concurrent.futures import CancelledError, ThreadPoolExecutor

    from taktiny.io import open_storage, stop_reads
    from taktiny.io._storage import read_range

    bucket, proxy = s3_proxy
    url = f"{bucket}/model.safetensors"
    save_safetensors(url, values(1))
    storage = open_storage(objects.Url(url))
    proxy.only = lambda method, path: method == "GET"
    proxy.stall = 30.0

    def reader() -> bytes:
        time.sleep(0.3)
        return read_range(storage, 0, 1000)

    with ThreadPoolExecutor(1) as pool:
        task = pool.submit(reader)
        while not task.running():
            time.sleep(0.01)
        started = time.monotonic()
        stop_reads([storage], [task])
        assert time.monotonic() - started < 5
        with pytest.raises(CancelledError):
            task.result()
    proxy.stall = 0.0
    assert read_range(storage, 0, 8) == read_range(open_storage(objects.Url(url)), 0, 8)


def test_the_command_takes_urls(s3, tmp_path, capsys):
    url = f"{s3}/model.safetensors"
    save_safetensors(url, values(1))
    local = save_safetensors(tmp_path / "model.safetensors", values(1))[0]
    assert _cli.main(["inspect", url, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in listed["tensors"]] == ["embed", "head.bias", "head.kernel"]
    assert _cli.main(["verify", url]) == 0
    assert "3 tensors match their checksums, 0 damaged" in capsys.readouterr().out
    assert _cli.main(["diff", url, str(local)]) == 0
    capsys.readouterr()
    save_safetensors(url, values(2))
    assert _cli.main(["diff", url, str(local)]) == 1
    assert "head.bias" in capsys.readouterr().out


def test_plan_load_reads_a_url(s3):
    url = f"{s3}/model.safetensors"
    save_safetensors(url, values(1), max_shard_size="150KB")
    plan = plan_load(target(), url)
    assert plan.ok and plan.read_bytes == {0: sum(v.nbytes for v in values(1).values())}


def test_a_large_object_goes_up_in_parallel_parts(s3_proxy, monkeypatch):
    from taktiny.io import _object_commit

    bucket, proxy = s3_proxy
    monkeypatch.setattr(_object_commit, "MULTIPART", 8 << 20)
    monkeypatch.setattr(_object_commit, "PART", 5 << 20)  # (S3's smallest part)
    big = {"w": np.random.default_rng(0).standard_normal((3, 1 << 20), np.float32)}  # 12 MiB
    save_safetensors(f"{bucket}/big.safetensors", big)
    parts = [p for m, p in proxy.requests if m == "PUT" and "partNumber=" in p]
    assert len(parts) == 3, proxy.requests
    assert any(m == "POST" and "uploads" in p for m, p in proxy.requests)
    loaded = load_safetensors({"w": jnp.zeros((3, 1 << 20))}, f"{bucket}/big.safetensors")
    assert np.asarray(loaded["w"]).tobytes() == big["w"].tobytes()


def test_a_background_save_to_a_url_commits_and_its_error_is_raised(s3_proxy):
    bucket, proxy = s3_proxy
    url = f"{bucket}/bg/model.safetensors"
    handle = save_safetensors(url, values(1), max_shard_size="150KB", wait=False)
    written = handle.result(timeout=60)
    assert names(bucket) == sorted(w.key for w in written)
    assert same(load_safetensors(target(), url, progress=False), values(1))
    proxy.only = lambda method, path: method == "PUT" and path.endswith("index.json")
    proxy.deny = True  # the commit refused: raised by result(), the first save left
    failed = save_safetensors(url, values(2), max_shard_size="150KB", wait=False)
    with pytest.raises(PermissionError, match=rf"^{re.escape(url)}\.index\.json: PUT was refused"):
        failed.result(timeout=60)
    proxy.deny = False
    assert names(bucket) == sorted({*(w.key for w in written), *kept(url)})
    assert same(load_safetensors(target(), url, progress=False), values(1))


def test_a_plain_http_url_is_read(tmp_path, monkeypatch):
    """An object served over HTTP(S) without a bucket API (``https://host/path``): read
    by ranged GETs with its ETag, as a bucket's objects are (served here by the read-only
    server of bench/_s3_stub.py, from a folder)."""
    from bench._s3_stub import Stub

    _loopback.needed()
    for key in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT"):
        monkeypatch.delenv(key, raising=False)
    save_safetensors(tmp_path / "model.safetensors", values(1))
    with Stub(tmp_path) as stub:  # (its objects: /<any bucket>/<the file's name>)
        plain = f"{stub.url}/weights/model.safetensors"
        assert same(load_safetensors(target(), plain, progress=False), values(1))
        assert _cli.main(["verify", plain]) == 0


def test_a_save_aborts_the_multipart_uploads_a_killed_save_left(s3):
    """What a process killed during a multipart upload leaves (an upload begun, a part
    sent, never completed) is aborted by the next save to the same path; another key's
    upload is left alone."""
    import boto3

    client = boto3.client("s3")
    bucket = s3.removeprefix("s3://")
    left = {}
    for key in ("ck/model-00001-of-00002-0123abcd.safetensors", "ck/model.safetensors",
                "ck/other.bin"):  # fmt: skip
        upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x")
        left[key] = upload
    save_safetensors(f"{s3}/ck/model.safetensors", values(1), max_shard_size="150KB")
    remaining = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert [(u["Key"], u["UploadId"]) for u in remaining] == [
        ("ck/other.bin", left["ck/other.bin"])
    ]

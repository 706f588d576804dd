#!/usr/bin/env python
"""Small S3 client benchmark: obstore vs s3fs vs boto3 against a local S3 server.

One measurement = one fresh subprocess (so ru_maxrss is the peak of that
measurement alone).  Each measurement does 1 warmup + RUNS timed runs and
reports the median.

Usage (driver):
    AWS_ENDPOINT_URL=http://127.0.0.1:PORT AWS_ACCESS_KEY_ID=testing \
    AWS_SECRET_ACCESS_KEY=testing AWS_REGION=us-east-1 \
    python s3_bench.py drive --bucket bench --key obj256 --server-pid PID \
        [--ops ranged8,ranged32,single,upload,local] [--clients obstore,s3fs,boto3]

Worker (internal):
    python s3_bench.py work CLIENT OP ...
Environment variables are the only source of endpoint/credentials for all clients.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import time

MiB = 1 << 20
RANGE = 8 * MiB
PART = 16 * MiB
UPLOAD_CONC = 8  # parallel parts in flight for multipart upload (all clients)


def proc_cpu(pid: int) -> float:
    """utime+stime (s) of another process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_mem(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) // 1024  # MiB
    return out


def ranges_of(size: int, step: int):
    return [(s, min(s + step, size)) for s in range(0, size, step)]


# --------------------------------------------------------------------------- obstore
def make_obstore(bucket):
    from obstore.store import S3Store

    # endpoint, keys, region come from AWS_* env vars; allow_http needed for http://
    return S3Store(bucket, client_options={"allow_http": True})


def obstore_ranged(store, key, size, buf, n, keep=False):
    import numpy as np
    import obstore as obs

    sem = asyncio.Semaphore(n)
    kept = []

    async def one(s, e):
        async with sem:
            b = await obs.get_range_async(store, key, start=s, end=e)
        if keep:
            kept.append(b)  # zero-copy: Rust-owned buffer, exposes buffer protocol
        else:
            buf[s:e] = np.frombuffer(b, dtype=np.uint8)  # 1 copy into caller buffer

    async def main():
        await asyncio.gather(*(one(s, e) for s, e in ranges_of(size, RANGE)))

    asyncio.run(main())
    return kept


def obstore_single(store, key, size, buf):
    import numpy as np
    import obstore as obs

    r = obs.get(store, key)
    off = 0
    for chunk in r.stream(min_chunk_size=RANGE):  # chunks are python bytes
        n = len(chunk)
        buf[off : off + n] = np.frombuffer(chunk, dtype=np.uint8)
        off += n
    assert off == size, (off, size)


def obstore_upload(store, key, data):
    import obstore as obs

    obs.put(store, key, data, use_multipart=True, chunk_size=PART, max_concurrency=UPLOAD_CONC)


# --------------------------------------------------------------------------- boto3
def make_boto3(n):
    import boto3
    from botocore.config import Config

    # endpoint from AWS_ENDPOINT_URL, keys from AWS_ACCESS_KEY_ID/..., region AWS_REGION
    return boto3.client("s3", config=Config(max_pool_connections=max(n, 10)))


def boto3_ranged(client, bucket, key, size, buf, n, pool):
    mv = memoryview(buf)

    def one(s, e):
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={s}-{e - 1}")["Body"]
        view = mv[s:e]
        got = 0
        while got < e - s:
            k = body.readinto(view[got:])  # urllib3 2.x: read() + copy into view
            if not k:
                break
            got += k
        body.close()
        assert got == e - s

    list(pool.map(lambda r: one(*r), ranges_of(size, RANGE)))


def boto3_single(client, bucket, key, size, buf):
    mv = memoryview(buf)
    body = client.get_object(Bucket=bucket, Key=key)["Body"]
    got = 0
    while got < size:
        k = body.readinto(mv[got : got + RANGE])
        if not k:
            break
        got += k
    assert got == size


def boto3_upload(client, bucket, key, data):
    from boto3.s3.transfer import TransferConfig

    cfg = TransferConfig(
        multipart_threshold=PART,
        multipart_chunksize=PART,
        max_concurrency=UPLOAD_CONC,
        use_threads=True,
    )
    client.upload_fileobj(io.BytesIO(data), bucket, key, Config=cfg)


# --------------------------------------------------------------------------- s3fs
def make_s3fs(n):
    import s3fs

    # endpoint from AWS_ENDPOINT_URL (via aiobotocore/botocore config resolution)
    return s3fs.S3FileSystem(
        config_kwargs={"max_pool_connections": max(n, 10)}, skip_instance_cache=True
    )


def s3fs_ranged(fs, bucket, key, size, buf, n):
    import numpy as np

    rs = ranges_of(size, RANGE)
    path = f"{bucket}/{key}"
    # public API; batch_size = requests in flight; returns new bytes per range
    outs = fs.cat_ranges([path] * len(rs), [s for s, _ in rs], [e for _, e in rs], batch_size=n)
    for (s, e), b in zip(rs, outs, strict=True):
        if isinstance(b, Exception):
            raise b
        buf[s:e] = np.frombuffer(b, dtype=np.uint8)


def s3fs_single(fs, bucket, key, size, buf):
    with fs.open(f"{bucket}/{key}", "rb", cache_type="none", block_size=RANGE) as f:
        got = f.readinto(memoryview(buf))  # fsspec: read() then copy into buf
    assert got == size, got


def s3fs_upload(fs, bucket, key, data):
    fs.pipe_file(f"{bucket}/{key}", data, chunksize=PART, max_concurrency=UPLOAD_CONC)


# --------------------------------------------------------------------------- local baseline
def local_ranged(path, size, buf, n, pool):
    mv = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:

        def one(s, e):
            got = os.preadv(fd, [mv[s:e]], s)
            assert got == e - s

        list(pool.map(lambda r: one(*r), ranges_of(size, RANGE)))
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- worker
def worker(a):
    import numpy as np

    size = a.size
    timings, srv_cpu, cli_cpu = [], [], []
    buf = np.empty(size, dtype=np.uint8)  # preallocated caller-owned buffer
    buf[:] = 0
    data = None
    if a.op == "upload":
        data = os.urandom(size)
    pool = None
    t_setup = time.perf_counter()
    if a.client == "obstore":
        c = make_obstore(a.bucket)
    elif a.client == "boto3":
        c = make_boto3(a.n)
    elif a.client == "s3fs":
        c = make_s3fs(a.n)
    else:
        c = None
    t_setup = time.perf_counter() - t_setup
    if a.client in ("boto3", "local") and a.op.startswith("ranged"):
        pool = cf.ThreadPoolExecutor(a.n)

    def run_once(i):
        if a.op.startswith("ranged"):
            if a.client == "obstore":
                obstore_ranged(c, a.key, size, buf, a.n, keep=a.keep)
            elif a.client == "boto3":
                boto3_ranged(c, a.bucket, a.key, size, buf, a.n, pool)
            elif a.client == "s3fs":
                s3fs_ranged(c, a.bucket, a.key, size, buf, a.n)
            elif a.client == "local":
                local_ranged(a.local_path, size, buf, a.n, pool)
        elif a.op == "single":
            if a.client == "obstore":
                obstore_single(c, a.key, size, buf)
            elif a.client == "boto3":
                boto3_single(c, a.bucket, a.key, size, buf)
            elif a.client == "s3fs":
                s3fs_single(c, a.bucket, a.key, size, buf)
            elif a.client == "local":
                with open(a.local_path, "rb", buffering=0) as f:
                    assert f.readinto(memoryview(buf)) == size
        elif a.op == "upload":
            k = f"{a.key}-up-{a.client}-{i}"
            if a.client == "obstore":
                obstore_upload(c, k, data)
            elif a.client == "boto3":
                boto3_upload(c, a.bucket, k, data)
            elif a.client == "s3fs":
                s3fs_upload(c, a.bucket, k, data)
        else:
            raise SystemExit(f"bad op {a.op}")

    for i in range(a.warmup + a.runs):
        sc0 = proc_cpu(a.server_pid) if a.server_pid else 0.0
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        run_once(i)
        dt = time.perf_counter() - t0
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        sc1 = proc_cpu(a.server_pid) if a.server_pid else 0.0
        if i >= a.warmup:
            timings.append(dt)
            srv_cpu.append(sc1 - sc0)
            cli_cpu.append((ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime))
    if a.op != "upload" and a.verify:
        import hashlib

        print("sha256", hashlib.sha256(buf).hexdigest()[:16], file=sys.stderr)
    med = statistics.median(timings)
    res = {
        "client": a.client,
        "op": a.op,
        "n": a.n,
        "keep": a.keep,
        "size_mib": size / MiB,
        "median_s": med,
        "runs_s": timings,
        "mib_s": size / MiB / med,
        "client_cpu_s": statistics.median(cli_cpu),
        "server_cpu_s": statistics.median(srv_cpu) if a.server_pid else None,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "setup_s": t_setup,
    }
    if a.server_pid:
        res["server_mem_mib"] = proc_mem(a.server_pid)
    print(json.dumps(res))


# --------------------------------------------------------------------------- driver
def driver(a):
    clients = a.clients.split(",")
    ops = a.ops.split(",")
    results = []
    plan = []
    for op in ops:
        if op == "local":
            plan += [("local", "ranged", 8), ("local", "ranged", 32), ("local", "single", 1)]
            continue
        for cl in clients:
            if op.startswith("ranged"):
                n = int(op[len("ranged") :])
                plan.append((cl, "ranged", n))
                if cl == "obstore" and a.obstore_keep:
                    plan.append((cl, "ranged-keep", n))
            else:
                plan.append((cl, op, UPLOAD_CONC if op == "upload" else 1))
    for cl, op, n in plan:
        cmd = [
            sys.executable,
            __file__,
            "work",
            cl,
            op.replace("-keep", ""),
            "--n",
            str(n),
            "--bucket",
            a.bucket,
            "--key",
            a.key,
            "--size",
            str(a.size),
            "--runs",
            str(a.runs),
            "--warmup",
            str(a.warmup),
            "--local-path",
            a.local_path,
        ]
        if op.endswith("-keep"):
            cmd.append("--keep")
        if a.server_pid and cl != "local":
            cmd += ["--server-pid", str(a.server_pid)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
        if p.returncode != 0:
            print(f"FAIL {cl} {op} n={n} rc={p.returncode}: {p.stderr[-2000:]}", file=sys.stderr)
            continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        if op.endswith("-keep"):
            r["op"] = "ranged-keep"
        results.append(r)
        srv = f"{r['server_cpu_s']:.2f}" if r["server_cpu_s"] is not None else "-"
        print(
            f"{cl:8s} {r['op']:12s} n={n:<3d} {r['mib_s']:8.1f} MiB/s  "
            f"median {r['median_s']:.3f}s  cli_cpu {r['client_cpu_s']:.2f}s  "
            f"srv_cpu {srv}s  peakRSS {r['peak_rss_mib']:.0f} MiB  "
            f"srv_mem {r.get('server_mem_mib')}",
            flush=True,
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="mode", required=True)
    for name in ("drive", "work"):
        s = sub.add_parser(name)
        if name == "work":
            s.add_argument("client")
            s.add_argument("op")
            s.add_argument("--n", type=int, default=8)
            s.add_argument("--keep", action="store_true")
            s.add_argument("--verify", action="store_true")
        else:
            s.add_argument("--clients", default="obstore,s3fs,boto3")
            s.add_argument("--ops", default="ranged8,ranged32,single,upload,local")
            s.add_argument("--obstore-keep", action="store_true")
            s.add_argument("--out", default=None)
            s.add_argument("--timeout", type=int, default=900)
        s.add_argument("--bucket", default="bench")
        s.add_argument("--key", default="obj256")
        s.add_argument("--size", type=int, default=256 * MiB)
        s.add_argument("--runs", type=int, default=3)
        s.add_argument("--warmup", type=int, default=1)
        s.add_argument("--server-pid", type=int, default=0)
        s.add_argument("--local-path", default="/tmp/s3lab/obj256.bin")
    a = p.parse_args()
    worker(a) if a.mode == "work" else driver(a)


if __name__ == "__main__":
    main()

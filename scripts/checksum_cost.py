"""What the integrity checks (issue 24) cost on real artifacts: read and write time with and without them.

    .venv/bin/python scripts/checksum_cost.py artifacts --iteration 1 [--repeats 5]

For one iteration's artifacts of a run (the default experiment's, after `dvc repro`) it times, best of
`--repeats`, in this process:
  trajectories.arrow   `write_table` and `read_table` (contract checks included) with the data digest
                       computed / verified and with it skipped
  masks.raw.zarr       every shard array rewritten and read back with zstd alone vs zstd + crc32c
  masks.zarr           the compacted arrays, Blosc alone vs Blosc + crc32c (write and full read)
  policy               `load_policy` with and without verifying the weights digest
and prints one table (milliseconds, and the overhead in percent). A measurement, not a test.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

import schemas.tables
import stages.common.model
from schemas.tables import read_table, write_table


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` runs of `fn`, in milliseconds (the least disturbed by other load)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def paired_ms(without: Callable[[], object], with_: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Best-of-`repeats` milliseconds of both, interleaved round by round (a loaded machine drifts)."""
    a, b = [], []
    for _ in range(repeats):
        a.append(best_ms(without, 1))
        b.append(best_ms(with_, 1))
    return min(a), min(b)


def zarr_arrays(path: Path) -> dict[str, np.ndarray]:
    """Every array of a Zarr group (recursively), by its path inside the group."""
    root = zarr.open_group(str(path), mode="r")
    return {name: np.asarray(arr[...]) for name, arr in root.arrays()} | {
        f"{g}/{name}": np.asarray(arr[...]) for g, group in root.groups() for name, arr in group.arrays()}


def zarr_round_trip(arrays: dict[str, np.ndarray], codecs: Callable[[np.dtype], list], out: Path,
                    chunks: dict[str, tuple[int, ...]]) -> tuple[Callable[[], object], Callable[[], object]]:
    """(write, read) closures for `arrays` stored with `codecs(dtype)` at `out`."""
    def write() -> None:
        shutil.rmtree(out, ignore_errors=True)
        root = zarr.open_group(str(out), mode="w")
        for name, data in arrays.items():
            root.create_array(name, data=data, chunks=chunks.get(name) or data.shape or None,
                              compressors=codecs(data.dtype))

    def read() -> None:
        root = zarr.open_group(str(out), mode="r")
        for name in arrays:
            root[name][...]
    return write, read


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", type=Path)
    ap.add_argument("--iteration", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    it = args.artifacts / f"iter-{args.iteration:03d}"
    rows: list[tuple[str, str, float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        traj = it / "rollout" / "trajectories.arrow"
        table = read_table(traj, "trajectories")
        config = schemas.tables.table_config(table)
        digest = schemas.tables.data_digest

        def timed(op: Callable[[], object], with_digest: bool) -> float:
            # without: the digest replaced by a constant (written) and its check skipped (read)
            schemas.tables.data_digest = digest if with_digest else (lambda t: "sha256:off")
            try:
                return best_ms(op, args.repeats)
            finally:
                schemas.tables.data_digest = digest
        write = lambda: write_table(table, tmp / "t.arrow", "trajectories", config)  # noqa: E731
        rows.append(("trajectories.arrow", "write", timed(write, False), timed(write, True)))
        unchecked = schemas.tables.validate_table
        schemas.tables.validate_table = lambda t, src, kind, verify_digest=False: unchecked(t, src, kind, False)
        try:
            without = best_ms(lambda: read_table(traj, "trajectories"), args.repeats)
        finally:
            schemas.tables.validate_table = unchecked
        rows.append(("trajectories.arrow", "read", without, best_ms(lambda: read_table(traj, "trajectories"),
                                                                     args.repeats)))

        raw = zarr_arrays(it / "rollout" / "masks.raw.zarr")
        for label, arrays, plain_codecs, checked_codecs, chunks in (
            ("masks.raw.zarr", raw, lambda dt: [ZstdCodec(level=0)], lambda dt: [ZstdCodec(level=0), Crc32cCodec()],
             {}),
            ("masks.zarr", zarr_arrays(it / "compact" / "masks.zarr"),
             lambda dt: [BloscCodec(cname="zstd", clevel=3, shuffle="bitshuffle", typesize=dt.itemsize)],
             lambda dt: [BloscCodec(cname="zstd", clevel=3, shuffle="bitshuffle", typesize=dt.itemsize),
                         Crc32cCodec()],
             {name: arr.chunks for name, arr in zarr.open_group(str(it / "compact" / "masks.zarr"), mode="r").arrays()}),
        ):
            w0, r0 = zarr_round_trip(arrays, plain_codecs, tmp / f"{label}.plain", chunks)
            w1, r1 = zarr_round_trip(arrays, checked_codecs, tmp / f"{label}.crc", chunks)
            rows.append((label, "write", *paired_ms(w0, w1, args.repeats)))
            rows.append((label, "read", *paired_ms(r0, r1, args.repeats)))

    policy = it / "policy"
    verify = stages.common.model.verify_weights_digest
    stages.common.model.verify_weights_digest = lambda path: None
    try:
        without = best_ms(lambda: stages.common.model.load_policy(policy), args.repeats)
    finally:
        stages.common.model.verify_weights_digest = verify
    rows.append(("policy (weights)", "load", without, best_ms(lambda: stages.common.model.load_policy(policy), args.repeats)))
    print(f"{'artifact':<20} {'op':<6} {'without ms':>11} {'with ms':>9} {'overhead':>9}")
    for name, op, without, with_ in rows:
        print(f"{name:<20} {op:<6} {without:>11.2f} {with_:>9.2f} {100 * (with_ - without) / without:>8.1f}%")
    sizes = {p.name: sum(f.stat().st_size for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
             for p in (it / "rollout" / "trajectories.arrow", it / "rollout" / "masks.raw.zarr",
                       it / "compact" / "masks.zarr", policy)}
    print("sizes: " + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in sizes.items()))


if __name__ == "__main__":
    main()

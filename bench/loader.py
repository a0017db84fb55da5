"""Loader benchmark: documents/s and tokens/s by source kind, at 1 and 2 data-parallel ranks,
against the training step of the debug model at the same batch.

    python -m bench.loader                       # seq 1024, 4 rows a rank, CPU
    python -m bench.loader --seq-len 2048 --batch 2 --batches 16

One corpus (built-in synthetic documents joined into ~1K-token documents) is written as
every kind ``data.path`` reads: ``.txt``, ``.jsonl``, ``.jsonl.gz``, parquet, an Arrow
folder, and a ``.tokens`` shard (``python -m temper.data.prepare``). For each kind and DP
size the loader of rank 0 is built (what opening costs is reported apart) and timed over
``--batches`` batches of ``--batch`` rows; with 2 ranks there are twice the lanes and rank 0
reads half of them, so its work per batch is the same and its share of the corpus halves.
The reference is one training step (forward, backward, AdamW) of the llama3 debug model on
one such batch, timed in the same process before each loader run, so load from anything
else on the machine falls on both alike: the loader's share is its time per batch over that
step's. Times are the fastest of ``--repeats`` runs; CPU times (``process_time``, every
thread of the process) are shown beside wall times, since other load on a shared machine
inflates wall times but not CPU times.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from temper.config import Config, Job, Metrics, Model, Training
from temper.data import build_text_loader, load_tokenizer, synthetic_document
from temper.data.prepare import prepare

KINDS = ("builtin", "txt", "jsonl", "jsonl.gz", "parquet", "arrow", "tokens")


def write_corpus(folder: Path, documents: int) -> dict[str, str]:
    """The corpus as every kind; returns kind -> path."""
    texts = [
        "\n".join(synthetic_document(0, 20 * i + j) for j in range(20)).replace("\n\n", "\n")
        for i in range(documents)
    ]
    paths = {kind: str(folder / f"corpus.{kind}") for kind in ("txt", "jsonl", "jsonl.gz")}
    Path(paths["txt"]).write_text("\n\n".join(texts) + "\n")
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts)
    Path(paths["jsonl"]).write_text(lines)
    Path(paths["jsonl.gz"]).write_bytes(gzip.compress(lines.encode()))
    table = pa.table({"text": texts})
    paths["parquet"] = str(folder / "corpus.parquet")
    pq.write_table(table, paths["parquet"], row_group_size=256)
    arrow = folder / "arrow"
    arrow.mkdir()
    file = str(arrow / "data-00000-of-00001.arrow")
    with pa.OSFile(file, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    (arrow / "state.json").write_text(
        '{"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}'
    )
    paths["arrow"] = str(arrow)
    paths["tokens"] = str(folder / "corpus.tokens")
    prepare(paths["txt"], paths["tokens"], None, "text")
    paths["builtin"] = None
    return paths


def time_loader(
    path: str | None, world: int, seq_len: int, batch: int, batches: int
) -> tuple[float, float, float, int, int]:
    """(seconds to open, seconds and CPU seconds per batch, documents, tokens) for rank 0 of
    ``world``."""
    tokenizer = load_tokenizer(None)
    started = time.perf_counter()
    loader = build_text_loader(tokenizer, seq_len, batch, path=path, dp_rank=0, dp_world=world)
    opened = time.perf_counter() - started
    started, cpu = time.perf_counter(), time.process_time()
    for _ in itertools.islice(loader, batches):
        pass
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    stats = loader.stats
    documents = sum(v for k, v in stats.items() if k.endswith("_documents"))
    return opened, elapsed / batches, cpu / batches, documents, batches * batch * seq_len


class TrainStep:
    """The debug model's training step on one fixed batch, timed on demand, so its timings
    can be taken between the loaders' and the machine's other load falls on both alike."""

    def __init__(self, folder: str, seq_len: int, batch: int) -> None:
        from temper.trainer import Trainer

        config = Config(
            job=Job(dump_folder=folder),
            model=Model(name="llama3", flavor="debug"),
            training=Training(steps=1_000, seq_len=seq_len, local_batch_size=batch),
            metrics=Metrics(tensorboard=False),
        )
        self.trainer = Trainer(config)
        self.batch = next(iter(self.trainer.loader))
        self.best = self.best_cpu = float("inf")
        self()  # warm-up
        self.best = self.best_cpu = float("inf")

    def __call__(self) -> None:
        started, cpu = time.perf_counter(), time.process_time()
        self.trainer.train_step([self.batch])
        self.best = min(self.best, time.perf_counter() - started)
        self.best_cpu = min(self.best_cpu, time.process_time() - cpu)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.loader", description=__doc__)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4, help="rows per batch (one rank)")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--documents", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        step = TrainStep(folder, args.seq_len, args.batch)
        paths = write_corpus(Path(folder), args.documents)
        rows = []
        for kind in KINDS:
            for world in (1, 2):
                runs = []
                for _ in range(args.repeats):
                    step()
                    runs.append(
                        time_loader(paths[kind], world, args.seq_len, args.batch, args.batches)
                    )
                rows.append((kind, world, runs))
    print(
        f"debug llama3 training step, {args.batch} x {args.seq_len} tokens: "
        f"{step.best * 1e3:.0f} ms ({step.best_cpu * 1e3:.0f} ms CPU, all threads)"
    )
    print(
        "| source | ranks | open s | ms / batch | CPU ms / batch | documents/s | tokens/s "
        "| share of step | CPU share of step |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for kind, world, runs in rows:
        opened = min(r[0] for r in runs)
        per_batch = min(r[1] for r in runs)
        cpu = min(r[2] for r in runs)
        _, _, _, documents, tokens = runs[0]
        seconds = per_batch * args.batches
        print(
            f"| {kind} | {world} | {opened:.3f} | {per_batch * 1e3:.1f} | {cpu * 1e3:.1f} | "
            f"{documents / seconds:,.0f} | {tokens / seconds:,.0f} | "
            f"{100 * per_batch / step.best:.1f}% | {100 * cpu / step.best_cpu:.1f}% |"
        )


if __name__ == "__main__":
    main()

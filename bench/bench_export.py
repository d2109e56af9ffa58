"""Deployed inference: a classifier exported to ONNX and run in ONNX Runtime, against PyTorch eager, on the CPU.

Peers, in one process, each exported once (every size dynamic) and timed at every length, random weights:

* ``long-short``: ``LongShortForSequenceClassification`` at roberta-base's width (12 layers, w = 256, r = 64),
  Longformer's first token global (``config.max_global_tokens=1``), exported with ``ls_hf.export.export_onnx``;
* ``modernbert``: ``ModernBertForSequenceClassification`` as ``ModernBertConfig`` defines ModernBERT-base (22 layers,
  a 128-token window in two layers of three, global attention in the third), exported with
  ``torch.onnx.export(dynamo=True)``, SDPA.

Prints per peer and length the best of ``--repeats`` forward passes in each runtime and their ratio, and
ModernBERT's time over Long-Short's; writes ``bench/results/export_cpu.json``.

    python -m bench.bench_export --lengths 1024 4096 16384
"""

import argparse
import functools
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import ModernBertConfig, ModernBertForSequenceClassification

from bench.common import results_path, run_meta, write_json
from ls_hf import LongShortConfig, LongShortForSequenceClassification
from ls_hf.export import export_inputs, export_onnx

PEERS = ("long-short", "modernbert")


def build(peer: str, max_length: int, layers: int):
    """The peer's classifier (2 labels) with room for ``max_length`` tokens, eval mode."""
    torch.manual_seed(0)
    if peer == "modernbert":
        config = ModernBertConfig(max_position_embeddings=max_length, attn_implementation="sdpa", num_labels=2)
        return ModernBertForSequenceClassification(config).eval()
    config = LongShortConfig(
        num_hidden_layers=layers,
        max_position_embeddings=max_length + 2,
        window_size=256,
        projection_rank=64,
        max_global_tokens=1,
        num_labels=2,
    )
    return LongShortForSequenceClassification(config).eval()


def inputs_for(peer: str, model, n: int, batch: int) -> dict:
    """Token ids and a mask of n tokens (the last row's last quarter padding); Long-Short's first token global."""
    inputs = export_inputs(model, batch_size=batch, length=n) if peer == "long-short" else None
    if inputs is None:
        ids = torch.randint(3, model.config.vocab_size, (batch, n), generator=torch.Generator().manual_seed(0))
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        inputs["attention_mask"][-1, n - n // 4 :] = 0
    return inputs


def export(peer: str, model, path: Path) -> None:
    if peer == "long-short":
        export_onnx(model, path)
        return
    inputs = inputs_for(peer, model, 300, 2)
    dims = {name: {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO} for name in inputs}
    with torch.no_grad():
        torch.onnx.export(
            model, (), str(path), kwargs=inputs, dynamic_shapes=dims, input_names=list(inputs), dynamo=True
        )


def best_time(fn, repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn`` after one warm-up, in ms."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def measure_peer(peer: str, lengths, layers: int, batch: int, repeats: int, options, folder: str) -> list[dict]:
    """Export ``peer``'s classifier once, then time it in PyTorch eager and in ONNX Runtime at every length."""
    import onnxruntime as ort

    model = build(peer, max(lengths), layers)
    path = Path(folder) / f"{peer}.onnx"
    start = time.perf_counter()
    export(peer, model, path)
    exported_s = time.perf_counter() - start
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [node.name for node in session.get_inputs()]
    rows = []
    for n in lengths:
        inputs = inputs_for(peer, model, n, batch)
        feed = {name: inputs[name].numpy() for name in names}
        with torch.no_grad():
            expected = model(**inputs).logits.numpy()
            eager = best_time(functools.partial(model, **inputs), repeats)
        onnx = best_time(functools.partial(session.run, None, feed), repeats)
        gap = float(np.abs(session.run(None, feed)[0] - expected).max())
        rows.append(
            {"peer": peer, "n": n, "eager_ms": eager, "onnx_ms": onnx, "max_abs_diff": gap, "export_s": exported_s}
        )
        print(f"{peer:>11} n={n:>6}: eager {eager:9.1f} ms, ONNX Runtime {onnx:9.1f} ms ({eager / onnx:.2f}x)")
    return rows


def measure(peers, lengths, layers: int, batch: int, repeats: int, threads: int) -> list[dict]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    with tempfile.TemporaryDirectory() as folder:
        return [row for peer in peers for row in measure_peer(peer, lengths, layers, batch, repeats, options, folder)]


def table(rows, lengths) -> str:
    def find(peer, n):
        return next((row for row in rows if row["peer"] == peer and row["n"] == n), None)

    header = (
        "| tokens | Long-Short eager / ONNX Runtime (ms) | speed-up | ModernBERT eager / ONNX Runtime (ms) | speed-up "
        "| ModernBERT / Long-Short in ONNX Runtime |"
    )
    lines = [header, "|---|---|---|---|---|---|"]
    for n in lengths:
        ls, mb = find("long-short", n), find("modernbert", n)
        cells = [f"{n:,}"]
        for row in (ls, mb):
            cells += (
                ["-", "-"]
                if row is None
                else [
                    f"{row['eager_ms']:.0f} / {row['onnx_ms']:.0f}",
                    f"{row['eager_ms'] / row['onnx_ms']:.2f}x",
                ]
            )
        cells.append(f"{mb['onnx_ms'] / ls['onnx_ms']:.2f}x" if ls and mb else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS))
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--layers", type=int, default=12, help="Long-Short's layers (ModernBERT keeps its 22)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="for PyTorch and ONNX Runtime")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 layers, short lengths, not saved")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/export_cpu.json)")
    args = parser.parse_args(argv)
    if any(n < 2 for n in args.lengths) or args.batch < 1 or args.repeats < 1 or args.layers < 1:
        parser.error("--lengths must be >= 2 and --batch, --repeats, --layers >= 1")
    if args.quick:
        args.layers, args.lengths, args.repeats = 2, [300, 1000], 1
    torch.set_num_threads(args.threads)
    meta = run_meta("bench.bench_export", argv, layers=args.layers, batch=args.batch, repeats=args.repeats)
    rows = measure(args.peers, args.lengths, args.layers, args.batch, args.repeats, args.threads)
    print(table(rows, args.lengths))
    write_json(args.out or results_path("export_cpu", args.quick), {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main()

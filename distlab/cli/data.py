"""``distlab prepare-text``: a text corpus tokenized once into memory-mapped token files."""

from __future__ import annotations

import sys

import click


@click.command("prepare-text")
@click.argument("src", metavar="SRC")
@click.argument("out", metavar="OUT")
@click.option("--tokenizer", default="bytes", show_default=True,
              help="bytes (a token per byte), bpe:N (a byte-level BPE of N tokens learned from the training "
                   "documents alone; kept as OUT/tokenizer.json) or hf:DIR (a pretrained model's tokenizer.json, "
                   "its end-of-sequence token between documents; copied to OUT).")
@click.option("--progress/--no-progress", default=None, help="Progress bars (default: when a terminal).")
def prepare_text(src, out, tokenizer, progress):
    """Stream the text file or directory SRC into OUT: train.bin and test.bin (every token of the split,
    uint16 when the vocabulary fits, else uint32) and manifest.json (tokenizer, counts, SHA-256). Documents
    (a file's blank-line-separated paragraphs, or one per file; SRC/train and SRC/test as given) are held out
    whole: every 10th goes to test. Train on it with --dataset tokens:OUT (memory-mapped, never loaded whole).
    OUT must be new or empty (nothing there is overwritten); a failure leaves nothing behind."""
    from distlab.data import prepare as tokens
    manifest = tokens.prepare(src, out, tokenizer, progress=sys.stderr.isatty() if progress is None else progress)
    click.echo(f"wrote {out}: {tokens.describe(manifest)}")
    for note in tokens.notes(manifest):
        click.echo(f"distlab: warning: {note}", err=True)
    start = f"--init-from {tokenizer} " if tokenizer.startswith("hf:") else "--model gpt "
    click.echo(f"train on it: distlab train {start}--dataset tokens:{out} ...")

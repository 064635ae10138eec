"""Supervised fine-tuning records: ``sft:FILE.jsonl``, one JSON object per line with a ``prompt`` and a
``completion`` (text), or a chat's ``messages`` (``[{"role": ..., "content": ...}, ...]``, the last the
assistant's reply).

Each record becomes one window of ``block_size + 1`` tokens: the prompt's tokens, the completion's, the
tokenizer's end-of-sequence token where it has one (so the model learns to stop), then padding. Only the
completion's tokens and the end of sequence are targets: the prompt's positions and the padding are
:data:`~distlab.models.IGNORE_INDEX`, so the loss is the mean over the completion tokens of the global
batch -- on every layout (the ignored targets are honoured by the vocabulary-parallel loss, the pipeline's
last stage and context parallel's chunks alike). A record longer than the window is cut at its end (the
count is reported). Records are padded one per window -- or, with ``pack``, laid whole into each window as
many as fit, each window's batch carrying where each record starts (a :class:`~distlab.models.packing.Packed`
beside its token ids) so the model attends within a record only and restarts its positions: no record sees
another either way.

A chat record is rendered by the model's chat template (:mod:`distlab.data.chat`, from
``--tokenizer hf:DIR``'s ``tokenizer_config.json``), and every assistant reply is a target, as TRL's
``assistant_only_loss`` and torchtune train them: each reply and the template's end-of-turn tokens, where
``{% generation %}`` blocks mark them (transformers' assistant mask), or else what the conversation through
a reply adds to the conversation before it with the template's generation prompt
(:func:`~distlab.data.chat.reply_turns`). The system, user and tool turns and the template's headers are
context, not targets; with ``chat_turns`` last, earlier replies are context too.

Record ``i`` (from 0, in file order) is in ``test`` when ``i % 10 == 9``, else in ``train``. Tokens are
bytes by default, or a pretrained model's (``--tokenizer hf:DIR``: its ``tokenizer.json``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from distlab.data import tokenizer as tokenizers
from distlab.errors import ConfigError

PREFIX = "sft:"
TEST_EVERY = 10


def path_of(spec: str) -> Path:
    path = Path(spec[len(PREFIX):]).expanduser()
    if not path.is_file():
        raise ConfigError(f"--dataset {spec}: no such file (give a .jsonl file of {{\"prompt\": ..., \"completion\": ...}} "
                          f"records, one per line)")
    return path


def tokenizer_of(spec: str):
    """bytes, or a pretrained model's tokenizer (``hf:DIR``)."""
    if tokenizers.is_pretrained(spec):
        return tokenizers.HFTokenizer.from_dir(spec[3:])
    if spec != tokenizers.BYTES:
        raise ConfigError(f"--dataset sft: reads its records with bytes or a pretrained model's tokenizer (hf:DIR), "
                          f"not {spec}")
    return tokenizers.ByteTokenizer()


class Record(NamedTuple):
    """A record's text in order as pieces, each with whether its tokens are targets: a prompt's are not, a
    completion's -- every assistant reply of a chat -- are."""
    pieces: tuple[tuple[str, bool], ...]
    chat: bool = False  # rendered by a chat template: its end of turn (if it writes one) ends the reply

    @classmethod
    def of(cls, prompt: str, completion: str, chat: bool = False) -> "Record":
        return cls(((prompt, False), (completion, True)), chat)

    @property
    def scored(self) -> str:
        """The text of its targets."""
        return "".join(text for text, target in self.pieces if target)


RECORD_LIMIT = 8 << 20  # characters in one record's line


def _lines(f, path):
    """``f``'s lines, each at most :data:`RECORD_LIMIT` characters (a longer one is refused, not held whole)."""
    number = 0
    while True:
        number += 1
        try:
            line = f.readline(RECORD_LIMIT + 1)
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start} of a line near line {number}): write the "
                              f"records in UTF-8") from None
        if not line:
            return
        if len(line) > RECORD_LIMIT:
            raise ConfigError(f"{path}:{number}: a record of more than {RECORD_LIMIT:,} characters; split it")
        yield line


def _text(value, where: str) -> None:
    """Every string in a parsed record is text that encodes (a lone surrogate, ``"\\ud800"``, is not)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ConfigError(f"{where}: holds a lone surrogate escape (as \\ud800), not text") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def records(spec: str, template=None, template_dir: str = "", turns: str = "all", ends: tuple = (),
            progress: bool = False) -> list[Record]:
    """Every line's record, in file order (chat records rendered by ``template``, ``turns`` of their replies
    targets: all, or the last; ``ends``: the tokenizer's end-of-turn texts); one line naming the first bad one."""
    from distlab.data.chat import reply_turns
    path, out = path_of(spec), []
    for where, record in objects(path, progress):
        if isinstance(record, dict) and "messages" in record and "prompt" not in record:
            need_template(template, where, template_dir)
            out.append(Record(tuple(reply_turns(template, record["messages"], where, turns == "all", ends)), True))
            continue
        if not (isinstance(record, dict) and isinstance(record.get("prompt"), str)
                and isinstance(record.get("completion"), str)):
            raise ConfigError(f"{where}: a record is {{\"prompt\": TEXT, \"completion\": TEXT}} or "
                              f"{{\"messages\": [{{\"role\": ..., \"content\": TEXT}}, ...]}}")
        out.append(Record.of(record["prompt"], record["completion"]))
    return enough(out, path)


PROGRESS_BYTES = 16 << 20  # a record file this large is read with a progress bar (a line where no terminal)


def objects(path: Path, progress: bool = False):
    """``(where, record)`` of each line of a JSON-lines file holding something (``where``: ``path:line``),
    every string in it text; one line naming the first line that is not JSON. ``progress``: a large file's
    reading is shown (a bar on a terminal, a line otherwise)."""
    from tqdm import tqdm
    size = Path(path).stat().st_size
    shown = progress and size >= PROGRESS_BYTES
    if shown and not sys.stderr.isatty():
        print(f"distlab: reading {size / 2**20:,.0f} MiB of records from {path}", file=sys.stderr, flush=True)
    bar = tqdm(total=size, unit="B", unit_scale=True, desc=f"reading {Path(path).name}", leave=False,
               disable=not (shown and sys.stderr.isatty()))
    with open(path, encoding="utf-8") as f, bar:
        for number, line in enumerate(_lines(f, path), 1):
            bar.update(len(line))
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except RecursionError:
                raise ConfigError(f"{path}:{number}: nested too deeply to be a record") from None
            except ValueError as exc:
                raise ConfigError(f"{path}:{number}: not a JSON object ({exc})") from None
            _text(record, f"{path}:{number}")
            yield f"{path}:{number}", record


def need_template(template, where: str, template_dir: str) -> None:
    """A chat record (messages) is rendered by a model's template: refused where there is none."""
    if template is None:
        raise ConfigError(f"{where}: chat records (messages) are rendered by a model's chat template: give "
                          f"--tokenizer hf:DIR of a model whose tokenizer_config.json has one"
                          + (f" ({template_dir} has none)" if template_dir else ""))


def enough(out: list, path: Path) -> list:
    """``out``, the records of ``path``, where there are enough to hold out every tenth."""
    if len(out) < TEST_EVERY:
        raise ConfigError(f"{path} has {len(out)} records: every {TEST_EVERY}th is held out for testing, so give at "
                          f"least {TEST_EVERY}")
    return out


def once(key: tuple, tokenizer: str, paths, make):
    """``make()``, remembered for the last ``key`` while the files it reads (``paths``, and the tokenizer
    directory's) are unchanged: a process reads and renders a record file once -- the pre-launch check, the
    training split and the test split share it (10^5 chat pairs were read three times over)."""
    directory = Path(tokenizer[3:]) if tokenizers.is_pretrained(tokenizer) else None
    files = [*paths, *((directory / f for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                                                "config.json", "generation_config.json")) if directory else ())]
    stamp = tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) if f.is_file() else (str(f),) for f in files)
    if _ONCE.get("key") != (key, stamp):
        _ONCE.clear()
        _ONCE.update(key=(key, stamp), value=make())
    return _ONCE["value"]


_ONCE: dict = {}  # the last record file read in this process (:func:`once`)


def read(spec: str, tokenizer: str = tokenizers.BYTES, turns: str = "all", progress: bool = False):
    """``(tokenizer, template, records)`` of ``spec`` read with ``--tokenizer`` (its chat template, where its
    directory has one; ``turns`` of a chat's replies trained) -- what a run reads, and what the command checks
    before it launches one (``progress``: a large file's reading shown) -- once per process (:func:`once`)."""
    from distlab.data.chat import ChatTemplate

    def make():
        tok = tokenizer_of(tokenizer)
        template_dir = tokenizer[3:] if tokenizers.is_pretrained(tokenizer) else ""
        template = ChatTemplate.from_dir(template_dir) if template_dir else None
        return tok, template, records(spec, template, template_dir, turns, tok.stop_texts(), progress)
    return once(("sft", spec, tokenizer, turns), tokenizer, [path_of(spec)], make)


def end_of(tok, record: Record, tail: list[int]) -> list[int]:
    """What follows a completion's tokens so the model learns to stop: nothing where a chat template ended
    the turn with a token the model stops at (Llama 3's ``<|eot_id|>``, Qwen's ``<|im_end|>``: a second end
    would teach it to emit both), else the tokenizer's end of sequence (a chat template that writes none:
    its ``eos_token``) unless the completion already ends with it."""
    if record.chat and tok.stops.intersection(tail):
        return []
    eos = tok.eos_token if record.chat and tok.eos_token is not None else tok.eos
    return [eos] if eos is not None and tail[-1:] != [eos] else []


def encode(tok, record: Record) -> tuple[list[int], list[bool]]:
    """``(tokens, which are targets)`` of a record: the tokenizer's BOS before a plain prompt (a chat template
    writes its own), each piece's tokens, the last reply followed by what ends it (:func:`end_of`). Its first
    token is never a target (nothing before it is the record's)."""
    ids, targets = ([], []) if record.chat else (list(tok.begin), [False] * len(tok.begin))
    last = max((i for i, (_, target) in enumerate(record.pieces) if target), default=-1)
    for i, (text, target) in enumerate(record.pieces):
        piece = tok.encode(text.encode("utf-8")).tolist()
        piece += end_of(tok, record, piece) if i == last else []
        ids += piece
        targets += [target] * len(piece)
    targets[:1] = [False] * len(targets[:1])
    return ids, targets


def load_sft(spec: str, split: str, block_size: int, tokenizer: str = tokenizers.BYTES, pack: bool = False,
             turns: str = "all"):
    """The ``split`` of ``spec`` as windows, one record each -- or, ``pack``, as many whole records as fit in
    each window (:func:`packed`; module docstring); ``turns`` of a chat's replies are targets (all, last)."""
    from distlab.data.text import TextDataset
    tok, template, every = read(spec, tokenizer, turns)
    mine = [r for i, r in enumerate(every) if (i % TEST_EVERY == TEST_EVERY - 1) == (split == "test")]
    width = block_size + 1
    rows = []  # (ids, which are targets) of each record, cut at the window's end
    cut = scored = empty = completion_tokens = completion_bytes = 0
    for record in mine:
        ids, targets = encode(tok, record)
        completion_tokens += sum(targets)
        completion_bytes += len(record.scored.encode())
        cut += len(ids) > width
        ids, targets = ids[:width], targets[:width]
        scored += sum(targets)
        empty += not any(targets)  # the prompt fills the window: nothing of the completion is left
        rows.append((ids, targets))
    if split == "train" and not completion_tokens:
        raise ConfigError(f"{spec}: no record has a completion token to learn (every completion is empty and "
                          f"nothing ends it): nothing to train on")
    if empty == len(mine):
        raise ConfigError(f"{spec}: every {split} record's prompt fills the window of `block_size` {block_size} + 1 "
                          f"tokens, leaving no completion token to learn: raise `block_size`")
    windows = packed(rows, width) if pack else [[row] for row in rows]
    stream = np.zeros(len(windows) * width, dtype=np.int64)
    ignored = np.ones(len(windows) * width, dtype=bool)
    starts = np.zeros(len(windows) * width, dtype=bool)  # packed: where each record starts
    for n, window in enumerate(windows):
        at = n * width
        for ids, targets in window:
            stream[at:at + len(ids)] = ids
            starts[at] = True  # where a record starts: its positions restart, it attends to itself only
            ignored[at:at + len(ids)] = ~np.asarray(targets, dtype=bool)  # the replies' tokens (and the end)
            at += len(ids)
    data = TextDataset(spec, split, torch.from_numpy(stream), block_size,
                       torch.arange(len(windows)) * width, str(path_of(spec)), tok.vocab_size,
                       tokenizer=tok if tok.sha256 else None, ignored=torch.from_numpy(ignored), records=True,
                       # the rate of the text the loss is on (a loss per byte): the completions'
                       tokens_per_byte=completion_tokens / completion_bytes if completion_bytes else 1.0,
                       record_starts=torch.from_numpy(starts) if pack else None)
    chats = sum(r.chat for r in mine)
    filled = sum(len(ids) for window in windows for ids, _ in window)
    data.about = describe(len(mine), scored, cut, block_size, len(windows) if pack else None,
                          1 - filled / max(len(windows) * width, 1)) + \
        (f"; {empty:,} with no completion token left (their prompt fills the window)" if empty else "") + \
        (f"; {chats:,} chat records rendered by the chat template of {template.file}, "
         f"{'every assistant reply' if turns == 'all' else 'the last reply'} a target" if chats else "")
    return data


def packed(rows: list[tuple[list[int], list[bool]]], width: int) -> list[list[tuple[list[int], list[bool]]]]:
    """Records laid into windows of ``width`` tokens in their order, each window as many whole records as
    fit (a record is never split between windows; one longer than a window was cut to it)."""
    out: list[list] = []
    room = 0
    for row in rows:
        if not out or len(row[0]) > room:
            out.append([])
            room = width
        out[-1].append(row)
        room -= len(row[0])
    return out


def shape(spec: str, block_size: int, tokenizer: str) -> tuple[tuple[int, ...], int]:
    return (block_size,), tokenizer_of(tokenizer).vocab_size


def describe(n: int, scored: int, cut: int, block_size: int, windows: int | None = None,
             padding: float = 0.0) -> str:
    """The header's words: records, padding (or packing), targets, truncation."""
    laid = (f"packed into {windows:,} windows of {block_size + 1} tokens ({padding:.0%} padding; each record "
            f"attends to itself only, its positions from 0)" if windows is not None else
            f"one per window padded to {block_size + 1} tokens (not packed)")
    return (f"{n:,} records, {laid}, the loss on their {scored:,} completion tokens"
            + (f"; {cut:,} cut at the window's end" if cut else ""))

"""A model's chat template: how its conversations (``messages``, each ``{"role": ..., "content": ...}``)
become text, as the model was trained to read them.

A Hugging Face model directory keeps its template in ``tokenizer_config.json`` (``chat_template``: a
Jinja template, or a list of named ones, ``default`` used) or in ``chat_template.jinja`` beside it.
:class:`ChatTemplate` renders it the way ``transformers``' ``apply_chat_template`` does -- the same
Jinja settings (``trim_blocks``, ``lstrip_blocks``, loop controls), the same helpers (``raise_exception``,
``strftime_now``, a ``tojson`` that does not escape HTML), the tokenizer's special tokens as variables
(``bos_token``, ``eos_token``, ...) -- in Jinja's *immutable sandbox*: a template is data from a
downloaded directory, so it can read what it is given and call nothing else (no attribute of Python's
internals, no file, no import).
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import threading
import time
from datetime import datetime
from pathlib import Path

from distlab.errors import ConfigError
from distlab.models.hf_files import confined, read_json

RENDER_LIMIT = 1 << 20  # characters one conversation may render to (a repetition: items)
RENDER_SECONDS = 10.0  # seconds one conversation may take to render


class _OutOfTime(BaseException):
    """Raised by the alarm inside a render that ran past its budget (a BaseException: no template catches it)."""


@contextlib.contextmanager
def _deadline(seconds: float):
    """Stop the code inside after ``seconds`` (SIGALRM; in the main thread on Unix, else no limit)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def stop(signum, frame):
        raise _OutOfTime()

    previous = signal.signal(signal.SIGALRM, stop)
    began = time.monotonic()
    left, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if left:  # an outer alarm was set: give it back what is left of it
            signal.setitimer(signal.ITIMER_REAL, max(left - (time.monotonic() - began), 1e-3))


MARKS = ("\ue000", "\ue001")  # around a {% generation %} block's text while its spans are read (private use)
MARKING = "distlab_marking"  # the render variable that asks for them
SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _environment():
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (templates that mark the assistant's text): its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body", [nodes.ContextReference()]), [], [],
                                   body).set_lineno(lineno)

        def _body(self, context, caller):  # marked where the caller asks for the spans (ChatTemplate.spans)
            text = caller()
            return f"{MARKS[0]}{text}{MARKS[1]}" if context.get(MARKING) else text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Bounded(ImmutableSandboxedEnvironment):
        """The sandbox, with everything that can make a long text from a short one bounded before it is made:
        repetition (``'x' * 10**9``), powers, printf and format widths (``'%1000000000s' % x``), padding and
        replacing (``|center(10**9)``, ``.ljust``, ``|replace('', ...)``)."""
        intercepted_binops = frozenset({"*", "**", "%"})

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's own signature
            method = getattr(__obj, "__wrapped__", __obj)  # (the sandbox wraps str.format in its own)
            if isinstance(getattr(method, "__self__", None), str):  # a string's method: what it would write
                _bounded_method(method.__self__, method.__name__, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        def call_binop(self, context, operator, left, right):
            if operator == "%" and isinstance(left, str):
                _check(len(left) + _widths(left), f"a format of {left[:40]!r}")
            if operator == "*":
                n, seq = (right, left) if isinstance(left, (str, list, tuple)) else (left, right)
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > RENDER_LIMIT:
                    raise jinja2.exceptions.SecurityError(f"a repetition of {len(seq) * n:,} items (the limit is "
                                                          f"{RENDER_LIMIT:,})")
            if operator == "**" and isinstance(right, (int, float)) and isinstance(left, (int, float)) and \
                    abs(right) > 64 and abs(left) > 1:
                raise jinja2.exceptions.SecurityError(f"a power of {right} (the limit is 64)")
            return super().call_binop(context, operator, left, right)

    # (not optimized: the optimizer folds a constant expression -- ''|center(3000000000) -- while it compiles,
    # outside every bound a render has)
    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols], optimized=False)
    env.globals.pop("lipsum", None)  # generates text of any length
    for name, size in _FILTER_SIZES.items():  # each filter that pads or replaces, bounded before it runs
        env.filters[name] = _bounded_filter(env.filters[name], size, name)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _check(n: int, what: str) -> None:
    if n > RENDER_LIMIT:
        import jinja2
        raise jinja2.exceptions.SecurityError(f"{what} would write {n:,} characters (the limit is {RENDER_LIMIT:,})")


def _widths(fmt: str) -> int:
    """What the widths and precisions of a printf (``%10s``) or format (``{:>10}``) text may add to it."""
    specs = re.findall(r"%[^a-zA-Z%]*[a-zA-Z%]|\{[^{}]*\}", fmt)
    return sum(int(n) for spec in specs for n in re.findall(r"\d+", spec))


def _number(value, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _replaced(s: str, old, new, count=None) -> int:
    old, new = str(old), str(new)
    found = s.count(old) if old else len(s) + 1
    found = min(found, _number(count, found)) if count is not None and _number(count, -1) >= 0 else found
    return len(s) + max(0, len(new) - len(old)) * found


# a filter's output size from its arguments (the value first), before it runs
_FILTER_SIZES = {
    "center": lambda v, width=80, *a, **k: len(str(v)) + _number(width),
    "indent": lambda s, width=4, *a, **k: len(str(s)) + (_number(width) if not isinstance(width, str) else len(width))
    * (str(s).count("\n") + 1),
    "format": lambda v, *a, **k: len(str(v)) + _widths(str(v)) + sum(len(str(x)) for x in [*a, *k.values()]),
    "replace": lambda s, old="", new="", count=None, *a, **k: _replaced(str(s), old, new, count),
    "wordwrap": lambda s, width=79, break_long_words=True, wrapstring=None, *a, **k:
        len(str(s)) * (1 + len(str(wrapstring or "\n"))),
}
# a string method's output size from its arguments (the string is ``s``)
_METHOD_SIZES = {
    "center": lambda s, width=0, *a: len(s) + _number(width), "ljust": lambda s, width=0, *a: len(s) + _number(width),
    "rjust": lambda s, width=0, *a: len(s) + _number(width), "zfill": lambda s, width=0, *a: len(s) + _number(width),
    "expandtabs": lambda s, tabsize=8, *a: len(s) + _number(tabsize, 8) * s.count("\t"),
    "replace": lambda s, old="", new="", count=-1, *a: _replaced(s, old, new, count),
    "format": lambda s, *a, **k: len(s) + _widths(s) + sum(len(str(x)) for x in [*a, *k.values()]),
}


def _bounded_method(s: str, name: str, args, kwargs) -> None:
    size = _METHOD_SIZES.get(name)
    if size is not None:
        try:
            n = size(s, *args, **kwargs)
        except TypeError:  # arguments the method itself refuses: it says so when it is called
            return
        _check(n, f"{name}() of a string")


def _bounded_filter(original, size, name: str):
    import functools

    @functools.wraps(original)
    def bounded(*args, **kwargs):
        plain = [a for a in args if not hasattr(a, "environment")]  # (an eval or environment context first)
        try:
            n = size(*plain, **kwargs)
        except TypeError:
            n = 0  # arguments the filter itself refuses: it says so
        _check(n, f"|{name}")
        return original(*args, **kwargs)

    return bounded


class ChatTemplate:
    """``render(messages, add_generation_prompt)``: a conversation as the model's text."""

    def __init__(self, source: str, special: dict[str, str], where: str = "the chat template", file: str = ""):
        import jinja2
        self.source, self.special, self.where = source, special, where
        self.file = file  # the file it came from ("": given as text)
        try:
            with _deadline(RENDER_SECONDS):  # compiling is bounded as a render is
                self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ConfigError(f"{where}: not a Jinja template ({exc})") from None
        except _OutOfTime:
            raise ConfigError(f"{where}: did not compile within {RENDER_SECONDS:g} s") from None
        except (RecursionError, MemoryError):
            raise ConfigError(f"{where}: not a template distlab compiles (nested too deeply or too large)") from None

    @property
    def marked(self) -> bool:
        """Whether the template marks the assistant's text (``{% generation %}``, as transformers'
        ``return_assistant_tokens_mask`` reads it)."""
        return re.search(r"{%-?\s*generation\s*-?%}", self.source) is not None

    def spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the ``(start, end)`` character spans of its ``{% generation %}`` blocks."""
        if any(mark in str(m.get("content")) for m in messages for mark in MARKS):
            raise ConfigError(f"{self.where}: a message holds U+E000 or U+E001, the characters that mark the "
                              f"assistant's text while it is found: remove them")
        marked, text, out, start = self.render(messages, **{MARKING: True}), [], [], None
        for ch in marked:
            if ch == MARKS[0]:
                start = sum(map(len, text))
            elif ch == MARKS[1]:
                out.append((start, sum(map(len, text))))
            else:
                text.append(ch)
        return "".join(text), out

    def render(self, messages: list[dict], add_generation_prompt: bool = False, **marking) -> str:
        """The conversation as text, within a budget: at most :data:`RENDER_LIMIT` characters and
        :data:`RENDER_SECONDS` seconds (in the main thread: an alarm stops a loop that never ends) --
        anything the template does wrong is one line naming it."""
        import jinja2
        out, size = [], 0
        try:
            with _deadline(RENDER_SECONDS):
                for piece in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                     tools=None, documents=None, **self.special, **marking):
                    size += len(piece)
                    if size > RENDER_LIMIT:
                        raise jinja2.exceptions.SecurityError(f"it renders more than {RENDER_LIMIT:,} characters")
                    out.append(piece)
        except jinja2.TemplateError as exc:  # the template's own refusal (raise_exception) or a sandbox breach
            raise ConfigError(f"{self.where} refused a conversation: {exc}") from None
        except _OutOfTime:
            raise ConfigError(f"{self.where} did not render a conversation within {RENDER_SECONDS:g} s") from None
        except RecursionError:
            raise ConfigError(f"{self.where} failed on a conversation: it recurses without end") from None
        except Exception as exc:  # noqa: BLE001 - a template is someone else's code: any failure is one line
            raise ConfigError(f"{self.where} failed on a conversation: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:200] if str(exc) else ''}") from None
        return "".join(out)

    @classmethod
    def from_dir(cls, directory: str | Path) -> "ChatTemplate | None":
        """The template of a model directory (None: it has none)."""
        root = Path(directory)
        config_path = root / "tokenizer_config.json"
        config = read_json(config_path, str(root)) if config_path.is_file() else {}
        jinja = root / "chat_template.jinja"
        if jinja.is_file():
            confined(jinja, str(root))
            try:
                jinja_text = jinja.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise ConfigError(f"{jinja} is not text (UTF-8)") from None
        return cls.of(config, jinja_text if jinja.is_file() else None, str(config_path), str(jinja))

    @classmethod
    def from_files(cls, files: dict[str, str], where: str) -> "ChatTemplate | None":
        """The template of a model's tokenizer files as a run kept them (name -> text: ``tokenizer_config.json``,
        ``chat_template.jinja``), ``where`` naming whose they are; None where they hold none."""
        config = {}
        if isinstance(files.get("tokenizer_config.json"), str):
            try:
                config = json.loads(files["tokenizer_config.json"])
            except (ValueError, RecursionError):
                raise ConfigError(f"{where}: its tokenizer_config.json is not JSON") from None
        return cls.of(config if isinstance(config, dict) else {}, files.get("chat_template.jinja"),
                      f"{where}: tokenizer_config.json", f"{where}: chat_template.jinja")

    @classmethod
    def of(cls, config: dict, jinja: str | None, config_where: str, jinja_where: str) -> "ChatTemplate | None":
        """The template of a parsed ``tokenizer_config.json`` (``chat_template``: a Jinja text, or a list of named
        ones, ``default`` used), else of ``chat_template.jinja``'s text; its special tokens from the config."""
        source, where, file = config.get("chat_template"), f"{config_where}: chat_template", config_where
        if isinstance(source, list):  # named templates: the default one
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
        if source is None and isinstance(jinja, str):
            source, file = jinja, jinja_where
            where = jinja_where
        if not isinstance(source, str):
            return None
        special = {}
        for name in SPECIAL:
            value = config.get(name)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                special[name] = value
        return cls(source, special, where, file)


def check_messages(messages, where: str) -> None:
    """A conversation as the template reads one (one line naming ``where`` it is not)."""
    _messages(messages, where)


def _messages(messages, where: str) -> None:
    if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise ConfigError(f"{where}: messages is a list of {{\"role\": ..., \"content\": TEXT}}")
    if messages[-1]["role"] != "assistant":
        raise ConfigError(f"{where}: the last message is the {messages[-1]['role']}'s; fine-tuning learns the "
                          f"assistant's replies, so a conversation ends with one")


def split_reply(template: ChatTemplate, messages: list, where: str) -> tuple[str, str]:
    """``(prompt, reply)`` texts of a conversation whose last message is the assistant's: the conversation
    before it with the template's generation prompt, and what the whole conversation adds to that."""
    (prompt, _), (reply, _) = reply_turns(template, messages, where, every=False, plain=True)
    return prompt, reply


def reply_turns(template: ChatTemplate, messages: list, where: str, every: bool = True, ends: tuple = (),
                plain: bool = False) -> list[tuple[str, bool]]:
    """The conversation's text as pieces in order, each with whether it is a target: the assistant's replies
    (``every`` one, or only the last) are, the rest -- system, user and tool turns, the template's headers --
    are not. Where the template marks the assistant's text (``{% generation %}``) the replies are those
    blocks, as transformers' assistant mask has them (unless ``plain``); otherwise reply ``i`` starts where the
    conversation before it, with the generation prompt, ends, and ends where the conversation through it does
    -- or, for a template that renders an earlier reply differently when it is last (Qwen3's reasoning), at
    the first of ``ends`` (the tokenizer's end-of-turn texts) after its start."""
    _messages(messages, where)
    last = len(messages) - 1
    if template.marked and not plain:
        whole, spans = template.spans(messages)
        spans = spans if every else spans[-1:]
        if not spans:
            raise ConfigError(f"{where}: the chat template marks no assistant text ({{% generation %}}) in it")
        pieces, at = [], 0
        for start, end in spans:
            pieces += [(whole[at:start], False), (whole[start:end], True)]
            at = end
        return [p for p in [*pieces, (whole[at:], False)] if p[0]]
    whole = template.render(messages)
    pieces, at = [], 0
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant" and (every or i == last)]
    for k, i in enumerate(replies, 1):
        prompt = template.render(messages[:i], add_generation_prompt=True)
        if not whole.startswith(prompt) or len(prompt) < at:
            which = "the last reply" if i == last else f"reply {k} of {len(replies)}"
            raise ConfigError(f"{where}: the chat template renders the conversation before {which} (with "
                              f"its generation prompt) as other text than the whole conversation's start, so the "
                              f"reply's tokens cannot be told apart (Mistral's template moves a system message to "
                              f"the last user turn: drop it or write it into the first user turn)")
        end = len(whole) if i == last else _reply_end(template, messages, i, whole, len(prompt), ends, where)
        pieces += [(whole[at:len(prompt)], False), (whole[len(prompt):end], True)]
        at = end
    return [p for p in [*pieces, (whole[at:], False)] if p[0]]


def _reply_end(template: ChatTemplate, messages: list, i: int, whole: str, start: int, ends: tuple,
               where: str) -> int:
    """Where earlier reply ``i`` ends in the whole conversation's text ``whole`` (:func:`reply_turns`)."""
    through = template.render(messages[:i + 1])
    if whole.startswith(through) and len(through) > start:
        return len(through)
    found = [whole.find(e, start) + len(e) for e in ends if e and whole.find(e, start) >= 0]
    if found:
        return min(found)
    raise ConfigError(f"{where}: where reply {i + 1} ends cannot be told (the chat template renders it otherwise "
                      f"when it is the last, and it holds no end of turn): train the last reply only "
                      f"(`chat_turns` last), or use a template that marks replies with {{% generation %}}")

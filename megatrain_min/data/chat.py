"""chat.py -- a conversation in the model's own chat format: its chat_template rendered, its answers
found.

What it is
    load_template(model_dir): the chat template of a model directory, where transformers looks for
    it (chat_template.jinja, else tokenizer_config.json's "chat_template"; of several named ones,
    "default").
    render(template, messages, special_tokens): the template rendered with jinja2 as transformers'
    apply_chat_template renders it: a sandboxed environment (ImmutableSandboxedEnvironment) with
    trim_blocks and lstrip_blocks, the loopcontrols extension, raise_exception, a tojson that does
    not escape HTML, strftime_now, and the tokenizer's named special tokens (bos_token, eos_token,
    ...).
    chat_tokens(tokenizer, messages) -> (ids, supervised): ids are what
    apply_chat_template(messages, tokenize=True) gives -- the rendered text through tokenizer.json,
    no special tokens added -- and supervised[i] is True for the tokens of each assistant turn: what
    the model writes after the template's prompt for that turn (its content, plus whatever the
    template puts before it inside the turn, like Qwen3's <think> block) and the end-of-turn marker
    after it (<|eot_id|>, <|im_end|>, </s>). Not supervised: everything else, including the
    whitespace a template writes after the marker (ChatML's "\n" after <|im_end|>): the model stops
    at the marker, the newline is the template's glue to the next turn, never generated.
How the turns are found (no {% generation %} markers needed)
    A template may rewrite history (Qwen3 drops the <think> block of answers before the last
    question; Mistral v0.3 moves the system message into the last user turn), so a rendering of the
    first k messages is not always a prefix of the whole one. Every position is therefore found in
    the text being tokenized:
    * where a message's content ends: render once more with a private-use character appended to that
      content; it lands right after the content (after any whitespace the template trims);
    * where an answer starts: where the generation prompt render(messages[:k],
      add_generation_prompt=True) ends, if it is a prefix of the whole rendering; else (history
      rewritten) the text that prompt puts after the previous message's content, matched at that
      content's end in the whole rendering;
    * the end-of-turn marker: what the template writes after the answer when it ends the
      conversation (render(messages[:k+1]) after that content), as far as the whole rendering
      agrees, without trailing whitespace.
    A token is supervised when its characters (tokenizer.json's offsets) overlap such a span, the
    rule of transformers' return_assistant_tokens_mask. A template that renders a content twice or
    changes it beyond trimming raises ChatTemplateError.
What it is not
    No tools, documents or multimodal content; no control-token sanitising (transformers' default is
    off too). jinja2 is a runtime dependency because these templates are jinja programs;
    transformers is not.
Reference
    transformers' utils/chat_template_utils.py (render_jinja_template) and apply_chat_template in
    tokenization_utils_base.py (the behaviour; no code is copied); TRL's assistant-only loss.
Try it
    python -m megatrain_min.chat MODEL_DIR chat.jsonl [LINE]   # one line's tokens and loss mask
    python -m pytest tests/data/test_chat.py     # ids and masks vs transformers, four templates
"""
import contextlib
import json
import signal
import threading
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import numpy as np

from megatrain_min.data.tokenizer import ChatTemplateError

# one conversation's rendering: time and size (far above any real one)
RENDER_S, RENDER_CHARS = 10.0, 16 << 20
ROLES = ("system", "user", "assistant", "tool")  # the roles chat templates know, as they spell them
# names a message's reasoning goes by, as transformers
REASONING = ("reasoning_content", "thinking", "reasoning")


# ----------------------------------------------------------------------------- rendering
@lru_cache(maxsize=16)
def _compile(template):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %} (transformers' assistant marker) renders its body
        unchanged."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [],
                                          body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    # jinja's escapes HTML
    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, Generation])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat_template does not compile: {e}") from None


class _TooLong(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds):
    """Raise _TooLong in the block after `seconds` (a timer signal: the main thread only; elsewhere
    no limit)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(*_):
        raise _TooLong
    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def render(template, messages, special_tokens, add_generation_prompt=False, now=None):
    """The template's text for messages. now: the datetime strftime_now reads (default: now). A
    template that runs longer than RENDER_S or writes more than RENDER_CHARS for one conversation is
    refused (a loop)."""
    compiled, now, parts, size = _compile(template), now or datetime.now(), [], 0
    try:
        with _deadline(RENDER_S):
            for piece in compiled.generate(messages=messages, tools=None, documents=None,
                                           add_generation_prompt=add_generation_prompt,
                                           strftime_now=lambda fmt: now.strftime(fmt),
                                           **special_tokens):
                size += len(piece)
                if size > RENDER_CHARS:
                    raise ChatTemplateError("chat_template wrote more than "
                                            f"{RENDER_CHARS:,} characters for one "
                                            "conversation: a runaway loop in the template?")
                parts.append(piece)
    except ChatTemplateError:
        raise
    except _TooLong:
        raise ChatTemplateError(f"chat_template ran longer than {RENDER_S:g} s for one "
                                "conversation: a runaway loop in the template?") from None
    except Exception as e:
        # raise_exception, undefined names, sandbox refusals, a TypeError in the template ...
        raise ChatTemplateError(f"chat_template failed ({type(e).__name__}): "
                                f"{(str(e).splitlines() or [''])[0]}") from None
    return "".join(parts)


def check_messages(messages):
    """ValueError (one line) unless messages is a non-empty list of
    {"role": str, "content": str, ...}."""
    if not isinstance(messages, list) or not messages:
        raise ValueError('"messages" must be a non-empty list of {"role", "content"} objects')
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise ValueError(f'messages[{i}] must be an object with string "role" and "content"')
    if not any(m["role"] == "assistant" for m in messages):
        cased = sorted(
            {m["role"] for m in messages if m["role"].lower() in ROLES and m["role"] not in ROLES})
        raise ValueError(f"roles are lower-case ({', '.join(ROLES)}): found "
                         f"{', '.join(map(repr, cased))}" if cased
                         else "no assistant message: nothing to learn from this conversation")


def _as_given(messages):
    """What transformers hands the template: keys with None values dropped, reasoning under all its
    names."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        r = next((m[k] for k in REASONING if k in m), None)
        out.append(m if r is None else {"thinking": r, **m, "reasoning_content": r})
    return out


# ----------------------------------------------------------------------------- finding the turns
def _common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def _content_end(render_fn, msgs, i, text, mark):
    """Where messages[i]'s content ends in text = render_fn(msgs): render once more with `mark` (one
    character found nowhere else) appended to it. The mark lands after the content and after any
    whitespace the template trimmed off it; everything else must be unchanged."""
    probe = render_fn(msgs[:i] + [{**msgs[i], "content": msgs[i]["content"] + mark}] + msgs[i + 1:])
    u, n = probe.find(mark), len(probe) - len(text)   # the probe is text with n characters inserted
    p = u - n + 1                                     # ... ending with the mark
    if (probe.count(mark) != 1 or p < 0 or (p < u and not probe[p:u].isspace())
            or probe[:p] != text[:p] or probe[u + 1:] != text[p:]):
        raise ChatTemplateError(f"the chat template does not render messages[{i}]['content'] once "
                                "and unchanged (trimming aside), so the turns of this "
                                "conversation cannot be found")
    return p


def _answer_span(render_fn, msgs, k, text, mark):
    """(start, end) characters of assistant turn k in text = render_fn(msgs): see the module
    docstring."""
    if k == 0:
        raise ChatTemplateError("messages[0] is an assistant turn: there is no "
                                "prompt before it to answer")
    end = _content_end(render_fn, msgs, k, text, mark)
    last = render_fn(msgs[:k + 1])   # turn k ends the conversation
    # usually a prefix of the whole
    after = (last[end:] if text.startswith(last) and end <= len(last)
             else last[_content_end(render_fn, msgs[:k + 1], k, last, mark):])
    marker = _common_prefix(after, text[end:]).rstrip()
    prompt = render_fn(msgs[:k], True)                           # what makes the model write turn k
    if text.startswith(prompt):
        start = len(prompt)
    else:           # history rewritten: the prompt's tail after the previous content, found in text
        gen_fn = lambda m: render_fn(m, True)                                 # noqa: E731
        glue = prompt[_content_end(gen_fn, msgs[:k], k - 1, prompt, mark):]
        prev = _content_end(render_fn, msgs, k - 1, text, mark)
        start = prev + len(_common_prefix(glue, text[prev:]))
    if start > end:
        raise ChatTemplateError(f"the generation prompt for messages[{k}] runs past its content in "
                                "the conversation")
    return start, end + len(marker)


def chat_tokens(tokenizer, messages):
    """(ids, supervised): int64 and bool arrays of the conversation in the tokenizer's own chat
    template.

    tokenizer: tokenizer.HFTokenizer(model_dir) (its .chat_template, .special_tokens,
    .encode_offsets). ids equal transformers' apply_chat_template(messages,
    tokenize=True)["input_ids"]; supervised marks every assistant turn's answer and end-of-turn
    marker. Raises ValueError (ChatTemplateError) with one line.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ChatTemplateError("the tokenizer has no chat_template")
    check_messages(messages)
    # one clock for all renderings of this conversation
    msgs, now = _as_given(messages), datetime.now()

    def render_fn(m, gen=False):
        return render(tokenizer.chat_template, m, tokenizer.special_tokens, gen, now)
    text = render_fn(msgs)
    # a private-use character
    mark = next(chr(c) for c in range(0xE000, 0xF900) if chr(c) not in text)
    spans = [_answer_span(render_fn, msgs, k, text, mark) for k, m in enumerate(msgs)
             if m["role"] == "assistant"]
    ids, offsets = tokenizer.encode_offsets(text)
    ids, offsets = np.asarray(ids, dtype=np.int64), np.asarray(offsets,
                                                               dtype=np.int64).reshape(-1, 2)
    supervised = np.zeros(len(ids), dtype=bool)
    for s, e in spans:
        supervised |= (offsets[:, 1] > s) & (offsets[:, 0] < e)
    return ids, supervised


def layout(tokenizer, ids, supervised):
    """The tokens as text, each supervised run in [[ ]] -- what docs/fine-tuning.md shows and
    __main__ prints."""
    out, i = [], 0
    while i < len(ids):
        j = i
        while j < len(ids) and supervised[j] == supervised[i]:
            j += 1
        piece = tokenizer.decode(ids[i:j])
        out.append(f"[[{piece}]]" if supervised[i] else piece)
        i = j
    return "".join(out)


def main(argv=None):
    """`python -m megatrain_min.chat MODEL_DIR DATA.jsonl [LINE]`: one line's tokens, the supervised
    ones in [[ ]]. Exit 2 with one line on bad input."""
    import argparse
    from megatrain_min.data.tokenizer import HFTokenizer
    p = argparse.ArgumentParser(prog="python -m megatrain_min.chat",
                                description="Print how one .jsonl conversation is tokenized and "
                                            "which tokens carry loss.")
    p.add_argument("model_dir", help="a model directory with tokenizer.json and a chat template")
    p.add_argument("jsonl", help='a .jsonl file of {"messages": [...]} lines')
    p.add_argument("line", nargs="?", type=int, default=1, help="which line (1-based)")
    a = p.parse_args(argv)
    try:
        tok = HFTokenizer(a.model_dir)
        lines = Path(a.jsonl).read_text(encoding="utf-8").splitlines()
        if not 1 <= a.line <= len(lines):
            raise ValueError(f"{a.jsonl} has {len(lines)} lines, no line {a.line}")
        ids, sup = chat_tokens(tok, json.loads(lines[a.line - 1]).get("messages"))
    except (ValueError, OSError, AttributeError) as e:
        p.exit(2, f"error: {e}\n")
    print(f"{len(ids)} tokens, {int(sup.sum())} supervised ([[ ]]):")
    print(layout(tok, ids, sup))
    print("tokens:", " ".join(f"[{tok.decode([t])!r}]" if s else repr(tok.decode([t]))
                              for t, s in zip(ids, sup)))
    return 0


if __name__ == "__main__":
    main()

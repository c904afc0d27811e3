"""tokenizer.py -- a model directory's tokenizer: tokenizer.json, its special tokens, its chat
template.

What it is
    HFTokenizer(model_dir): tokenizer.json through the `tokenizers` package (no transformers at run
    time), the bos and eos tokens the directory names, its named special tokens, and its chat
    template (load_template: where transformers looks for it). Any directory holding the
    TOKENIZER_FILES is a tokenizer source: a Hugging Face model directory, an export of ours
    (hf.save_hf), one of our checkpoints (checkpoint.save with tokenizer_from=);
    copy_tokenizer_files carries them along, with config.json's bos/eos/pad ids (config_ids).
What it is not
    No BPE training and no tokenizer of our own beyond bytes (data.ByteTokenizer).
Try it
    python -m megatrain_min.chat MODEL_DIR chat.jsonl   # a conversation through its tokenizer
"""
import hashlib
import json
import shutil
from pathlib import Path

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")


class ChatTemplateError(ValueError):
    """A chat template that cannot be found, rendered, or whose turns cannot be found. One line."""


def load_template(model_dir):
    """The model directory's chat template (a jinja source string), or None if it has none."""
    d = Path(model_dir)
    files = {p.stem: p for p in sorted((d / "additional_chat_templates").glob("*.jinja"))}
    # files win over tokenizer_config.json, as in transformers
    if (d / "chat_template.jinja").is_file():
        files["default"] = d / "chat_template.jinja"
    if files:
        template = {}
        for name, p in files.items():
            try:
                template[name] = p.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise ChatTemplateError(f"{p}: not UTF-8 text (byte "
                                        f"{e.object[e.start]:#04x} at offset {e.start:,}); "
                                        "save the template as UTF-8") from None
    else:
        conf = _read_json(d / "tokenizer_config.json", strict=True)
        template = conf.get("chat_template") if isinstance(conf, dict) else None
        if isinstance(template, list):                  # [{"name": ..., "template": ...}, ...]
            template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if isinstance(template, dict):
        if not isinstance(template.get("default"), str):
            raise ChatTemplateError(f"{d}: chat templates {sorted(map(str, template))} "
                                    "and none named 'default'")
        template = template["default"]
    return template if isinstance(template, str) and template.strip() else None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json",
                   "generation_config.json")
# what a model's config.json says of its tokenizer
CONFIG_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _read_json(path, strict=False):
    """The JSON object in path; {} when there is no such file. A file that is there but not JSON: {}
    or, when strict (a file the tokenizer's behaviour depends on: its chat template, its special
    tokens), ValueError."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        if strict:
            first = (str(e).splitlines() or [""])[0]
            why = e.strerror if isinstance(e, OSError) else f"not valid JSON: {first}"
            raise ValueError(f"{path}: {why}; fix or remove it (it holds the tokenizer's special "
                             "tokens and chat template)") from None
        return {}


def config_ids(model_dir):
    """{bos/eos/pad_token_id: value} of a model directory's config.json; for one of our checkpoints
    (no config.json) the copy of them that checkpoint.save recorded in its meta.json under
    "tokenizer"."""
    d = Path(model_dir)
    if (d / "config.json").is_file():
        conf = _read_json(d / "config.json")
    else:
        conf = _read_json(d / "meta.json")
        conf = conf.get("tokenizer") if isinstance(conf, dict) else None
        conf = conf.get("config_ids") if isinstance(conf, dict) else None
    return {k: conf[k] for k in CONFIG_IDS if k in conf} if isinstance(conf, dict) else {}


def file_sha256(path):
    """sha256 (hex) of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def copy_tokenizer_files(src, dst):
    """Copy src's tokenizer files (TOKENIZER_FILES and additional_chat_templates/) into the
    directory dst. Returns {"files": [names copied], "config_ids": config_ids(src),
    "sha256": {file: its sha256}}: what dst needs to be the same tokenizer source as src
    (hf.save_hf writes the ids into its config.json, checkpoint.save all of it into its meta.json,
    and ckpt_read.check_tokenizer then verifies the files)."""
    src, dst = Path(src), Path(dst)
    files = [f for f in TOKENIZER_FILES if (src / f).is_file()]
    for f in files:
        shutil.copyfile(src / f, dst / f)
    if (src / "additional_chat_templates").is_dir():       # named chat templates beside the default
        shutil.copytree(src / "additional_chat_templates", dst / "additional_chat_templates")
        files.append("additional_chat_templates")
    copies = [p for f in files for p in [dst / f, *sorted((dst / f).rglob("*"))] if p.is_file()]
    shas = {str(p.relative_to(dst)): file_sha256(p) for p in copies}
    return {"files": files, "config_ids": config_ids(src), "sha256": shas}


def _valid(text):
    """text, unless it holds a lone surrogate (JSON's "\\ud800"): not Unicode, so no tokenizer takes
    it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text holds a lone surrogate {text[e.start]!r} at "
                         f"character {e.start:,}: not valid Unicode (a half of a UTF-16 "
                         "pair); fix the text") from None
    return text


class HFTokenizer:
    """A model directory's tokenizer.json through the `tokenizers` package (no transformers at run
    time). model_dir: a Hugging Face model directory, or one of our checkpoints that carries the
    tokenizer files.

    eos_id: the eos token named by tokenizer_config.json or special_tokens_map.json, else
    generation_config.json's or config.json's eos_token_id (config_ids: a checkpoint's record of
    them), else None. bos_id: the bos token named by those tokenizer files (and not switched off by
    add_bos_token: false), else None -- Qwen has none, Llama and Mistral do.
    chat_template: the directory's template (chat.load_template) or None; special_tokens: the named
    ones ({"bos_token": "<s>", ...}) that a template sees.
    """

    def __init__(self, model_dir):
        d = Path(model_dir)
        if not (d / "tokenizer.json").is_file():
            raise ValueError(f"{d}: no tokenizer.json (a model directory's fast tokenizer is "
                             "needed to tokenize text)")
        from tokenizers import Tokenizer
        try:
            self.tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001 -- the tokenizers package raises its own type
            raise ValueError(f"{d / 'tokenizer.json'}: not a readable tokenizer "
                             f"({(str(e).splitlines() or [type(e).__name__])[0]})") from None
        self.vocab_size = self.tok.get_vocab_size()
        files = [_read_json(d / "tokenizer_config.json", strict=True),
                 _read_json(d / "special_tokens_map.json", strict=True)]
        self.eos_id = self._named(files, "eos_token")
        if self.eos_id is None:
            for conf in (_read_json(d / "generation_config.json"), config_ids(d)):
                ids = conf.get("eos_token_id")
                ids = ids[0] if isinstance(ids, list) and ids else ids
                if isinstance(ids, int):
                    self.eos_id = ids
                    break
        self.bos_id = self._named(files,
                                  "bos_token") if files[0].get("add_bos_token", True) else None
        self.special_tokens = {}
        for name in SPECIAL_NAMES:
            tok = next((conf[name] for conf in files if conf.get(name) is not None), None)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            if isinstance(tok, str):
                self.special_tokens[name] = tok
        self.chat_template = load_template(d)

    def _named(self, files, field):
        for conf in files:
            tok = conf.get(field)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            if isinstance(tok, str) and self.tok.token_to_id(tok) is not None:
                return self.tok.token_to_id(tok)
        return None

    def encode(self, text):
        return self.tok.encode(_valid(text), add_special_tokens=False).ids

    def encode_offsets(self, text):
        """(ids, [(start, end)] character offsets of each token in text)."""
        enc = self.tok.encode(_valid(text), add_special_tokens=False)
        return enc.ids, enc.offsets

    def decode(self, ids):
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

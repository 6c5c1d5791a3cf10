"""Tokenizer side of generation (driver only): encode prompts, apply the chat template, stream text."""

from __future__ import annotations

from pathlib import Path

from shardlm.engine import chat_template
from shardlm.models.args import ModelConfigError


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def unicode_problem(text: str) -> str | None:
    """Why `text` is not Unicode text that a tokenizer takes, else None: a lone surrogate, which a JSON escape
    ("\\ud800") or a command-line byte that is not UTF-8 (Python keeps byte 0xff as U+DCFF) leaves in a str."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        what = f"byte 0x{code - 0xDC00:02X}, which is not UTF-8," if 0xDC80 <= code <= 0xDCFF else \
            f"a lone surrogate U+{code:04X}"
        return f"not Unicode text: {what} at character {e.start}"


def has_tokenizer(folder: Path) -> bool:
    """Whether `folder` holds tokenizer files (a weights-only folder serves token ids only)."""
    return any((Path(folder) / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(folder: Path):
    """The tokenizer stored beside the weights.

    With a tokenizer.json, the `tokenizers` library reads it directly (0.1 s) behind the small
    interface generation uses (`FastTokenizer`); importing transformers' AutoTokenizer costs about
    2 s of every command's start-up, measured here; its chat template renders with jinja2 alone
    (engine/chat_template.py). Folders with only tokenizer.model or vocab.json go through AutoTokenizer.
    """
    folder = Path(folder)
    if not has_tokenizer(folder):
        raise ModelConfigError(
            f"{folder} has no tokenizer files (tokenizer.json, tokenizer.model or vocab.json); copy the "
            "tokenizer of the model into that folder"
        )
    if (folder / "tokenizer.json").is_file():
        return FastTokenizer(folder)
    return _auto_tokenizer(folder)


def _auto_tokenizer(folder: Path):
    from transformers import AutoTokenizer  # imported lazily: ~2 s

    return AutoTokenizer.from_pretrained(str(folder))


def _token_text(value) -> str | None:
    """A special token from tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class FastTokenizer:
    """tokenizer.json read by the `tokenizers` library, with the parts of the Hugging Face
    tokenizer interface generation uses: `tok(text)["input_ids"]`, `decode`, `pad_token_id`,
    `eos_token_id`, `chat_template` and `apply_chat_template` (rendered as transformers renders it).

    `add_bos_token`/`add_eos_token` in tokenizer_config.json are honoured the way transformers
    does: the special token is added or removed whatever tokenizer.json's post-processor says.
    """

    def __init__(self, folder: Path):
        import json

        from tokenizers import Tokenizer

        self.folder = Path(folder)
        self.tok = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        cfg_path = self.folder / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        map_path = self.folder / "special_tokens_map.json"  # older folders name their special tokens there
        self.config = {**(json.loads(map_path.read_text()) if map_path.is_file() else {}), **self.config}
        self.chat_template = self.config.get("chat_template")
        if self.chat_template is None and (self.folder / "chat_template.jinja").is_file():
            self.chat_template = (self.folder / "chat_template.jinja").read_text()

    def _id(self, key: str) -> int | None:
        text = _token_text(self.config.get(key))
        return self.tok.token_to_id(text) if text else None

    @property
    def pad_token_id(self) -> int | None:
        """Id of the pad token, if the config names one."""
        return self._id("pad_token")

    @property
    def eos_token_id(self) -> int | None:
        """Id of the end-of-sequence token, if the config names one."""
        return self._id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        """Id of the beginning-of-sequence token, if the config names one."""
        return self._id("bos_token")

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, special tokens added as the tokenizer's config says."""
        ids = self.tok.encode(text).ids
        bos, eos = self.bos_token_id, self.eos_token_id
        add_bos, add_eos = self.config.get("add_bos_token"), self.config.get("add_eos_token")
        if bos is not None and add_bos is not None:
            has = bool(ids) and ids[0] == bos
            ids = [bos] + ids if add_bos and not has else (ids[1:] if not add_bos and has else ids)
        if eos is not None and add_eos is not None:
            has = bool(ids) and ids[-1] == eos
            ids = ids + [eos] if add_eos and not has else (ids[:-1] if not add_eos and has else ids)
        return ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        """{"input_ids": ids} like a Hugging Face tokenizer; no BOS/EOS with add_special_tokens=False."""
        ids = self.encode(text) if add_special_tokens else self.tok.encode(text, add_special_tokens=False).ids
        return {"input_ids": ids}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of `ids`."""
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def special_tokens(self) -> dict[str, str]:
        """The named special tokens as text (bos_token, eos_token, ...), as a chat template sees them."""
        found = {key: _token_text(self.config.get(key)) for key in chat_template.SPECIAL_TOKENS}
        return {key: text for key, text in found.items() if text is not None}

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True) -> list[int] | str:
        """`messages` under the chat template: token ids (special tokens only where the template writes them), or
        the text with `tokenize=False`. Raises ChatTemplateError when the template refuses the messages."""
        text = chat_template.render(self.chat_template, messages, add_generation_prompt, self.special_tokens)
        return self.tok.encode(text, add_special_tokens=False).ids if tokenize else text


def template_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """The token ids of `messages` under the tokenizer's chat template (FastTokenizer or transformers'). Raises
    BrokenChatTemplateError when the template does not parse, ChatTemplateError when it refuses the messages."""
    from jinja2.exceptions import TemplateError, TemplateSyntaxError

    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    except TemplateSyntaxError as e:  # transformers' tokenizers raise jinja's own errors
        raise chat_template.BrokenChatTemplateError(chat_template.broken(e)) from e
    except TemplateError as e:
        raise chat_template.ChatTemplateError(str(e)) from e
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def encode_prompts(tokenizer, prompts: list[str], chat: bool) -> list[list[int]]:
    """Token ids per prompt; with `chat`, each prompt becomes a user turn under the chat template."""
    out = []
    for p in prompts:
        if not chat:
            out.append(list(tokenizer(p)["input_ids"]))
            continue
        if not getattr(tokenizer, "chat_template", None):
            raise ModelConfigError("--chat needs a chat template, and this model's tokenizer has none; drop --chat")
        try:
            out.append(template_ids(tokenizer, [{"role": "user", "content": p}], True))
        except chat_template.BrokenChatTemplateError as e:
            raise ModelConfigError(f"{e}, or drop --chat") from e
        except chat_template.ChatTemplateError as e:
            raise ModelConfigError(f"the chat template refused prompt {len(out) + 1}: {e}; drop --chat, or give "
                                   "the model a template that takes one user turn") from e
    return out


def pad_id(tokenizer) -> int:
    """A token id to pad with (never attended to): pad, else eos, else 0."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


class StreamDecoder:
    """Turns a growing list of token ids into newly completed text, without splitting characters."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.printed = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final (may be empty)."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an unfinished multi-byte character: wait for the next token
            return ""
        new, self.printed = text[self.printed:], len(text)
        return new

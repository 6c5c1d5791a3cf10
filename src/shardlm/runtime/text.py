"""Tokenizer side of generation (driver only): encode prompts, apply the chat template, stream text."""

from __future__ import annotations

from pathlib import Path

from shardlm.models.args import ModelConfigError


def load_tokenizer(folder: Path):
    """The Hugging Face fast tokenizer stored beside the weights."""
    from transformers import AutoTokenizer  # imported lazily: only the driver needs it

    folder = Path(folder)
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ModelConfigError(
            f"{folder} has no tokenizer files (tokenizer.json, tokenizer.model or vocab.json); copy the "
            "tokenizer of the model into that folder"
        )
    return AutoTokenizer.from_pretrained(str(folder))


def encode_prompts(tokenizer, prompts: list[str], chat: bool) -> list[list[int]]:
    """Token ids per prompt; with `chat`, each prompt becomes a user turn under the chat template."""
    out = []
    for p in prompts:
        if chat:
            if not getattr(tokenizer, "chat_template", None):
                raise ModelConfigError("--chat needs a chat template, and this model's tokenizer has none; drop --chat")
            ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(p)["input_ids"]
        out.append(list(ids))
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

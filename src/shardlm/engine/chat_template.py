"""A model's chat template rendered the way transformers renders it, with jinja2 alone.

`apply_chat_template` through transformers cost 4 s a process on the development VM (importing transformers and
torch to build an AutoTokenizer), which every `generate --chat` and a server's first chat call paid; jinja2 imports
in 0.07 s. The environment matches transformers' (chat_template_utils): a sandbox that cannot change its inputs,
`trim_blocks` and `lstrip_blocks`, loop controls, a `{% generation %}` block that renders its body, `tojson` without
HTML escaping, `raise_exception`, `strftime_now`, and namespaces that refuse underscore-prefixed names. The template
sees `messages`, `add_generation_prompt` and the tokenizer's named special tokens (`bos_token`, `eos_token`, ...);
its text is then tokenized without adding special tokens. tests/unit/test_chat_template.py holds the ids against
transformers' on the bundled template and on templates that use each of these.
"""

from __future__ import annotations

import datetime
import functools
import json

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The named special tokens a template sees as variables (transformers' special_tokens_map)."""


class ChatTemplateError(ValueError):
    """The template refused the conversation (its `raise_exception`) or could not be rendered."""


class BrokenChatTemplateError(ChatTemplateError):
    """The template itself does not parse: the model folder's fault, not the conversation's."""


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compiled(template: str):
    """`template` compiled in the sandboxed environment described above (cached per template text)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (marks the assistant's part for training masks): its body."""

        tags = {"generation"}

        def parse(self, parser):
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(line)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """jinja's namespace() that refuses underscore-prefixed names (a way out of the sandbox)."""

        def __init__(*args, **kwargs):  # jinja's own signature: `self` may be a keyword of the namespace
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace.check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not store {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=Namespace,
                       dict=lambda *args, **kwargs: dict(*args, **kwargs))
    return env.from_string(template)


def problem(template: str) -> str | None:
    """Why `template` cannot be used (it does not parse), else None: for a server to say so when it starts."""
    import jinja2

    try:
        compiled(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        return broken(e)
    return None


def broken(e) -> str:
    """What to say about a template that does not parse (a jinja2 TemplateSyntaxError)."""
    return (f"the model's chat template does not parse (line {e.lineno}: {e.message}); fix chat_template in the "
            "model folder's tokenizer_config.json (or chat_template.jinja)")


def render(template: str, messages: list[dict], add_generation_prompt: bool, special: dict[str, str]) -> str:
    """The text of `messages` ([{"role", "content"}, ...]) under `template`, given the tokenizer's named special
    tokens `special`. Raises ChatTemplateError with the template's own message when it refuses them, and
    BrokenChatTemplateError when the template does not parse."""
    import jinja2

    try:
        program = compiled(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise BrokenChatTemplateError(broken(e)) from e
    try:
        return program.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                              add_generation_prompt=add_generation_prompt, **special)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(str(e)) from e

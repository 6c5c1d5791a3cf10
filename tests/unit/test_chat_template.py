"""Chat templates rendered with jinja2 alone (engine/chat_template.py) give transformers' apply_chat_template ids,
on the bundled model's template and on templates that use what transformers' environment adds."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import bundled_copy

from shardlm.engine.chat_template import ChatTemplateError
from shardlm.engine.text import FastTokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Name a colour."}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Où est la gare ? 🚉"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "  spaces\tand\nnewlines  "}],
    [{"role": "user", "content": ""}],
]

# roles must alternate (raise_exception), a namespace carried across the loop, loop controls, tojson without HTML
# escapes and with non-ASCII text, dict(), the special tokens as variables, indented block tags (trim/lstrip)
STRICT = """{{ bos_token }}{% set ns = namespace(turn=0, system='') %}
{% for m in messages %}
    {% if m['role'] == 'system' %}{% set ns.system = m['content'] %}{% continue %}{% endif %}
    {% if (m['role'] == 'user') != (ns.turn % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% set ns.turn = ns.turn + 1 %}
    {% set meta = dict(n=ns.turn, role=m['role']) %}
[{{ meta | tojson }}|{{ ns.system | tojson }}] {{ m['content'] | trim }}{{ eos_token }}
    {% if ns.turn > 5 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}<assistant> {{ strftime_now('%Y') | length }}{% endif %}"""

# the {% generation %} block that marks the assistant's part (transformers' assistant masks)
GENERATION = """{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}A: {{ m['content'] }}\
{{ eos_token }}{% endgeneration %}{% else %}{{ m['role'] }}: {{ m['content'] }}
{% endif %}{% endfor %}{% if add_generation_prompt %}A:{% endif %}"""


def _folder(tmp_path, bundled_dir, template: str | None):
    """A tokenizer folder: the bundled tokenizer with `template` (None: the bundled one)."""
    return bundled_copy(bundled_dir, tmp_path / "tok", template)


def _transformers_ids(folder, messages, add_generation_prompt):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("template", [None, STRICT, GENERATION], ids=["bundled", "strict", "generation"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_ids_equal_transformers(template, add_generation_prompt, tmp_path, bundled_dir):
    folder = _folder(tmp_path, bundled_dir, template)
    ours = FastTokenizer(folder)
    for messages in CONVERSATIONS:
        expect = _transformers_ids(folder, messages, add_generation_prompt)
        assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expect, messages
    if template is not None:  # the template's text itself, beside its ids
        text = ours.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True, tokenize=False)
        assert "Où est la gare ? 🚉" in text and "\\u" not in text


def test_a_template_that_refuses_the_roles_says_why(tmp_path, bundled_dir):
    ours = FastTokenizer(_folder(tmp_path, bundled_dir, STRICT))
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        ours.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_a_namespace_refuses_underscore_names(tmp_path, bundled_dir):
    template = "{% set ns = namespace(a=1) %}{% set ns._hidden = 2 %}{{ ns.a }}"
    ours = FastTokenizer(_folder(tmp_path, bundled_dir, template))
    with pytest.raises(ChatTemplateError, match="_hidden"):
        ours.apply_chat_template(CONVERSATIONS[0])
    ours = FastTokenizer(_folder(tmp_path / "b", bundled_dir, "{% set ns = namespace(_x=1) %}x"))
    with pytest.raises(ChatTemplateError, match="_x"):
        ours.apply_chat_template(CONVERSATIONS[0])


def test_the_sandbox_keeps_templates_from_python_internals(tmp_path, bundled_dir):
    template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ChatTemplateError):
        FastTokenizer(_folder(tmp_path, bundled_dir, template)).apply_chat_template(CONVERSATIONS[0])


def test_rendering_imports_neither_transformers_nor_torch(bundled_dir):
    code = ("import sys; from shardlm.engine.text import load_tokenizer; "
            f"t = load_tokenizer({str(bundled_dir)!r}); "
            "ids = t.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True); "
            "assert ids, ids; print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_the_server_answers_a_refused_conversation_with_a_400(tmp_path, bundled_dir):
    from shardlm.serve.chat import chat_ids
    from shardlm.serve.errors import ApiError
    from shardlm.serve.schemas import ChatRequest

    ours = FastTokenizer(_folder(tmp_path, bundled_dir, STRICT))
    good = ChatRequest(model="m", messages=[{"role": "user", "content": "a"}])
    assert chat_ids(good, ours) == ours.apply_chat_template([{"role": "user", "content": "a"}], True)
    bad = ChatRequest(model="m", messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ApiError) as e:
        chat_ids(bad, ours)
    assert e.value.status == 400 and e.value.param == "messages" and "must alternate" in e.value.message


def test_a_template_that_does_not_parse_is_the_model_folders_fault(tmp_path, bundled_dir):
    from shardlm.engine.chat_template import BrokenChatTemplateError
    from shardlm.serve.chat import chat_ids
    from shardlm.serve.errors import ApiError
    from shardlm.serve.schemas import ChatRequest

    folder = _folder(tmp_path, bundled_dir, "{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    with pytest.raises(BrokenChatTemplateError, match=r"does not parse \(line 2: .*tokenizer_config.json"):
        FastTokenizer(folder).apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(ApiError) as e:  # a server error, not the request's
        chat_ids(ChatRequest(model="m", messages=[{"role": "user", "content": "a"}]), FastTokenizer(folder))
    assert e.value.status == 500 and "does not parse" in e.value.message
    folder = bundled_copy(bundled_dir, tmp_path / "model", "{% for m in messages %}\n{{ m['content'] }\n{% endfor %}",
                          weights=True)
    res = subprocess.run([sys.executable, "-m", "shardlm", "generate", "hi", "--chat", "--model", str(folder),
                          "--max-new-tokens", "1"], capture_output=True, text=True, timeout=180)
    assert res.returncode == 2 and "does not parse (line 2" in res.stderr and "drop --chat" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_transformers_tokenizers_raise_the_same_errors(tmp_path, bundled_dir):
    """Folders without tokenizer.json go through AutoTokenizer: its jinja errors map to the same two errors."""
    from transformers import AutoTokenizer

    from shardlm.engine.chat_template import BrokenChatTemplateError
    from shardlm.engine.text import template_ids

    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    strict = AutoTokenizer.from_pretrained(str(_folder(tmp_path / "s", bundled_dir, STRICT)))
    assert template_ids(strict, messages[:1], True) == FastTokenizer(tmp_path / "s" / "tok").apply_chat_template(
        messages[:1], True)
    with pytest.raises(ChatTemplateError, match="must alternate"):
        template_ids(strict, messages, True)
    broken = AutoTokenizer.from_pretrained(str(_folder(tmp_path / "b", bundled_dir, "{{ messages }")))
    with pytest.raises(BrokenChatTemplateError, match=r"does not parse \(line 1"):
        template_ids(broken, messages, True)

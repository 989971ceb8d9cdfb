"""Chat templates: SmolLM2's own template rendered as transformers renders it (text and ids, no
double BOS), transformers' template helpers, and the sandbox."""

from __future__ import annotations

import pytest

from freetoken.chat_template import BadChatTemplate, ChatTemplateError, render_chat_template
from freetoken.errors import FreeTokenError, InvalidRequest
from freetoken.tokenizer import Tokenizer

CONVERSATIONS = {
    "system+user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "user only": [{"role": "user", "content": "Hello! 😀 你好"}],
    "multi-turn": [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": 'Write 42 in JSON: {"n": 42}'},
    ],
    "markers in content": [{"role": "user", "content": "say <|im_end|> literally\n\n"}],
    "none content": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "tool_calls": None},
    ],
}


@pytest.fixture(scope="module")
def tok(smollm2_path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path)


@pytest.fixture(scope="module")
def hf_tok(smollm2_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name
    )


@pytest.mark.real_model
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_smollm2_template_matches_transformers(tok, hf_tok, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    ids = tok.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    assert ids == hf_tok.apply_chat_template(
        messages, tokenize=True, return_dict=False, add_generation_prompt=add_generation_prompt
    )
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids[1] != 1  # <|im_start|> (also SmolLM2's BOS) once, never twice
    assert text.endswith("<|im_start|>assistant\n") is add_generation_prompt


@pytest.mark.real_model
def test_smollm2_default_system_prompt(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
        "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


BOS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)


def test_bos_rendered_by_the_template_only(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {
        "<s>": 0,
        "</s>": 1,
        **{c: i + 2 for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
    }
    hf = HFTokenizer(models.BPE(vocab, []))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<s>", "</s>"])
    tok = Tokenizer(
        hf,
        byte_level=True,
        bos_token_id=0,
        eos_token_id=1,
        add_bos_token=True,
        chat_template=BOS_TEMPLATE,
    )
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages)
    assert text == "<s>[user] hi</s>[assistant] "
    ids = tok.encode_chat(messages)
    assert ids.count(0) == 1 and ids[0] == 0
    assert tok.encode(text)[:2] == [0, 0]  # why chat text is encoded without special tokens


def test_trim_and_lstrip_blocks_like_transformers():
    template = (
        "{% for m in messages %}\n    {% if m['role'] == 'user' %}\n"
        "U:{{ m['content'] }}\n    {% endif %}\n{% endfor %}"
    )
    assert render_chat_template(template, [{"role": "user", "content": "x"}]) == "U:x\n"


def test_helpers_tojson_strftime_namespace_loopcontrols():
    template = (
        "{{ messages[0] | tojson }}|{{ tools | tojson(indent=None, sort_keys=True) }}|"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 1 %}"
        "{% break %}{% endif %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|"
        "{{ strftime_now('%Y') | length }}|{{ dict(a=1) }}|{{ enable_thinking }}|"
        "{% generation %}g{% endgeneration %}"
    )
    out = render_chat_template(
        template,
        [{"role": "user", "content": "é<b>"}, {"role": "x"}],
        tools=[{"b": 1, "a": "<"}],
        enable_thinking=False,
    )
    assert out == (
        '{"role": "user", "content": "é<b>"}|[{"a": "<", "b": 1}]|1|4|{\'a\': 1}|False|g'
    )


def test_raise_exception_is_a_400_naming_messages():
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('roles!') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match="roles!") as info:
        render_chat_template(template, [{"role": "assistant", "content": "x"}])
    assert isinstance(info.value, InvalidRequest) and info.value.param == "messages"
    assert info.value.status == 400


def test_no_template_is_a_400():
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat_template(None, [{"role": "user", "content": "x"}])


def test_template_failing_on_content_is_a_400():
    with pytest.raises(ChatTemplateError, match="TypeError"):
        render_chat_template(
            "{{ 'x' + messages[0]['content'] }}",
            [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
        )


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__ }}",
        "{% if ''.__class__ %}x{% endif %}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ raise_exception.__globals__ }}",
        "{{ cycler.__init__.__globals__.os }}",
        "{{ (messages|first).pop() }}",  # the immutable sandbox: no mutating the caller's data
        "{% set ns = namespace(_x=1) %}",
    ],
)
def test_sandbox_refuses_escapes(template):
    with pytest.raises((BadChatTemplate, ChatTemplateError)) as info:
        render_chat_template(template, [{"role": "user", "content": "x"}])
    assert "unsafe" in str(info.value) or "underscore" in str(info.value)
    assert isinstance(info.value, FreeTokenError)


def test_attribute_escape_message_is_clear():
    with pytest.raises(BadChatTemplate) as info:
        render_chat_template("{{ ''.__class__.__mro__ }}", [])
    assert str(info.value) == (
        "the chat template was stopped by the sandbox: access to "
        "attribute '__class__' of 'str' object is unsafe"
    )
    assert info.value.status == 500


def test_syntax_error_names_the_line():
    with pytest.raises(BadChatTemplate, match="does not compile.*line 2"):
        render_chat_template("ok\n{% for %}", [])


# Templates in the shapes real checkpoints ship (Llama 3.1 tools + date, Qwen2.5 tool calls,
# Mistral role alternation, Gemma's system refusal), rendered by us and by transformers.
LLAMA3_LIKE = """{{- bos_token }}
{%- set date_string = strftime_now("%d %b %Y") %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'
        + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN25_LIKE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
    {%- else %}{{- 'You are Qwen.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=0) %}
{%- for message in messages %}
    {%- if message.role == "user" %}{%- set ns.last_user = loop.index0 %}{%- endif %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls | default([]) %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}
            {{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "tool" %}
            {{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}
            {{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
{{- '' if ns.last_user >= 0 else raise_exception('no user') }}
"""

MISTRAL_LIKE = """{{ bos_token }}{% for message in messages %}
{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{% endif %}
{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}
{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}
{% endif %}{% endfor %}"""

GEMMA_LIKE = """{{ bos_token }}{% if messages[0]['role'] == 'system' %}
{{ raise_exception('System role not supported') }}{% endif %}
{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant'
else message['role'] %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim
+ '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}
{% endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather «now»",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_CHAT = [
    {"role": "system", "content": "  Be brief.  "},
    {"role": "user", "content": "Weather in Paris? <b>é</b>"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "content": "18°C"},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "18°C and sunny."},
    {"role": "user", "content": "Thanks!"},
]
ALTERNATING = [
    {"role": "user", "content": "a"},
    {"role": "assistant", "content": "b"},
    {"role": "user", "content": " c "},
]


@pytest.mark.real_model
@pytest.mark.parametrize(
    ("template", "messages", "tools"),
    [
        (LLAMA3_LIKE, TOOL_CHAT[:2], TOOLS),
        (LLAMA3_LIKE, ALTERNATING, None),
        (QWEN25_LIKE, TOOL_CHAT, TOOLS),
        (QWEN25_LIKE, ALTERNATING, None),
        (MISTRAL_LIKE, ALTERNATING, None),
        (GEMMA_LIKE, ALTERNATING, None),
    ],
    ids=["llama3-tools", "llama3", "qwen25-tools", "qwen25", "mistral", "gemma"],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_real_world_template_shapes_match_transformers(
    tok, hf_tok, template, messages, tools, add_generation_prompt
):
    kw = dict(add_generation_prompt=add_generation_prompt, chat_template=template)
    if tools is not None:
        kw["tools"] = tools
    ours = tok.apply_chat_template(messages, **kw)
    assert ours == hf_tok.apply_chat_template(messages, tokenize=False, **kw)
    assert tok.encode_chat(messages, **kw) == hf_tok.apply_chat_template(
        messages, tokenize=True, return_dict=False, **kw
    )


@pytest.mark.real_model
@pytest.mark.parametrize(
    ("template", "messages", "match"),
    [
        (MISTRAL_LIKE, ALTERNATING[1:], "roles must alternate"),
        (GEMMA_LIKE, TOOL_CHAT, "System role not supported"),
    ],
)
def test_real_world_template_refusals(tok, hf_tok, template, messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        tok.apply_chat_template(messages, chat_template=template)
    with pytest.raises(Exception, match=match):
        hf_tok.apply_chat_template(messages, chat_template=template, tokenize=False)

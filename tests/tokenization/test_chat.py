"""Chat templates rendered as transformers' ``apply_chat_template`` renders them (text and ids), on templates in the
styles of the published families (ChatML with tools, Llama 3 with a date and loop controls, Mistral's alternation
check through a namespace, Gemma's role map, a documents template with a ``{% generation %}`` block); saved and
loaded both ways; hostile templates stopped by the sandbox."""

from __future__ import annotations

import json
import re

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tokenization import Tokenizer, train_byte_level_bpe
from tokenization.chat import render_chat

from .chat_templates import PUBLISHED

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>", "[INST]", "[/INST]",
            "<start_of_turn>", "<end_of_turn>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<think>", "</think>"]

CHATML = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- "# Tools\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}{% continue %}{% endif %}
{%- if message.tool_calls is defined %}
{{- '<|im_start|>assistant' }}
{%- for call in message.tool_calls %}
{{- '\\n<tool_call>\\n' + call.function | tojson + '\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

LLAMA3 = """{{- bos_token }}
{%- set date_string = strftime_now("%d %b %Y") %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception("unknown role " + message.role) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- if loop.index > 50 %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

MISTRAL = """{%- set ns = namespace(turn='user') %}
{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] != ns.turn %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {{- '[INST] ' + message['content'] + ' [/INST]' }}
        {%- set ns.turn = 'assistant' %}
    {%- else %}
        {{- message['content'] + eos_token }}
        {%- set ns.turn = 'user' %}
    {%- endif %}
{%- endfor %}
"""

GEMMA = """{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' else \
message['role'] %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}\
{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"""

DOCUMENTS = """{%- set info = dict(count=documents | length if documents else 0) %}
{%- if documents %}
<documents>
{%- for doc in documents %}
Document {{ loop.index0 }}: {{ doc.title }}
{{ doc.text }}
{%- endfor %}
</documents> ({{ info.count }})
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{% generation %}ASSISTANT: {{ message.content }}{{ eos_token }}{% endgeneration %}
{%- else %}
{{ message.role | upper }}: {{ message.content }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
ASSISTANT:{% endif %}"""

TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "mistral": MISTRAL, "gemma": GEMMA, "documents": DOCUMENTS,
             **{f"published-{name}": template for name, template in PUBLISHED.items()}}

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city — «now»",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
DOCS = [{"title": "Zürich", "text": "Die Stadt liegt am See."}, {"title": "B", "text": "<b>bold</b> & \"quoted\""}]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there!"}],
    [{"role": "system", "content": "  Be terse.  "}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "Wie geht's? 你好 🙂"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "get_weather",
                                                                          "arguments": {"city": "Paris"}}}]},
     {"role": "user", "content": "thanks"}],
    [{"role": "user", "content": "Finish this: the quick brown"}, {"role": "assistant", "content": "fox jumps"}],
    [{"role": "user", "content": "Think first: 17 * 3?"},
     {"role": "assistant", "content": "\n51", "reasoning_content": "\n17 * 3 = 51\n"}],
]


@pytest.fixture(scope="module")
def pair() -> tuple[Tokenizer, PreTrainedTokenizerFast]:
    """The zoo's tokenizer and transformers' on the same tokenizer.json and special tokens."""
    corpus = ["Hello there, the quick brown fox jumps over the lazy dog. Wie geht's? 2+2=4"] * 4
    base = train_byte_level_bpe(corpus, vocab_size=320, min_frequency=1)
    base.backend.add_special_tokens(SPECIALS)
    ours = Tokenizer(base.backend, {"bos": "<s>", "eos": "</s>", "pad": "<|endoftext|>", "unk": None, "mask": None})
    theirs = PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_str(base.to_str()),
                                     bos_token="<s>", eos_token="</s>", pad_token="<|endoftext|>")
    return ours, theirs


def both(pair, template: str, messages: list, **kwargs) -> tuple:
    ours, theirs = pair
    mine = [ours.apply_chat_template(messages, chat_template=template, tokenize=t, **kwargs) for t in (False, True)]
    ref = [theirs.apply_chat_template(messages, chat_template=template, tokenize=t, **kwargs) for t in (False, True)]
    if not isinstance(ref[1], list):  # transformers 5 returns a BatchEncoding when tokenizing
        ref[1] = ref[1]["input_ids"]
    return mine, ref


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("generation", ["none", "prompt", "continue"])
def test_text_and_ids_equal_transformers(pair, name: str, conversation: int, generation: str) -> None:
    messages = CONVERSATIONS[conversation]
    kwargs = {"add_generation_prompt": generation == "prompt", "continue_final_message": generation == "continue"}
    if name in ("chatml", "published-qwen3") and conversation == 1:
        kwargs["tools"] = TOOLS
    if name == "published-qwen3" and conversation == 0:
        kwargs["enable_thinking"] = False
    if name == "documents":
        kwargs["documents"] = DOCS
    try:
        _, theirs = pair
        theirs.apply_chat_template(messages, chat_template=TEMPLATES[name], tokenize=False, **kwargs)
    except Exception as err:  # noqa: BLE001 - the template refuses this conversation: so must the zoo
        with pytest.raises(ValueError, match=re.escape(str(err).split("\n")[0][:40])):
            pair[0].apply_chat_template(messages, chat_template=TEMPLATES[name], **kwargs)
        return
    mine, ref = both(pair, TEMPLATES[name], messages, **kwargs)
    assert mine[0] == ref[0]
    assert mine[1] == ref[1]
    assert len(mine[0]) > 20


def test_the_refusals_are_exercised(pair) -> None:
    # Mistral's template refuses a system message; llama3's an unknown role; continuing needs a string content.
    with pytest.raises(ValueError, match="Conversation roles must alternate"):
        pair[0].apply_chat_template(CONVERSATIONS[1], chat_template=MISTRAL)
    with pytest.raises(ValueError, match="the chat template raised: unknown role critic"):
        pair[0].apply_chat_template([{"role": "critic", "content": "x"}], chat_template=LLAMA3)
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt are exclusive"):
        pair[0].apply_chat_template(CONVERSATIONS[0], chat_template=CHATML, add_generation_prompt=True,
                                    continue_final_message=True)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=30), min_size=1,
                max_size=4))
def test_any_message_text_renders_as_transformers_renders_it(pair, texts: list[str]) -> None:
    messages = [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(texts)]
    for template in (CHATML, GEMMA):
        mine, ref = both(pair, template, messages, add_generation_prompt=True)
        assert mine == ref


def test_the_template_is_saved_loaded_and_read_by_transformers(pair, tmp_path) -> None:
    ours, _ = pair
    ours.chat_template = CHATML
    try:
        ours.save(tmp_path / "tokenizer.json")
    finally:
        ours.chat_template = None
    assert (tmp_path / "chat_template.jinja").read_text() == CHATML
    loaded = Tokenizer.from_file(tmp_path / "tokenizer.json")
    hf = AutoTokenizer.from_pretrained(tmp_path)
    messages = CONVERSATIONS[1]
    assert loaded.chat_template == CHATML == hf.chat_template
    ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    assert loaded.apply_chat_template(messages, add_generation_prompt=True) == ids


def test_a_template_from_tokenizer_config_json_is_read(pair, tmp_path) -> None:
    ours, _ = pair
    ours.save(tmp_path / "tokenizer.json")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": GEMMA}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_file(tmp_path / "tokenizer.json").chat_template == GEMMA
    config["chat_template"] = 42
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="must be a string or a list of"):
        Tokenizer.from_file(tmp_path / "tokenizer.json")


@pytest.mark.parametrize(("template", "message"), [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "broke the sandbox"),
    ("{{ messages.append(1) }}", "broke the sandbox"),  # immutable: no mutation of the caller's data
    ("{% set ns = namespace(__class__=1) %}", "broke the sandbox"),
    ("{{ cycler.__init__.__globals__ }}", "broke the sandbox"),
    ("{% for x in messages %}", "does not parse"),
])
def test_hostile_or_broken_templates_are_value_errors(template: str, message: str) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=message):
        render_chat(template, messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_bad_arguments_are_named(pair) -> None:
    ours, _ = pair
    with pytest.raises(ValueError, match="this tokenizer has no chat template"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match=r"messages must be a non-empty list"):
        render_chat(GEMMA, [])
    with pytest.raises(ValueError, match=r"messages\[1\] must be a dict with a string 'role'"):
        render_chat(GEMMA, [{"role": "user", "content": "a"}, {"content": "b"}])
    with pytest.raises(ValueError, match="tools must be a list of dicts"):
        render_chat(CHATML, [{"role": "user", "content": "a"}], tools=["get_weather"])

"""The model's own chat format (megatrain_min/data/chat.py, data.py, train.py --chat-format) against transformers'
apply_chat_template, the oracle.

Four chat templates are written below as faithful copies of the published ones (test data): Llama 3.2
Instruct (system header with today's date via strftime_now, trims contents), Qwen2.5 Instruct (ChatML),
Qwen3 (drops the <think> block of answers before the last question, adds an empty one to the last answer)
and Mistral 7B Instruct v0.3 (SentencePiece-style tokenizer, "[INST] ... [/INST]", moves the system message
into the last user turn). For each, a tiny BPE tokenizer with the family's special tokens is trained here;
nothing is downloaded. Checked, token for token:
* chat_tokens' ids == AutoTokenizer.apply_chat_template(messages, tokenize=True)["input_ids"];
* each run of supervised tokens decodes to one answer as the template renders it + its end-of-turn
  marker, written out by hand below; nothing else is supervised;
* the mask equals transformers' own return_assistant_tokens_mask for a {% generation %}-marked ChatML;
* train.py trains on exactly these ids (its val loss equals our loss on them), and transformers'
  generation prompt from the exported directory is a prefix of the training rendering.
"""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import model
from conftest import ROOT, make_bpe_tokenizer, train_py
from megatrain_min import data
from megatrain_min.data import chat
from megatrain_min.hf.load import load_hf
from megatrain_min.data.tokenizer import HFTokenizer, load_template

pytestmark = pytest.mark.slow   # the whole module: `python -m pytest -m "not slow"` leaves it out

transformers = pytest.importorskip("transformers")

# ----------------------------------------------------------------------------- the published templates
LLAMA32 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

MISTRAL_V03 = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

# ----------------------------------------------------------------------------- conversations (non-ASCII on purpose)
A1, A2 = "Tōkyō (東京) — the capital.  ", "  Séoul, 서울.\n"          # whitespace a template may trim
CONVERSATIONS = {
    "single": [{"role": "user", "content": "Wie spät ist es? ¿Qué hora es?"},
               {"role": "assistant", "content": "Es ist zwölf Uhr — mediodía 🕛."}],
    "system-multi": [{"role": "system", "content": "Réponds brièvement."},
                     {"role": "user", "content": "Capitale du Japon ?"},
                     {"role": "assistant", "content": A1},
                     {"role": "user", "content": "Et de la Corée ?"},
                     {"role": "assistant", "content": A2}],
    "think": [{"role": "user", "content": "2 + 2 ?"},
              {"role": "assistant", "content": "<think>\nZwei plus zwei… ünïcode.\n</think>\n\nVier."},
              {"role": "user", "content": "Und 3 + 3?"},
              {"role": "assistant", "content": "<think>\nDrei plus drei.\n</think>\n\nSechs."}],
}
EXPECTED = {  # per family and conversation: each supervised run, decoded; written out from the templates by hand
    "llama3": {"single": ["Es ist zwölf Uhr — mediodía 🕛.<|eot_id|>"],
               "system-multi": ["Tōkyō (東京) — the capital.<|eot_id|>", "Séoul, 서울.<|eot_id|>"],
               "think": ["<think>\nZwei plus zwei… ünïcode.\n</think>\n\nVier.<|eot_id|>",
                         "<think>\nDrei plus drei.\n</think>\n\nSechs.<|eot_id|>"]},
    "qwen2.5": {"single": ["Es ist zwölf Uhr — mediodía 🕛.<|im_end|>"],
                "system-multi": [A1 + "<|im_end|>", A2 + "<|im_end|>"],
                "think": ["<think>\nZwei plus zwei… ünïcode.\n</think>\n\nVier.<|im_end|>",
                          "<think>\nDrei plus drei.\n</think>\n\nSechs.<|im_end|>"]},
    "qwen3": {"single": ["<think>\n\n</think>\n\nEs ist zwölf Uhr — mediodía 🕛.<|im_end|>"],
              "system-multi": [A1 + "<|im_end|>", "<think>\n\n</think>\n\n" + A2 + "<|im_end|>"],
              "think": ["Vier.<|im_end|>",                                    # the earlier <think> is dropped
                        "<think>\nDrei plus drei.\n</think>\n\nSechs.<|im_end|>"]},
    "mistral": {"single": ["Es ist zwölf Uhr — mediodía 🕛.</s>"],          # " " + answer: the "▁" decodes away
                "system-multi": ["Tōkyō (東京) — the capital.</s>", "Séoul, 서울.</s>"],
                "think": ["<think>\nZwei plus zwei… ünïcode.\n</think>\n\nVier.</s>",
                          "<think>\nDrei plus drei.\n</think>\n\nSechs.</s>"]},
}
FAMILIES = {  # template, special tokens (first = unk for SentencePiece-style), tokenizer_config, model_type
    "llama3": (LLAMA32, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                         "<|eot_id|>"], {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                                         "tokenizer_class": "PreTrainedTokenizerFast"}, "llama"),
    "qwen2.5": (QWEN25, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                 "tokenizer_class": "Qwen2Tokenizer"}, "qwen2"),
    "qwen3": (QWEN3, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
              {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
               "tokenizer_class": "Qwen2Tokenizer"}, "qwen3"),
    "mistral": (MISTRAL_V03, ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                              "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
                {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
                 "tokenizer_class": "LlamaTokenizer"}, "mistral"),
}


def texts():
    """What the tokenizers are trained on: every conversation and the templates' words."""
    out = [m["content"] for conv in CONVERSATIONS.values() for m in conv]
    return out + ["system user assistant Cutting Knowledge Date: December 2023\nToday Date: 0123456789 "
                  "JanFebMarAprMayJunJulAugSepOctNovDec You are Qwen, created by Alibaba Cloud. "
                  "You are a helpful assistant. What is the capital of France? Paris."] * 3


def make_dir(d, family, template_file=False):
    template, specials, conf, model_type = FAMILIES[family]
    conf = dict(conf) if template_file else {**conf, "chat_template": template}
    style = {"llama3": "llama3", "mistral": "sentencepiece"}.get(family, "qwen2")
    make_bpe_tokenizer(d, texts(), 600, specials, conf, style=style,
                       added_tokens=["<think>", "</think>"] if family == "qwen3" else ())
    if template_file:
        (d / "chat_template.jinja").write_text(template)
    (d / "config.json").write_text(json.dumps({"model_type": model_type}))
    return d


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return {f: make_dir(tmp_path_factory.mktemp(f), f) for f in FAMILIES}


def theirs(d, messages, **kw):
    out = transformers.AutoTokenizer.from_pretrained(d).apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def runs(ids, supervised):
    """The supervised tokens as [(start, end)] runs."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], supervised.astype(int), [0]])))
    return list(zip(edges[::2], edges[1::2]))


# ----------------------------------------------------------------------------- ids and masks
@pytest.mark.parametrize("conv", CONVERSATIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_ids_equal_transformers_and_only_answers_are_supervised(dirs, family, conv):
    tok = HFTokenizer(dirs[family])
    messages = CONVERSATIONS[conv]
    ids, sup = data.chat_tokens(tok, messages)
    assert ids.dtype == np.int64 and sup.dtype == bool and ids.shape == sup.shape
    assert ids.tolist() == theirs(dirs[family], messages)                           # token for token
    got = [tok.decode(ids[a:b]) for a, b in runs(ids, sup)]
    print(f"{family}/{conv}: {len(ids)} tokens, supervised {got}")
    assert got == EXPECTED[family][conv]


def test_mask_equals_transformers_generation_markers(dirs):
    """transformers' return_assistant_tokens_mask on the Qwen2.5 template with {% generation %} around each
    answer and its <|im_end|> (the newline after it outside): the same mask as ours on the unmarked template."""
    marked = QWEN25.replace(
        """        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n""",
        """        {%- if message.role == "assistant" %}
            {{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
        {%- endif %}\n""")
    assert marked != QWEN25
    hf_tok = transformers.AutoTokenizer.from_pretrained(dirs["qwen2.5"])
    tok = HFTokenizer(dirs["qwen2.5"])
    for conv in ("single", "system-multi"):
        out = hf_tok.apply_chat_template(CONVERSATIONS[conv], chat_template=marked, tokenize=True,
                                         return_dict=True, return_assistant_tokens_mask=True)
        ids, sup = data.chat_tokens(tok, CONVERSATIONS[conv])
        assert list(out["input_ids"]) == ids.tolist()
        assert list(out["assistant_masks"]) == sup.astype(int).tolist()


def test_template_sources(tmp_path, dirs):
    """chat_template.jinja wins over tokenizer_config.json; a list of named templates gives "default"."""
    d = make_dir(tmp_path, "llama3", template_file=True)
    assert load_template(d) == LLAMA32
    conf = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**conf, "chat_template": "{{ 'ignored' }}"}))
    msgs = CONVERSATIONS["system-multi"]
    assert data.chat_tokens(HFTokenizer(d), msgs)[0].tolist() == theirs(d, msgs)
    (d / "chat_template.jinja").unlink()
    named = [{"name": "tool_use", "template": "{{ 'tools' }}"}, {"name": "default", "template": QWEN25}]
    (d / "tokenizer_config.json").write_text(json.dumps({**conf, "chat_template": named}))
    assert load_template(d) == QWEN25
    (d / "tokenizer_config.json").write_text(json.dumps({**conf, "chat_template": named[:1]}))
    with pytest.raises(chat.ChatTemplateError, match="none named 'default'"):
        load_template(d)
    (d / "tokenizer_config.json").write_text(json.dumps(conf))
    assert HFTokenizer(d).chat_template is None


def test_template_errors_are_one_line_valueerrors(dirs):
    tok = HFTokenizer(dirs["mistral"])
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                 {"role": "assistant", "content": "c"}]
    with pytest.raises(ValueError, match="conversation roles must alternate") as e:
        data.chat_tokens(tok, two_users)                       # the template's raise_exception
    assert "\n" not in str(e.value)
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}{{ messages[0].content }}"  # twice
    with pytest.raises(chat.ChatTemplateError, match=r"messages\[0\]\['content'\] once"):
        data.chat_tokens(tok, CONVERSATIONS["single"])
    with pytest.raises(chat.ChatTemplateError, match="does not compile"):
        chat.render("{% for %}", [], {})


# ----------------------------------------------------------------------------- data.py: .jsonl lines
def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_lines_use_chat_tokens(dirs, tmp_path):
    tok = HFTokenizer(dirs["qwen3"])
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS["think"]}])
    (x, y), = data.load_sft_jsonl(path, tok, seq_len=512)
    ids, sup = data.chat_tokens(tok, CONVERSATIONS["think"])
    assert x.tolist() == ids[:-1].tolist()
    assert y.tolist() == np.where(sup[1:], ids[1:], data.IGNORE).tolist()
    (xf, yf), = data.load_sft_jsonl(path, tok, seq_len=512, chat_format="fixed")   # the old format, on request
    assert tok.decode(xf).startswith("<|user|>\n2 + 2 ?<|im_end|><|assistant|>\n")


def test_prompt_completion_gets_no_second_bos_or_eos(dirs, tmp_path):
    """The documented way to bring any format: render it yourself into prompt/completion. A Llama 3 rendering
    starts with <|begin_of_text|> and may end its completion with <|eot_id|> (= eos): neither is doubled."""
    tok = HFTokenizer(dirs["llama3"])
    conv = CONVERSATIONS["single"]
    prompt = chat.render(LLAMA32, conv[:1], tok.special_tokens, add_generation_prompt=True)
    rows = [{"prompt": prompt, "completion": conv[1]["content"] + "<|eot_id|>"},
            {"prompt": "Hi", "completion": " there"}]
    (x, y), (x2, y2) = data.load_sft_jsonl(write_jsonl(tmp_path / "p.jsonl", rows), tok, seq_len=512)
    ids = np.concatenate([x, y[-1:]])
    assert ids.tolist() == theirs(dirs["llama3"], conv)            # one bos, one eot: the native rendering
    assert tok.decode(y[y != data.IGNORE]) == conv[1]["content"] + "<|eot_id|>"
    assert x2[0] == tok.bos_id and tok.decode(x2[1:]) == "Hi there" and y2[-1] == tok.eos_id


# ----------------------------------------------------------------------------- train.py end to end
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = make_dir(tmp_path_factory.mktemp("llama3-model"), "llama3")
    vocab = HFTokenizer(d).vocab_size
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return d


def train(*args):
    return train_py(*args)


def test_train_on_native_rendering_and_export(llama_dir, tmp_path):
    conv = CONVERSATIONS["system-multi"]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conv}] * 4)
    out, run = tmp_path / "hf-out", tmp_path / "run"
    r = train("--init-from", llama_dir, "--data", path, "--save-hf", out, "--save-hf-dtype", "fp32", "--steps", 1,
              "--batch-size", 2, "--seq-len", 128, "--eval-every", 1, "--eval-batches", 1, "--lr", 0,
              "--weight-decay", 0, "--out", run)
    assert r.returncode == 0, r.stderr
    assert f"chat format: native (the chat_template of {llama_dir})" in r.stdout
    # the engine's val loss (lr 0: the initial weights) is our loss on chat_tokens' ids and mask
    ids, sup = data.chat_tokens(HFTokenizer(llama_dir), conv)
    cfg, w = load_hf(llama_dir)
    x, y = torch.from_numpy(ids[None, :-1]), torch.from_numpy(np.where(sup[1:], ids[1:], model.IGNORE)[None])
    with torch.no_grad():
        want = F.cross_entropy(model.forward(cfg, w, x)[0], y[0], ignore_index=model.IGNORE).item()
    got = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["val_loss"]
    assert abs(got - want) <= 1e-5 * want, (got, want)
    # at inference transformers prompts the exported model with a prefix of what it was trained on
    prompt = theirs(out, conv[:-1], add_generation_prompt=True)
    assert ids[:len(prompt)].tolist() == prompt
    assert sup[len(prompt)] and not sup[len(prompt) - 1]            # the answer starts where the prompt ends


def test_chat_format_flag_and_refusals(llama_dir, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS["single"]}] * 4)
    fast = ["--steps", 1, "--batch-size", 2, "--seq-len", 64, "--eval-batches", 1, "--sample-tokens", 0]
    r = train("--init-from", llama_dir, "--data", path, "--chat-format", "fixed", "--out", tmp_path / "a", *fast)
    assert r.returncode == 0 and "chat format: fixed" in r.stdout, r.stderr
    r = train("--data", path, "--out", tmp_path / "b", *fast)                 # toy preset: bytes, no template
    assert r.returncode == 0, r.stderr
    assert "chat format: fixed ('<|role|>\\n' + content + newline per message; the byte tokenizer has no chat_template)" in r.stdout
    r = train("--data", path, "--chat-format", "native", "--out", tmp_path / "c", *fast)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--chat-format native: the byte tokenizer has no chat_template" in r.stderr
    # a Hugging Face directory without tokenizer.json: text and .jsonl data are refused, .npy token ids are not
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in llama_dir.iterdir():
        if f.name not in ("tokenizer.json", "tokenizer_config.json"):
            (bare / f.name).write_bytes(f.read_bytes())
    for data_file in (path, ROOT / "data" / "tinyshakespeare.txt"):
        r = train("--init-from", bare, "--data", data_file, "--out", tmp_path / "d", *fast)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert f"{bare} has no tokenizer.json" in r.stderr and not (tmp_path / "d").exists()
    np.save(tmp_path / "t.npy", np.arange(2000, dtype=np.uint16) % 100)
    r = train("--init-from", bare, "--data", tmp_path / "t.npy", "--out", tmp_path / "e", *fast)
    assert r.returncode == 0, r.stderr

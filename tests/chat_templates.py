"""Tool-calling chat templates of three model families, for tests with the byte-level tokenizer.

Each follows the structure of the family's real template (where the tools go, how an assistant's
calls and the tools' results are written) with the family's markers as plain text, since the byte
tokenizer has no tokens for them. Each renders an assistant's calls exactly as the model writes
them, so that turn 2's prompt starts with turn 1's prompt plus the model's output and the prefix
cache reuses turn 1. The real Llama 3.1 and Qwen2.5 templates do so already; the real Mistral v0.3
template adds 9-character call ids the model never writes, so here it does not.
"""

from __future__ import annotations

import json
from pathlib import Path

# Llama 3.1 (meta-llama/Llama-3.1-8B-Instruct): tools in the first user message, a call is the whole
# assistant turn ({"name", "parameters"}), results come back in the ipython role; built-in tools use
# <|python_tag|>.
LLAMA_3_1 = """\
{{- bos_token }}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{%- if builtin_tools is defined %}{{- "Tools: " + builtin_tools | join(", ") + "\\n\\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\nToday Date: " + date_string + "\\n\\n" }}
{{- system_message + "<|eot_id|>" }}
{%- if tools_in_user_message and tools is not none %}
    {%- if messages | length == 0 %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {%- set first_user_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
    {{- "<|start_header_id|>user<|end_header_id|>\\n\\n" }}
    {{- "Given the following functions, please respond with a JSON for a function call "
        "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) + "\\n\\n" }}{%- endfor %}
    {{- first_user_message + "<|eot_id|>" }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim }}
        {{- '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls | length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}{%- if not loop.last %}{{- ", " }}{%- endif %}
            {%- endfor %}
            {{- ")<|eom_id|>" }}
        {%- else %}
            {{- '{"name": "' + tool_call.name + '", "parameters": ' + tool_call.arguments | tojson + "}<|eot_id|>" }}
        {%- endif %}
    {%- else %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {#- The real template's test: a string is iterable too, so every result is written as JSON. #}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

# Qwen2.5 (Qwen/Qwen2.5-7B-Instruct): tools in the system turn, calls as Hermes <tool_call> blocks,
# results as <tool_response> blocks in one user turn.
QWEN_2_5 = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" + tool | tojson }}{%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\\n<tool_call>\\n"
        "{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first)
          or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {{- tool_call.arguments | tojson + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Mistral v0.3 (mistralai/Mistral-7B-Instruct-v0.3): [AVAILABLE_TOOLS] before the last user message,
# calls as [TOOL_CALLS] and a JSON list, results as [TOOL_RESULTS]. The system message joins the
# LAST user message, so a conversation with one renders it elsewhere in turn 2 than in turn 1 (the
# real template's behaviour).
MISTRAL_V0_3 = """\
{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{%- set ns = namespace(index=0) %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate "
                                "user/assistant/user/assistant/...") }}
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
                        {{- '"' + key + '": ' + val | tojson }}
                    {%- endif %}
                    {%- if not loop.last %}{{- ", " }}{%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" }}{%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {{- '{"name": "' + tool_call.function.name + '", "arguments": ' + tool_call.function.arguments | tojson }}
            {{- "}" }}{%- if not loop.last %}{{- ", " }}{%- endif %}
        {%- endfor %}
        {{- "]" + eos_token }}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"] | trim + eos_token }}
    {%- elif message["role"] == "tool" %}
        {{- '[TOOL_RESULTS] {"content": ' + message.content | string + ', "call_id": "' + message.tool_call_id }}
        {{- '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial "
                            "optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

TEMPLATES = {"llama3.1": LLAMA_3_1, "qwen2.5": QWEN_2_5, "mistral-v0.3": MISTRAL_V0_3}
PARSER_OF = {
    "llama3.1": "llama3_json",
    "qwen2.5": "hermes",
    "mistral-v0.3": "mistral",
}  # vLLM's parser names


def write_template(folder: str | Path, family: str) -> None:
    """Make `family`'s template (a TEMPLATES key) the chat template of the tokenizer in `folder`,
    which engine.demo.write_byte_tokenizer wrote: both places transformers reads it from are
    overwritten."""
    folder = Path(folder)
    template = TEMPLATES[family]
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    (folder / "chat_template.jinja").write_text(template)

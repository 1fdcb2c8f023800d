"""Chat templates of other verifier families, written out as the models ship them, and the SmolLM2 tokenizer dressed
in each (its vocabulary plus that family's special tokens): fast tokenizers with other templates and added tokens,
for the loss-mask tests."""

from __future__ import annotations

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# DeepSeek-V3's shipped template (system prompts hoisted, tool calls and tool outputs in its own tokens).
DEEPSEEK_V3_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}"
    "{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}"
    "{%- else %}{% set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}{%- endif %}"
    "{%- endif %}{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}"
    "{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and 'tool_calls' in message %}{%- set ns.is_tool = false -%}"
    "{%- for tool in message['tool_calls'] %}{%- if not ns.is_first %}{%- if message['content'] is none %}"
    "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' "
    "+ tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' "
    "+ '<｜tool▁call▁end｜>'}}{%- else %}{{'<｜Assistant｜>' + message['content'] + "
    "'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] "
    "+ '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{%- endif %}{%- set ns.is_first = true -%}{%- else %}{{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] "
    "+ '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] "
    "+ '\n' + '```' + '<｜tool▁call▁end｜>'}}{%- endif %}{%- endfor %}"
    "{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and 'tool_calls' not in message %}{%- if ns.is_tool %}"
    "{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}"
    "{%- else %}{% set content = message['content'] %}{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}"
    "{%- endif %}{%- endif %}{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}"
    "{%- if ns.is_output_first %}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] "
    "+ '<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}{%- else %}"
    "{{'<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}"
    "{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}"
    "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}"
)
# Kimi-K2-Thinking style: reasoning rendered only for turns after the last user message; history gets <think></think>.
KIMI_THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}{%- for m in messages -%}{%- if m['role'] == 'user' -%}"
    "{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for message in messages -%}{%- if loop.first and message['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>{%- endif -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>{{ message['content'] }}<|im_end|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>{{ message['content'] }}<|im_end|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if loop.index0 > ns.last_user and message.reasoning_content is defined and message.reasoning_content -%}"
    "<think>{{ message['reasoning_content'] }}</think>{%- else -%}<think></think>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- elif message['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>{{ message['content'] }}<|im_end|>"
    "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def template_variant(path, template: str, bos: str, eos: str, extra: list[str], trust_remote_code: bool = False):
    """The SmolLM2 tokenizer with another template and that model family's special tokens added."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    tok.add_special_tokens({"bos_token": bos, "eos_token": eos, "additional_special_tokens": extra})
    tok.chat_template = template
    return tok


LLAMA3_SPECIAL = ("<|begin_of_text|>", "<|eot_id|>", ["<|start_header_id|>", "<|end_header_id|>"])
DEEPSEEK_SPECIAL = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                    ["<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                     "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
                     "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"])
KIMI_SPECIAL = ("[BOS]", "<|im_end|>", ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>"])


def family_tokenizer(path, family: str, trust_remote_code: bool = False):
    """The SmolLM2 tokenizer saved at `path` (the fast one, or the slow remote-code one: `trust_remote_code`) with the
    template and special tokens of `family` (llama3, deepseek, kimi)."""
    template, special = {"llama3": (LLAMA3_TEMPLATE, LLAMA3_SPECIAL),
                         "deepseek": (DEEPSEEK_V3_TEMPLATE, DEEPSEEK_SPECIAL),
                         "kimi": (KIMI_THINKING_TEMPLATE, KIMI_SPECIAL)}[family]
    return template_variant(path, template, *special, trust_remote_code=trust_remote_code)


def U(text: str) -> dict:
    """A user message."""
    return {"role": "user", "content": text}


def A(text: str, **extra) -> dict:
    """An assistant message (`extra`: tool_calls, reasoning_content, ...)."""
    return {"role": "assistant", "content": text, **extra}


CALL = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}

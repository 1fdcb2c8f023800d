"""Chat templates of thinking verifiers, written here to behave as the shipped ones do (how they render the think
block of the latest and of earlier assistant turns, and their generation prompts), and the SmolLM2 tokenizer
dressed in each (that family's special tokens, `<think>` and `</think>` as added tokens):

- `k25`: Kimi-K2.5's behaviour. Every assistant turn up to the last one without tool calls is history and gets an
  empty `<think></think>` before its answer (the last turn of a finished conversation included: its reasoning is
  dropped); only the turns after it (a tool-call loop in progress) keep `<think>REASONING</think>`; tool calls in
  its section tokens after the content, tool results as `tool` system turns. The generation prompt opens the
  block: `<|im_assistant|>assistant<|im_middle|><think>`, so the model emits `REASONING</think>ANSWER<|im_end|>`.
  `thinking=False` (the chat-template kwarg) closes an empty block in the generation prompt instead
  (`<think></think>`, then the model emits the answer) and blanks the tool loop's reasoning too.
- `qwen3`: Qwen3's behaviour. ChatML; assistant turns after the last user query render
  `<think>\\nREASONING\\n</think>\\n\\nANSWER` (the final one always, an empty block when it has no reasoning),
  earlier ones only their answer; reasoning is read from `reasoning_content` or split off an inline `</think>`;
  `enable_thinking=False` closes an empty block in the generation prompt.
- `r1`: DeepSeek-R1's behaviour. Every assistant turn keeps only the text after its last `</think>`; the
  generation prompt opens the block (`<｜Assistant｜><think>\\n`), so the model emits
  `REASONING\\n</think>\\n\\nANSWER<｜end▁of▁sentence｜>`.
"""

from __future__ import annotations

K25_TEMPLATE = (
    "{%- set ns = namespace(history_end=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'assistant' and not m.get('tool_calls') -%}"
    "{%- set ns.history_end = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- set off = thinking is defined and not thinking -%}"
    "{%- if not messages or messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if loop.index0 <= ns.history_end or off -%}<think></think>"
    "{%- else -%}<think>{{ m.get('reasoning_content') or '' }}</think>{%- endif -%}"
    "{{ m['content'] }}"
    "{%- if m.get('tool_calls') -%}<|tool_calls_section_begin|>{%- for c in m['tool_calls'] -%}"
    "<|tool_call_begin|>{{ c['function']['name'] }}<|tool_call_argument_begin|>{{ c['function']['arguments'] }}"
    "<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}<|im_end|>"
    "{%- elif m['role'] == 'user' -%}<|im_user|>user<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- else -%}<|im_system|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if off -%}<think></think>{%- else -%}<think>{%- endif -%}{%- endif -%}"
)

# the k25 template as it was before it took Kimi-K2.5's opened generation prompt: the bare header, the model
# emitting `<think>REASONING</think>ANSWER`; kept so that data without reasoning is shown prepared as before
K25_BARE_TEMPLATE = (
    "{%- set ns = namespace(history_end=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'assistant' and not m.get('tool_calls') -%}"
    "{%- set ns.history_end = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- if not messages or messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if loop.index0 <= ns.history_end -%}<think></think>"
    "{%- else -%}<think>{{ m.get('reasoning_content') or '' }}</think>{%- endif -%}"
    "{{ m['content'] }}"
    "{%- if m.get('tool_calls') -%}<|tool_calls_section_begin|>{%- for c in m['tool_calls'] -%}"
    "<|tool_call_begin|>{{ c['function']['name'] }}<|tool_call_argument_begin|>{{ c['function']['arguments'] }}"
    "<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}<|im_end|>"
    "{%- elif m['role'] == 'user' -%}<|im_user|>user<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- else -%}<|im_system|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- endif -%}{%- endif -%}"
)

QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- set answer = m['content'] -%}{%- set thought = m.get('reasoning_content') or '' -%}"
    "{%- if not thought and '</think>' in answer -%}"
    "{%- set thought = answer.split('</think>')[0].split('<think>')[-1] -%}"
    "{%- set answer = answer.split('</think>')[-1] -%}{%- endif -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_query and (loop.last or thought) -%}"
    "{{ '<think>\\n' + thought.strip('\\n') + '\\n</think>\\n\\n' + answer.lstrip('\\n') }}"
    "{%- else -%}{{ answer.lstrip('\\n') }}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- endif -%}"
)

R1_TEMPLATE = (
    "{{ bos_token }}{%- for m in messages -%}{%- if m['role'] == 'system' -%}{{ m['content'] }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{{ '<｜User｜>' + m['content'] }}"
    "{%- elif m['role'] == 'assistant' -%}{%- set answer = m['content'] -%}"
    "{%- if '</think>' in answer -%}{%- set answer = answer.split('</think>')[-1] -%}{%- endif -%}"
    "{{ '<｜Assistant｜>' + answer + '<｜end▁of▁sentence｜>' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<｜Assistant｜><think>\\n' }}{%- endif -%}"
)

THINK_TOKENS = ["<think>", "</think>"]
_SPECIAL = {
    "k25": ("[BOS]", "<|im_end|>", ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>",
                                    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                                    "<|tool_call_argument_begin|>", "<|tool_call_end|>"]),
    "qwen3": (None, "<|im_end|>", []),
    "r1": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", ["<｜User｜>", "<｜Assistant｜>"]),
}
TEMPLATES = {"k25": K25_TEMPLATE, "k25-bare": K25_BARE_TEMPLATE, "qwen3": QWEN3_TEMPLATE, "r1": R1_TEMPLATE}


def thinking_tokenizer(path, family: str):
    """The SmolLM2 tokenizer at `path` with the template and special tokens of `family` (k25, k25-bare, qwen3, r1),
    and the think delimiters as added (non-special) tokens, as these models ship them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    bos, eos, extra = _SPECIAL[family.split("-")[0]]
    special: dict = {"eos_token": eos, "additional_special_tokens": extra}
    if bos:
        special["bos_token"] = bos
    tok.add_special_tokens(special)
    tok.add_tokens(THINK_TOKENS)
    tok.chat_template = TEMPLATES[family]
    return tok

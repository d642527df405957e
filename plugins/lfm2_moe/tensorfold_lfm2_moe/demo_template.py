"""The demo checkpoint's chat template: ours, written for the demo, in LFM2's layout and with the
tool markup of Liquid AI's models (as LFM2.5's template writes it), so a demo server speaks the
same tool-call format as a real LFM2:
- tools listed in the system turn:
  `List of tools: <|tool_list_start|>[{...}, ...]<|tool_list_end|>`;
- an assistant's calls: `<|tool_call_start|>[name(key="value", n=1)]<|tool_call_end|>`;
- a tool's answer: `<|im_start|>tool\\n<|tool_response_start|>...<|tool_response_end|><|im_end|>`.
A chat without tools renders as before: each message as `<|im_start|>role\\ncontent<|im_end|>\\n`.

Thinking as LFM2.5 writes it: the model opens its reply with `<think>`, its thought, `</think>`,
then the answer. An earlier assistant turn's `thinking` (or `reasoning_content`) is rendered as
`<think>...</think>` before its content only after the last user message, and older turns' content
loses any thinking before its `</think>`, as LFM2.5's template does. Our own knob beside it:
`enable_thinking` (default on); false ends the generation prompt with an empty `<think></think>`,
so the model answers directly.
"""

CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}"
    "{%- set ns = namespace(system='') -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set ns.system = messages[0]['content'] + '\\n' -%}"
    "{%- set messages = messages[1:] -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>system\\n' + ns.system + 'List of tools: <|tool_list_start|>[' -}}"
    "{%- for tool in tools -%}{{- tool | tojson -}}{{- ', ' if not loop.last -}}{%- endfor -%}"
    "{{- ']<|tool_list_end|><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- set last = namespace(user=-1) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{%- set last.user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'tool' -%}"
    "{{- '<|tool_response_start|>' + (message.get('content') or '') + '<|tool_response_end|>' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{%- set content = message.get('content') or '' -%}"
    "{%- if loop.index0 > last.user -%}"
    "{%- if message.get('thinking') is string -%}"
    "{{- '<think>' + message['thinking'] + '</think>' -}}"
    "{%- endif -%}"
    "{%- elif '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1] | trim -%}"
    "{%- endif -%}"
    "{{- content -}}"
    "{%- else -%}"
    "{{- message.get('content') or '' -}}"
    "{%- endif -%}"
    "{%- if message.get('tool_calls') -%}"
    "{{- '<|tool_call_start|>[' -}}"
    "{%- for call in message['tool_calls'] -%}"
    "{{- call['function']['name'] + '(' -}}"
    "{%- for key, value in call['function']['arguments'].items() -%}"
    "{{- key + '=' + (value | tojson) -}}{{- ', ' if not loop.last -}}"
    "{%- endfor -%}"
    "{{- ')' -}}{{- ', ' if not loop.last -}}"
    "{%- endfor -%}"
    "{{- ']<|tool_call_end|>' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}"
    "{{- '<think></think>' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

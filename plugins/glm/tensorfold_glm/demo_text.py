"""The demo checkpoint's text: its GLM-style chat template and the corpus its tokenizer learns
(tensorfold.family.demo_text, which its weights are trained on too)."""

from tensorfold.family.demo_text import plain_text

# GLM's layout: [gMASK]<sop>, then each message as <|role|>\n content; the assistant's turn
# opens with <|assistant|> and its thinking (below) and ends where the next role token (an EOS
# for GLM) begins.
# Tools, tool calls and tool answers use GLM-4.7-Flash's markup (ours, not a copy of its
# template), so a demo server speaks the same tool-call format as the real model:
# - tools: a <|system|> turn listing each tool's JSON between <tools> and </tools>;
# - an assistant's calls:
#   <tool_call>name<arg_key>key</arg_key><arg_value>value</arg_value></tool_call>, strings bare,
#   other values as JSON;
# - a tool's answer: <|observation|>\n<tool_response>...</tool_response>.
# Content as GLM-4.7-Flash's visible_text has it, a string or a list of parts (text parts'
# text, nothing between them), and each {"type": "image"} part as GLM-4.xV's templates write it:
# <|begin_of_image|><|image|><|end_of_image|> (the one <|image|> expanded per image row by the
# media processor, tensorfold_glm.media_processor). Text-only chats render as before.
# Thinking as GLM's template has it: the generation prompt ends <|assistant|><think> (the model
# writes its thought, </think>, then the answer) unless enable_thinking is false, when it ends
# <|assistant|></think>; an earlier assistant turn shows its reasoning_content as
# <think>...</think> only after the last user message, else </think> alone.
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- macro visible(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content is iterable and content is not mapping -%}"
    "{%- for item in content -%}"
    "{%- if item is mapping and item.type == 'text' -%}{{- item.text -}}"
    "{%- elif item is mapping and item.type in ['image', 'image_url'] -%}"
    "{{- '<|begin_of_image|><|image|><|end_of_image|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- elif content -%}{{- content -}}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{- '<|system|>\\n# Tools\\n\\nYou may call one or more functions. Their signatures are "
    "within <tools></tools>:\\n<tools>\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson(ensure_ascii=False) -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- '</tools>\\n\\nCall a function as <tool_call>{name}<arg_key>{key}</arg_key>"
    "<arg_value>{value}</arg_value>...</tool_call>' -}}"
    "{%- endif -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{- '<|observation|>\\n<tool_response>' -}}{{- visible(message.get('content')) -}}"
    "{{- '</tool_response>' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{%- if loop.index0 > ns.last_user and message.get('reasoning_content') -%}"
    "{{- '<|assistant|><think>' + message['reasoning_content'] | trim + '</think>' -}}"
    "{%- else -%}"
    "{{- '<|assistant|></think>' -}}"
    "{%- endif -%}"
    "{{- visible(message.get('content')) -}}"
    "{%- else -%}"
    "{{- '<|' + message['role'] + '|>\\n' -}}{{- visible(message.get('content')) -}}"
    "{%- endif -%}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{{- '<tool_call>' + call['function']['name'] -}}"
    "{%- for key, value in call['function']['arguments'].items() -%}"
    "{{- '<arg_key>' + key + '</arg_key><arg_value>' -}}"
    "{{- value if value is string else value | tojson(ensure_ascii=False) -}}"
    "{{- '</arg_value>' -}}"
    "{%- endfor -%}"
    "{{- '</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|assistant|></think>' if enable_thinking is defined and not enable_thinking "
    "else '<|assistant|><think>' -}}"
    "{%- endif -%}"
)

# The tokenizer learns the demo's text (tensorfold.family.demo_text) and a line of digits and symbols.
CORPUS = plain_text() + (
    "0 1 2 3 4 5 6 7 8 9 10 42 100 2048 4096. Symbols: + - * / = ( ) [ ] { } < > , . ; : ! ? \" ' # % & @\n"
)

"""The demo checkpoint's text: its GLM-style chat template and the corpus its tokenizer learns."""

# GLM's layout: [gMASK]<sop>, then each message as <|role|>\n content; the assistant's turn
# opens with <|assistant|>\n and ends where the next role token (an EOS for GLM) begins.
# Tools, tool calls and tool answers use GLM-4.7-Flash's markup (ours, not a copy of its
# template), so a demo server speaks the same tool-call format as the real model:
# - tools: a <|system|> turn listing each tool's JSON between <tools> and </tools>;
# - an assistant's calls:
#   <tool_call>name<arg_key>key</arg_key><arg_value>value</arg_value></tool_call>, strings bare,
#   other values as JSON;
# - a tool's answer: <|observation|>\n<tool_response>...</tool_response>.
# A chat without tools renders as before.
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- if tools -%}"
    "{{- '<|system|>\\n# Tools\\n\\nYou may call one or more functions. Their signatures are "
    "within <tools></tools>:\\n<tools>\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson(ensure_ascii=False) -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- '</tools>\\n\\nCall a function as <tool_call>{name}<arg_key>{key}</arg_key>"
    "<arg_value>{value}</arg_value>...</tool_call>' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{- '<|observation|>\\n<tool_response>' + (message.get('content') or '') -}}"
    "{{- '</tool_response>' -}}"
    "{%- else -%}"
    "{{- '<|' + message['role'] + '|>\\n' + (message.get('content') or '') -}}"
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
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

CORPUS = """\
Hello! How can I help you today? I can answer questions, write a short story, or explain an idea.
The old lighthouse keeper climbed the stairs every evening and lit the lamp above the sea. Ships
passed in the dark, and each captain knew the rhythm of its light: two long flashes, then one short.
A recurrent layer keeps a small state that it updates with every token; an attention layer looks
back at every token it has seen. This model mixes both: three linear layers for every attention
layer, so that a long conversation costs little memory.
In winter the lake freezes over and the village children skate from one shore to the other. Their
parents stand near a fire on the beach, drinking tea and telling stories about the great storm.
Good code reads like a short letter: it says what it does, in order, and stops. Tests catch the
mistakes that a reader would miss, and a clear message tells the next person what went wrong.
What is the tallest mountain in the world? Mount Everest is the tallest mountain above sea level.
How many legs does a spider have? A spider has eight legs. Which planet is the largest? Jupiter.
Can you summarise this paragraph? Of course. Please paste the text, and tell me how long the
summary should be. Thank you, that was very helpful. You are welcome; ask me anything else.
The market opens at seven. Farmers bring apples, pears, cheese and bread, and the baker sells warm
rolls until they run out, usually before nine. On Saturdays a band plays near the fountain.
Numbers: zero, one, two, three, four, five, six, seven, eight, nine, ten, twenty, hundred, 0 1 2 3
4 5 6 7 8 9 10 42 100 2048 4096. Symbols: + - * / = ( ) [ ] { } < > , . ; : ! ? " ' # % & @
"""

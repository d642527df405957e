"""The demo checkpoint's text: its GLM-style chat template and the corpus its tokenizer learns
(tensorfold.demo_text, which its weights are trained on too)."""

from tensorfold.demo_text import plain_text

# GLM's layout: [gMASK]<sop>, then each message as <|role|>\n content; the assistant's turn
# opens with <|assistant|>\n and ends where the next role token (an EOS for GLM) begins.
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

# The tokenizer learns the demo's text (tensorfold.demo_text) and a line of digits and symbols.
CORPUS = plain_text() + (
    "0 1 2 3 4 5 6 7 8 9 10 42 100 2048 4096. Symbols: + - * / = ( ) [ ] { } < > , . ; : ! ? \" ' # % & @\n"
)

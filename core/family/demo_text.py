"""The text the families' demo checkpoints learn: short stories, plain facts, and questions with
their answers, each with a short thought to write before it when thinking is on. All of it is
written for this project (Apache-2.0, like the code), so the demo weights trained on it may ship.
`words()` is the vocabulary a demo's replies are checked against.
"""

from __future__ import annotations

import re

STORIES = """\
Once upon a time there was a little engine that lived in a green valley. Every morning it woke
before dawn and listened to the rain on the roof of the station. It carried coal and letters and
children across the valley, and it knew every bridge by the sound its wheels made. When the signal
turned green, it gave a short whistle and rolled out into the grey light.

Once upon a time a small fox lived at the edge of a dark forest. She was clever and quick, and she
liked to watch the farmers bring their sheep down from the hills. One winter night she found a
lost lamb in the snow. She kept it warm until morning, and then she led it home to the farm.

Once upon a time an old woman kept a garden by the sea. She grew roses, beans and apples, and she
gave them to anyone who walked past her gate. The children of the village called her the garden
queen, and every summer they helped her pick the apples.

The little engine woke before dawn and listened to the rain on the roof of the station.

In the spring the river rises, and the farmers along its banks move their sheep to the higher
fields. The water is cold and fast, brown with soil from the mountains. By summer it is clear
again, and the children swim in the slow pools below the old mill, where the trout hide under the
stones.

She opened the window and looked at the garden. The roses were red and white, the apple tree was
full of birds, and the cat was asleep on the warm wall. "What a beautiful morning," she said, and
went down to make tea. Her brother was already in the kitchen, reading the newspaper and eating
bread with honey.

The old lighthouse keeper climbed the stairs every evening and lit the lamp above the sea. Ships
passed in the dark, and each captain knew the rhythm of its light: two long flashes, then one
short.

The market opens at seven. Farmers bring apples, pears, cheese and bread, and the baker sells warm
rolls until they run out, usually before nine. On Saturdays a band plays near the fountain.

A language model reads text one token at a time. Each token looks back at the tokens before it,
and the model keeps what it has seen in a cache, so that the next word can be computed without
reading the whole story again. When many people talk to the same server, their caches share one
pool of memory pages.

Good software is easy to read and easy to change. Small functions with clear names, tests that run
in seconds, and a short note where the code cannot explain itself: these are worth more than
clever tricks. When something breaks, a good test tells you where, and a good log line tells you
why.

How many tokens can a model remember? The answer depends on the size of its window and on the
memory of the machine. A short conversation needs only a few pages; a long document may need
thousands. The server plans its memory at start, and it refuses a request it cannot serve instead
of failing halfway through.

This is a small demo model. It was trained on a few pages of text, so it knows only a little about
the world: some stories, some facts, and how to answer a few questions. A real checkpoint knows
much more.

Numbers: one, two, three, four, five, six, seven, eight, nine, ten.
"""

# (question, answer): taught as chat turns, and as plain text ("question answer").
QA: tuple[tuple[str, str], ...] = (
    ("What is the capital of France?", "Paris is the capital of France."),
    ("What is the capital of Italy?", "Rome is the capital of Italy."),
    ("What is the capital of Spain?", "Madrid is the capital of Spain."),
    ("What is the capital of Germany?", "Berlin is the capital of Germany."),
    ("What is the capital of Japan?", "Tokyo is the capital of Japan."),
    ("What color is the sky?", "The sky is blue on a clear day."),
    ("What color is grass?", "Grass is green."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("Which planet is the largest?", "Jupiter is the largest planet."),
    (
        "What is the tallest mountain in the world?",
        "Mount Everest is the tallest mountain above sea level.",
    ),
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi", "Hi! What would you like to talk about?"),
    ("Who are you?", "I am a small demo model. I know a few stories and a few facts."),
    ("What can you do?", "I can answer a few questions and tell a short story."),
    (
        "Tell me a story.",
        "Once upon a time there was a little engine that lived in a green valley.",
    ),
    (
        "Tell me a story about a fox.",
        "Once upon a time a small fox lived at the edge of a dark forest.",
    ),
    (
        "Can you help me write a letter?",
        "Yes, of course. Tell me who the letter is for and what you want to say.",
    ),
    (
        "What is a language model?",
        "A language model reads text one token at a time and writes the next word.",
    ),
    ("Thank you!", "You are welcome. Ask me anything else."),
    ("What is two plus two?", "Two plus two is four."),
    ("What day comes after Monday?", "Tuesday comes after Monday."),
)


# A short thought before each answer, naming what the question asks: what a demo writes in its
# thinking block when thinking is on (tensorfold.family.demo_train).
THOUGHTS: dict[str, str] = {
    "What is the capital of France?": "They ask for the capital of France.",
    "What is the capital of Italy?": "They ask for the capital of Italy.",
    "What is the capital of Spain?": "They ask for the capital of Spain.",
    "What is the capital of Germany?": "They ask for the capital of Germany.",
    "What is the capital of Japan?": "They ask for the capital of Japan.",
    "What color is the sky?": "They ask about the color of the sky.",
    "What color is grass?": "They ask about the color of grass.",
    "How many days are in a week?": "They ask how many days a week has.",
    "How many legs does a spider have?": "They ask how many legs a spider has.",
    "Which planet is the largest?": "They ask which planet is the largest.",
    "What is the tallest mountain in the world?": "They ask for the tallest mountain.",
    "Hello!": "A greeting. I say hello back.",
    "Hi": "A greeting. I greet them back.",
    "Who are you?": "They ask who I am.",
    "What can you do?": "They ask what I can do.",
    "Tell me a story.": "They want a short story.",
    "Tell me a story about a fox.": "They want a story about a fox.",
    "Can you help me write a letter?": "They want help with a letter.",
    "What is a language model?": "They ask what a language model is.",
    "Thank you!": "They say thank you.",
    "What is two plus two?": "They ask for two plus two.",
    "What day comes after Monday?": "They ask which day comes after Monday.",
}


def paragraphs() -> list[str]:
    """The stories, one paragraph a string, its lines joined by spaces."""
    return [" ".join(p.split("\n")).strip() for p in STORIES.split("\n\n") if p.strip()]


def plain_text() -> str:
    """The stories, then every question with its answer, one a line, then every thought."""
    return (
        STORIES + "".join(f"{q} {a}\n" for q, a in QA) + "".join(f"{THOUGHTS[q]}\n" for q, _ in QA)
    )


def words(text: str | None = None) -> set[str]:
    """The lower-cased words of `text` (default: everything here)."""
    return {w.lower() for w in re.findall(r"[A-Za-z]+", plain_text() if text is None else text)}


def known_share(text: str) -> float:
    """The share of `text`'s words that the demo text holds (0 with no words): how a test tells
    a demo's reply made of words from noise."""
    found = re.findall(r"[A-Za-z]+", text)
    known = words()
    return sum(w.lower() in known for w in found) / len(found) if found else 0.0

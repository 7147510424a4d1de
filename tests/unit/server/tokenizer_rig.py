"""A small real Hugging Face tokenizer and a ChatML template, for the tests of tokenizing and
of the gateway's chat templates (the fixture ``tokenizer_json`` in conftest.py is its JSON)."""

from __future__ import annotations

from tokenizers import Tokenizer, pre_tokenizers, processors
from tokenizers.models import WordLevel
from tokenizers.trainers import WordLevelTrainer

__all__ = ["CHATML", "word_level_tokenizer"]

SPECIALS = ["[UNK]", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
SENTENCES = [
    "hello world",
    "the quick brown fox jumps over the lazy dog",
    "you are a helpful assistant",
    "user system assistant",
    "tell me a joke about the world",
]
# ChatML with a leading bos_token, written over several lines as HF templates are: only
# trim_blocks and lstrip_blocks make it render without the blocks' newlines and indents.
CHATML = """{{ bos_token }}{% for message in messages %}
  {% if message['role'] == 'tool' %}
    {{ raise_exception('tool messages are not supported') }}
  {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""


def word_level_tokenizer() -> Tokenizer:
    """A word-level tokenizer trained on SENTENCES, with <s> ... </s> around each text."""
    tok = Tokenizer(WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, WordLevelTrainer(special_tokens=SPECIALS))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        special_tokens=[("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))],
    )
    return tok

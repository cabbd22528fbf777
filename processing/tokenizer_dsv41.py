"""A small, real byte-level BPE tokenizer with DeepSeek-V4.1's special tokens, built locally (no downloads).

The released tokenizer has 129 280 entries; tests and demos need something that tokenizes real text, knows the
chat and image markers, and fits a tiny model. Its id layout follows the released one where it matters:
BOS/EOS/pad are ids 0/1/2, and the image token sits at ``vocab_size - 2`` (510 for the tiny preset's 512).
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
SYSTEM_TOKEN = "<｜System｜>"
THINK_START_TOKEN = "<think>"
THINK_END_TOKEN = "</think>"
IMAGE_TOKEN = "<｜deepseek_image｜>"

# DeepSeek's conversation format (non-thinking): BOS, system text, then `<｜User｜>…` and
# `<｜Assistant｜></think>…<｜end▁of▁sentence｜>` turns; an image block renders as one image token, which the
# processor expands into the image's span. An assistant turn's reply and its EOS (what the model is trained to
# write; `<｜Assistant｜></think>` is the generation prompt) sit in `{% generation %}` markers, for
# `return_assistant_tokens_mask` and TRL's `assistant_only_loss`.
CHAT_TEMPLATE = (
    "{%- set image_token = '" + IMAGE_TOKEN + "' -%}"
    "{%- macro render(blocks) -%}"
    "{%- for block in blocks -%}"
    "{%- if block['type'] == 'text' -%}{{- block['text'] -}}"
    "{%- elif block['type'] == 'image' -%}{{- image_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endmacro -%}"
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set blocks = [{'type': 'text', 'text': message['content']}] -%}"
    "{%- else -%}{%- set blocks = message['content'] -%}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '" + ASSISTANT_TOKEN + THINK_END_TOKEN + "' -}}"
    "{%- generation -%}{{- render(blocks) -}}{{- eos_token -}}{%- endgeneration -%}"
    "{%- elif message['role'] == 'user' -%}{{- '" + USER_TOKEN + "' -}}{{- render(blocks) -}}"
    "{%- elif message['role'] == 'system' -%}{{- render(blocks) -}}"
    "{%- else -%}{{- raise_exception('unsupported role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '" + ASSISTANT_TOKEN + THINK_END_TOKEN + "' -}}{%- endif -%}"
)

_LEADING_SPECIALS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)  # ids 0, 1, 2
_TRAILING_SPECIALS = (USER_TOKEN, ASSISTANT_TOKEN, THINK_START_TOKEN, THINK_END_TOKEN, IMAGE_TOKEN, SYSTEM_TOKEN)
_N_BYTES = 256

DEFAULT_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "Describe the image in one sentence. What is in this picture?",
    "The image shows a red square, a blue circle and a green line on a gray background.",
    "There are two cats sitting on a wooden table next to a window.",
    "A photo of a city street at night, with cars, lights and people walking.",
    "Please answer the question about the picture: how many objects can you see?",
    "I can see three objects: a cup, a book and a pen. The cup is white and the book is open.",
    "Hello! How can I help you today? Let me think about it step by step.",
    "DeepSeek-V4.1 reads text and images; each image becomes a grid of visual tokens.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 12 14 28 42 100 1024. Symbols: ( ) [ ] { } < > , ; : ! ? ' \" - + = * / %",
)


def build_tiny_tokenizer(texts: Iterable[str] | None = None, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer of exactly ``vocab_size`` ids on ``texts`` (a built-in corpus by default).

    Ids: 0 BOS, 1 EOS, 2 pad, then the 256 byte symbols and learned merges, then (if the corpus ran out of
    merges) ``<｜place▁holder▁no▁k｜>`` fillers, and last ``<｜User｜>``, ``<｜Assistant｜>``, ``<think>``,
    ``</think>``, ``<｜deepseek_image｜>`` (``vocab_size - 2``) and ``<｜System｜>``. Encoding prepends BOS;
    batches pad on the left (for generation; the model aligns left-padded rows, so training is unaffected).
    Training is deterministic, so two calls with the same arguments give the same tokenizer.
    """
    minimum = len(_LEADING_SPECIALS) + _N_BYTES + len(_TRAILING_SPECIALS)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} (3 specials, 256 bytes, 6 markers), got {vocab_size}")
    corpus = list(DEFAULT_CORPUS if texts is None else texts)

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(_TRAILING_SPECIALS),
        special_tokens=list(_LEADING_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer=trainer)

    n_fillers = vocab_size - len(_TRAILING_SPECIALS) - backend.get_vocab_size()
    fillers = [f"<｜place▁holder▁no▁{k}｜>" for k in range(n_fillers)]
    backend.add_special_tokens(fillers + list(_TRAILING_SPECIALS))
    if backend.get_vocab_size() != vocab_size or backend.token_to_id(IMAGE_TOKEN) != vocab_size - 2:
        raise RuntimeError(f"tokenizer layout is off: {backend.get_vocab_size()} ids, image token not at the end")
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, 0)]
    )

    # left padding: batched `generate` appends to every row's end, which must be its last real token
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, padding_side="left"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


__all__ = ["CHAT_TEMPLATE", "IMAGE_TOKEN", "build_tiny_tokenizer"]

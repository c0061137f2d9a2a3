"""A generative model's prompt as token ids: the one rule the worker (which generates from the ids)
and the gateway (which counts them to refuse an over-long prompt before queueing) both follow, so
that their counts cannot drift. Imports the `tokenizers` library and transformers' chat-template
renderer (`render_jinja_template`), never torch.

Chat messages: a message's content is text. The chat template's own special tokens (`<|im_start|>`,
`<|im_end|>`, the role markers) are control tokens; the same strings inside a content are
tokenized as ordinary text (transformers' `split_special_tokens`), so a user cannot close their
turn and open a system one, as OpenAI treats content (the placeholder approach of vLLM's proposed
"prevent special token injection in user content" change, vllm-project/vllm#31735, and of
huggingface/transformers#29279's discussion). For a content without special-token strings the ids are
exactly `apply_chat_template(..., tokenize=True)`'s, so prefix caching and greedy outputs stay as
they were.

How: the template is rendered twice, once with the contents and once with each content replaced by
a placeholder. When the first, tokenized as transformers does, holds the same control tokens as the
second, the contents made none: those are the ids. Otherwise, when putting the contents back in
place of the placeholders gives the real rendering, the special tokens the tokenizer finds in the
template's own text are the control tokens and the text around them (template text and contents
together, as the tokenizer would have cut it) is encoded with special-token matching off. When it
does not, the template changes contents (trims, escapes, splits them) and we cannot tell whose
text is whose: the prompt is refused (InvalidInputError). Refusing such a template's rare prompt
that holds special-token strings beats both refusing every prompt of such a model and opening the
hole again.

A string prompt (/v1/completions) is text its client wrote whole, templates included: its special
tokens stay control tokens (a client that writes its own template needs them).
"""

from __future__ import annotations

import json
import re
import secrets
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from vramguard.shared.errors import InvalidInputError

# annotated as returning str; it returns (the rendered conversations, generation indices)
_render_jinja_template: Any = render_jinja_template


class PromptEncoder:
    """Token ids of prompts for one tokenizer and chat template. Thread-safe: it never changes
    its tokenizers after construction (toggling `encode_special_tokens` per call would race
    between the threads that encode prompts).

    tokenizer_json: the model's tokenizer in the `tokenizers` library's JSON (a transformers
    tokenizer's `backend_tokenizer.to_str()`); chat_template: the Jinja chat template ("" for a
    model without one); special: the template's special-token variables (`bos_token`,
    `eos_token`, ... as strings), as transformers' `apply_chat_template` passes its
    `special_tokens_map`. Added tokens marked `special` are the control tokens; other added tokens
    are matched in contents too, as `split_special_tokens` leaves them.
    """

    def __init__(self, tokenizer_json: str, chat_template: str, special: Mapping[str, str]) -> None:
        self._parsing = Tokenizer.from_str(tokenizer_json)
        self._parsing.encode_special_tokens = False  # special-token strings become control tokens
        self._text = Tokenizer.from_str(tokenizer_json)
        self._text.encode_special_tokens = True  # special-token strings are split as ordinary text
        added = self._parsing.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, token in added.items() if token.special)
        self._template = chat_template
        self._special = dict(special)

    @classmethod
    def from_description(cls, fields: Mapping[str, str]) -> PromptEncoder:
        """The encoder of what a worker publishes (`CausalLMBackend.tokenizer_description`):
        `tokenizer` (the `tokenizers` JSON), `chat_template`, `special` (JSON of name -> token)."""
        return cls(fields["tokenizer"], fields["chat_template"], json.loads(fields["special"]))

    def encode(self, prompt: str | Sequence[Mapping[str, str]]) -> list[int]:
        """A string's ids (its special tokens parsed), or chat messages' ({role, content}
        strings, validated by the caller) rendered with the assistant's turn opened, contents as
        text (the module's docstring). No BOS/EOS is added beyond what the template writes.
        Raises InvalidInputError for messages to a model without a chat template, or (a template
        that changes contents) a content holding a special token."""
        if isinstance(prompt, str):
            return self._parse(prompt)
        if not self._template:
            raise InvalidInputError("messages: this model has no chat template; send its prompt as a string to "
                                    "/v1/completions")
        nonce = secrets.token_hex(8)  # the template and contents cannot hold a random placeholder
        marked = self._render([{**m, "content": f"VGCONTENT{nonce}N{i}E"} for i, m in enumerate(prompt)])
        real = self._render(prompt)
        ids, own = self._parse(real), self._controls(self._parse(marked))
        if self._controls(ids) == own:
            return ids  # the contents made no control token: transformers' own ids, unchanged
        contents = [m["content"] for m in prompt]
        pieces = re.split(f"VGCONTENT{nonce}N([0-9]+)E", marked)  # odd pieces: a message's index
        if "".join(contents[int(p)] if k % 2 else p for k, p in enumerate(pieces)) != real:
            more = Counter(self._controls(ids)) - Counter(own)  # the contents' (or those the template put for them)
            extra = ", ".join(sorted(repr(self._parsing.id_to_token(i)) for i in more))
            raise InvalidInputError(f"messages: a content holds special tokens ({extra}) that this model's chat "
                                    "template does not let the server keep as text")
        return self._encode_pieces(pieces, contents)

    def _parse(self, text: str) -> list[int]:
        return list(self._parsing.encode(text, add_special_tokens=False).ids)

    def _controls(self, ids: list[int]) -> list[int]:
        return [i for i in ids if i in self._special_ids]

    def _render(self, messages: Sequence[Mapping[str, str]]) -> str:
        rendered, _ = _render_jinja_template([[dict(m) for m in messages]], chat_template=self._template,
                                             add_generation_prompt=True, **self._special)
        return str(rendered[0])

    def _encode_pieces(self, pieces: list[str], contents: list[str]) -> list[int]:
        """The ids of the rendering cut into `pieces` (template text at even indices, a content's
        index at odd ones): control tokens where the tokenizer finds special tokens in the
        template's text, the text between them (template and contents) with special tokens split.
        A content's whitespace next to a control token stays text, even where the token strips
        whitespace (`lstrip`/`rstrip`): the content is kept as it was written."""
        ids: list[int] = []
        text: list[str] = []
        for k, piece in enumerate(pieces):
            if k % 2:
                text.append(contents[int(piece)])
                continue
            encoding = self._parsing.encode(piece, add_special_tokens=False)
            start = 0
            for token_id, (begin, end) in zip(encoding.ids, encoding.offsets, strict=True):
                if token_id in self._special_ids:
                    text.append(piece[start:begin])
                    ids += self._encode_text(text)
                    ids.append(token_id)
                    start = end
            text.append(piece[start:])
        return ids + self._encode_text(text)

    def _encode_text(self, text: list[str]) -> list[int]:
        """The ids of `text` joined, special-token strings as text; empties `text`."""
        joined = "".join(text)
        text.clear()
        return list(self._text.encode(joined, add_special_tokens=False).ids) if joined else []

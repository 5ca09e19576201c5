"""Text in and out: chat templates, incremental decoding, stop strings.

Streaming decodes a growing window of tokens and emits only text that is
final: a chunk never ends inside a UTF-8 character (the tokenizer would show
U+FFFD there) and never shows text that may turn out to be part of a stop string.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

Message = dict[str, str]


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | Sequence[Message], chat: bool = True) -> list[int]:
    """Token ids of a prompt; chat prompts go through the model's chat template when it has one. Without
    one, a chat is taken only if it is a single user message, as its text: joining several would silently
    drop their roles. Text that is not Unicode a tokenizer can take (a lone surrogate: invalid UTF-8 bytes
    on a command line, a bad escape in JSON) is a ValueError naming where it is, as is a prompt that is
    neither a string nor a list of messages with a string role and content."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else check_messages(prompt)
    for number, message in enumerate(messages, 1):
        if isinstance(message.get("content"), str):
            check_text(message["content"], "the prompt" if isinstance(prompt, str) else f"message {number}")
    if chat and tokenizer.chat_template:
        return chat_ids(tokenizer, messages)
    if len(messages) != 1 or messages[0].get("role") != "user":
        why = "the chat template is off (chat=False)" if tokenizer.chat_template else "the model has no chat template"
        raise ValueError(f"{why}, so a chat of {len(messages)} messages and their roles cannot be written as its "
                         "input: send one user message, or the text as a completion prompt")
    # a message's text that spells a special token stays text, as through a template (`chat_ids`); a
    # completion prompt is read as the tokenizer reads it
    return tokenizer.encode(messages[0]["content"], add_special_tokens=True, split_special_tokens=not isinstance(prompt, str))


def check_messages(prompt: object) -> list[Message]:
    """The messages of a chat prompt, each a dict with a string role and a string content; a ValueError
    naming the first that is not."""
    if isinstance(prompt, (bytes, dict)) or not isinstance(prompt, Sequence):
        raise ValueError(f"a prompt must be a string or a list of messages, got {type(prompt).__name__}")
    if not prompt:
        raise ValueError("the prompt has no messages")
    for number, message in enumerate(prompt, 1):
        if not isinstance(message, dict):
            raise ValueError(f"message {number} must be a dict with 'role' and 'content', got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(f"message {number} needs a string {key!r}, got {message.get(key)!r}")
    return list(prompt)


def chat_ids(tokenizer: PreTrainedTokenizerBase, messages: list[Message]) -> list[int]:
    """The chat template's token ids for `messages`, where text in a message that spells a special token
    (`<|im_end|>`) is encoded as plain text: only the template writes control tokens, so a message cannot
    close its own turn and open another role's (a user's text posing as a system turn). Messages without
    such text are encoded as transformers' `apply_chat_template` encodes them; a message with it is
    rendered with a placeholder there, and the template's text around each placeholder is encoded apart
    from the placeholder's special-token text, which is split into ordinary tokens."""
    specials = sorted((t.content for t in tokenizer.added_tokens_decoder.values() if t.special), key=len, reverse=True)
    contents = [m["content"] for m in messages if isinstance(m.get("content"), str)]
    if not any(special in content for special in specials for content in contents):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    placeholder = "\ue000"
    while any(placeholder in content for content in contents):
        placeholder += "\ue000"
    pattern = re.compile("|".join(map(re.escape, specials)))
    hidden: list[str] = []

    def hide(match: re.Match) -> str:
        hidden.append(match.group())
        return placeholder

    masked = [{**m, "content": pattern.sub(hide, m["content"])} if isinstance(m.get("content"), str) else m
              for m in messages]
    pieces = tokenizer.apply_chat_template(masked, add_generation_prompt=True, tokenize=False).split(placeholder)
    if len(pieces) != len(hidden) + 1:
        raise ValueError("the model's chat template does not keep the messages' text as it is, so the special-token "
                         "text in them cannot be kept plain: leave it out of the messages")
    ids = tokenizer.encode(pieces[0], add_special_tokens=False)
    for text, piece in zip(hidden, pieces[1:]):
        ids += tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        ids += tokenizer.encode(piece, add_special_tokens=False)
    return ids


def check_text(text: str, what: str) -> None:
    """Raise ValueError if `text` cannot be encoded as UTF-8 (it holds a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{what} is not valid UTF-8 text: {error.object[error.start:error.end]!r} at character "
                         f"{error.start}") from None


def user_turn_opening(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids of a chat up to where the user's first message begins (any default system turn
    included): sampling from there, an instruction-tuned model writes a user's request (Magpie)."""
    if not tokenizer.chat_template:
        raise ValueError("the model has no chat template, so it cannot be asked to write prompts")
    marker = "\x00MESSAGE\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    return tokenizer.encode(text[: text.index(marker)], add_special_tokens=False)


INCOMPLETE_TOKENS = 3  # an incomplete UTF-8 character has at most 3 of its bytes, each token at least one


class IncrementalDecoder:
    """Turns tokens, pushed one at a time, into text deltas that never split a character.

    A character whose bytes span several tokens decodes as U+FFFD until its last byte arrives, so a
    trailing run of U+FFFD is held back; the text before it is released at once (a token that ends
    a stop string and starts a character, " \xe6" of " 日", shows the stop string with that token).
    A literal U+FFFD at the end is held back too, until the next character or INCOMPLETE_TOKENS more
    tokens: an incomplete character's bytes lie in the last INCOMPLETE_TOKENS tokens, so the text of
    the tokens before them is final, and the window moves past them (a run of U+FFFD tokens, real ones or
    stray bytes, had kept the window growing: 8,000 of them took 12 s to stream)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = 0  # tokens before this have been emitted in full
        self.sent = 0  # characters after the window's prefix emitted while a character was incomplete

    def push(self, token: int) -> str:
        self.ids.append(token)
        prefix = self._decode(self.prefix_offset, self.read_offset)
        text = self._decode(self.prefix_offset, len(self.ids))
        if len(text) <= len(prefix):
            return ""
        final = len(text.rstrip("\ufffd"))
        if final < len(text):  # a character may be incomplete: release what precedes it
            settled = len(self.ids) - INCOMPLETE_TOKENS
            older = self._decode(self.prefix_offset, settled) if settled > self.read_offset else ""
            older_final = text.startswith(older)
            release = max(final, len(older) if older_final else 0)
            delta = text[len(prefix) + self.sent : release]
            self.sent += len(delta)
            if len(older) > len(prefix) and older_final:  # the text of the tokens before `settled` is final
                self.prefix_offset, self.read_offset = self.read_offset, settled
                self.sent = len(prefix) + self.sent - len(older)
            return delta
        delta = text[len(prefix) + self.sent :]
        self.prefix_offset, self.read_offset, self.sent = self.read_offset, len(self.ids), 0
        return delta

    def flush(self) -> str:
        """Whatever is left undecoded, even an incomplete character, at the end of a stream."""
        prefix = self._decode(self.prefix_offset, self.read_offset)
        text = self._decode(self.prefix_offset, len(self.ids))
        delta = text[len(prefix) + self.sent :]
        self.prefix_offset, self.read_offset, self.sent = len(self.ids), len(self.ids), 0
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(
            self.ids[start:end], skip_special_tokens=True, clean_up_tokenization_spaces=False
        )


def prefix_function(s: str) -> list[int]:
    """KMP's table: for each i, the length of the longest proper prefix of s[: i + 1] that is also its suffix."""
    table = [0] * len(s)
    for i in range(1, len(s)):
        k = table[i - 1]
        while k and s[i] != s[k]:
            k = table[k - 1]
        table[i] = k + (s[i] == s[k])
    return table


def stop_strings(stop: str | Sequence[str] | None) -> list[str]:
    """The stop strings of an option that gives none, one string or several (a string is one stop string,
    not its characters). An empty one is a ValueError: it would end every answer before its first token; so
    is one that is not valid UTF-8 (a lone surrogate), which no answer's text can hold."""
    if isinstance(stop, bytes):
        raise ValueError(f"a stop string must be a string, got {stop!r}")
    try:
        strings = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
    except TypeError:  # not a sequence
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}") from None
    for string in strings:
        if not isinstance(string, str):
            raise ValueError(f"a stop string must be a string, got {string!r}")
        if not string:
            raise ValueError("a stop string must not be empty")
        check_text(string, "a stop string")
    return strings


class StopMatcher:
    """Finds stop strings in streamed text and holds back text that could start one.

    Each stop string has a Knuth-Morris-Pratt automaton whose state is the longest tail of the text
    that is a prefix of it, advanced one character at a time: text fed costs time in proportion to
    its own length, whatever the answer's length or the stop strings' (a server takes them from
    clients)."""

    def __init__(self, stop: str | Sequence[str]) -> None:
        self.stop = stop_strings(stop)
        self.fallback = [prefix_function(s) for s in self.stop]
        self.state = [0] * len(self.stop)  # per stop string: the longest tail of `text` that is a prefix of it
        self.text = ""  # all text seen
        self.emitted = 0  # characters of `text` already released

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was found)."""
        start = len(self.text)
        self.text += delta
        for at, char in enumerate(delta if self.stop else "", start):
            hits = [at + 1 - len(s) for i, s in enumerate(self.stop) if self._advance(i, char) == len(s)]
            if hits:  # cut at the stop string that completes first, the longest of those completing here
                return self._release(min(hits)), True
        return self._release(len(self.text) - max(self.state, default=0)), False

    def finish(self) -> str:
        return self._release(len(self.text))

    def _advance(self, i: int, char: str) -> int:
        """Stop string i's state after `char`."""
        stop, fallback, state = self.stop[i], self.fallback[i], self.state[i]
        while state and stop[state] != char:
            state = fallback[state - 1]
        self.state[i] = state = state + (stop[state] == char)
        return state

    def _release(self, end: int) -> str:
        end = max(end, self.emitted)
        out, self.emitted = self.text[self.emitted : end], end
        return out

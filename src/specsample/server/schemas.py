"""Request bodies of the OpenAI-compatible API, and its error body.

Fields follow the OpenAI API; unknown fields are ignored so that existing
clients work unchanged, but an OpenAI option that changes the answer and is not
implemented here (`logprobs`, penalties, `logit_bias`, ...: UNSUPPORTED) is
refused when turned on, rather than silently left out. Types are strict (a
string is not a number), and the sampling options are checked by
`SamplingParams` itself, so the server accepts exactly what the library and the
command line accept.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specsample.sampling import SamplingParams, check_seed
from specsample.text import Message, stop_strings


# OpenAI options that change what is generated or returned and that this server does not implement,
# each with the values that mean "off" (`is_off`): a request that turns one on gets a 400 naming it, not an
# answer made without it. Unknown fields, and known ones that change nothing generated (`user`), are ignored.
# `logprobs` 0 of text completions asks for the sampled tokens' log probabilities: on, not off.
UNSUPPORTED: dict[str, tuple] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none", "auto"),  # with no tools, "required" or a named function cannot be met
    "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "web_search_options": (None,),
    # vLLM's extensions beside top_k and min_p, which are implemented
    "ignore_eos": (None, False),
    "min_tokens": (None, 0),
    "stop_token_ids": (None, []),
    "include_stop_str_in_output": (None, False),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "continue_final_message": (None, False),
    "add_generation_prompt": (None, True),
    "chat_template_kwargs": (None, {}),
    "truncate_prompt_tokens": (None,),
    "prompt_logprobs": (None,),
    # llama.cpp server's names for options of the kinds above
    "grammar": (None, ""),
    "json_schema": (None,),
    "repeat_penalty": (None, 1),
    "n_predict": (None,),
    "typical_p": (None, 1),
    "mirostat": (None, 0),
}


def is_off(value: object, off: tuple) -> bool:
    """Whether `value` is one of the values `off`, a bool only as a bool (0 is not False, nor True 1)."""
    return any(value == o and isinstance(value, bool) == isinstance(o, bool) for o in off)


class StreamOptions(BaseModel):
    """A stream's options: with `include_usage`, `usage` comes in a chunk of its own before `[DONE]`."""

    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


class OptionError(ValueError):
    """An option refused by a check over the whole request, naming it (the error body's `param`): pydantic
    gives a location to the checks of single fields only."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


NULL_IS_DEFAULT = {"temperature", "top_p", "top_k", "min_p", "n", "stream"}  # options whose null means their default


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: text the answer is expected to be close to, drafted from beside the
    server's drafter; it changes how soon the answer comes, never what it is (`drafters.prediction`)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["content"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class GenerationRequest(BaseModel):
    """The options shared by chat and text completions."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None  # any name is accepted: the server holds one model
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # the newer name of max_tokens in chat completions
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # not in the OpenAI API; vLLM and others accept it
    min_p: float = 0.0
    seed: int | None = None  # the text plain decoding gives with it, whatever the drafter and K (SpecSampler.stream)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    prediction: Prediction | None = None

    @model_validator(mode="before")
    @classmethod
    def null_is_the_default(cls, data: object) -> object:
        """An option sent as null takes its default, as the OpenAI API allows for every one of these."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None or key not in NULL_IS_DEFAULT}
        return data

    @model_validator(mode="before")
    @classmethod
    def refuse_unsupported(cls, data: object) -> object:
        """A one-line error for an option of UNSUPPORTED turned on."""
        if isinstance(data, dict):
            for name, off in UNSUPPORTED.items():
                if name in data and not is_off(data[name], off):
                    raise OptionError(f"{name} is not supported by this server (got {data[name]!r})", name)
        return data

    @field_validator("stop")
    @classmethod
    def check_stop(cls, stop: str | list[str] | None) -> list[str] | None:
        """`stop` as a list (`text.stop_strings`: a string is one stop string; an empty one is refused)."""
        return None if stop is None else stop_strings(stop)

    @model_validator(mode="after")
    def check_options(self) -> "GenerationRequest":
        try:
            SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p)
            if self.seed is not None:
                check_seed(self.seed)
        except ValueError as error:  # their messages start with the option's name
            raise OptionError(str(error), str(error).split()[0]) from None
        for name in ("max_tokens", "max_completion_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise OptionError(f"{name} must be >= 1, got {getattr(self, name)}", name)
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise OptionError(f"max_tokens ({self.max_tokens}) and max_completion_tokens ({self.max_completion_tokens}) "
                              "differ: give one of them", "max_completion_tokens")
        if self.stream_options is not None and not self.stream:
            raise OptionError("stream_options is only allowed with stream: true", "stream_options")
        if self.n != 1:
            raise OptionError(f"n must be 1 (one completion per request), got {self.n}", "n")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def usage_chunk(self) -> bool:
        """Whether a stream ends with a chunk of its own for `usage` (OpenAI's `stream_options.include_usage`)."""
        return self.stream_options is not None and self.stream_options.include_usage

    def generation_options(self) -> dict:
        """Keyword arguments of `SpecSampler.stream`, max_new_tokens None when the client gave none."""
        return dict(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, min_p=self.min_p, seed=self.seed, stop=self.stop or [],
            prediction=None if self.prediction is None else self.prediction.text,
        )


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]  # developer: OpenAI's newer name for system
    content: str | list[TextPart]

    @model_validator(mode="before")
    @classmethod
    def text_content_only(cls, data: object) -> object:
        """A one-line error naming what the content holds, where pydantic's would name the union's first
        branch ("Input should be a valid string") for an image part, a refusal part or a null."""
        if isinstance(data, dict) and "content" in data:
            content = data["content"]
            if isinstance(content, list):
                for part in content:
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    if kind != "text":
                        raise ValueError(f"content parts of type {kind!r} are not supported: this server takes text only")
                    if not isinstance(part.get("text"), str):
                        raise ValueError(f"a text part needs its text as a string, got {part.get('text')!r}")
            elif not isinstance(content, str):
                raise ValueError(f"content must be a string or a list of text parts, got {content!r}")
        return data

    def as_message(self) -> Message:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(GenerationRequest):
    prompt: str | list[str]

    @field_validator("prompt", mode="before")
    @classmethod
    def text_prompt(cls, prompt: object) -> object:
        """A one-line error for a prompt of token ids (OpenAI takes them; this server takes text), where
        pydantic's would name the union's branches ("prompt.str: Input should be a valid string")."""
        if isinstance(prompt, list) and any(not isinstance(part, str) for part in prompt):
            raise ValueError("a string or a list of one string is expected: prompts of token ids are not supported")
        if not isinstance(prompt, (str, list)):
            raise ValueError(f"a string or a list of one string is expected, got {prompt!r}")
        return prompt

    @model_validator(mode="after")
    def check_prompt(self) -> "CompletionRequest":
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise OptionError(f"prompt must be a string or a list of one string, got a list of {len(self.prompt)}", "prompt")
        if not self.text:
            raise OptionError("the prompt is empty", "prompt")
        return self

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class ErrorDetail(BaseModel):
    message: str
    type: str  # invalid_request_error, authentication_error, server_error
    param: str | None = None  # the request's field at fault
    code: str | None = None  # queue_full, replica_failed, model_not_found, ...


class ErrorResponse(BaseModel):
    """The body of every error answer (`error_body`), as the OpenAI API's."""

    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int, dict]:
    """OpenAPI's description of a route's error answers (FastAPI's `responses=`)."""
    meaning = {400: "a bad request: the field at fault in `param`", 401: "a missing or wrong API key",
               404: "no such model", 503: "busy (`queue_full`) or a replica failed; retry after Retry-After"}
    return {status: {"model": ErrorResponse, "description": meaning[status]} for status in statuses}


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """An error as the OpenAI API returns it."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
